"""GRPO with a vLLM engine as the sampler (--sampler vllm) beside this repository's decode loop: seconds per step, the
trainer-engine gap in fp32 and bf16, and what each of the lab's corrections does to it (docs/vllm.md).

Each row is one `lab/grpo.py` run from the same start and seed, --steps steps, one process; the table gives the
medians over the steps after the first (the first step's seconds include the engine's first compilation) of the
step's and the sampling's seconds, and the means over all steps of the mismatch metrics (train/mismatch_k3: KL of
the sampler to the trainer, per token; the extremes of the per-token ratio pi_trainer / pi_engine; the importance
weights' effective sample size), the fraction of tokens each correction acts on, and the held-out accuracy at the end.
The engine's start (its own process, its environment's imports, the model) is reported once per run.

    python bench/vllm.py                          # -> runs/bench_vllm/vllm.md (about 15 minutes on 2 CPU cores)
    python bench/vllm.py --steps 20 --rows ours,vllm
    python bench/vllm.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset gsm8k ...   # on a GPU
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS = {  # name: (what it is, its flags)
    "ours": ("this repository's decode loop (the default)", []),
    "vllm": ("vLLM, fp32", ["--sampler", "vllm"]),
    "vllm_bf16": ("vLLM, bf16 weights (--rollout_dtype bfloat16)", ["--sampler", "vllm", "--rollout_dtype",
                                                                   "bfloat16"]),
    "tis": ("vLLM bf16, TIS (--tis_cap 2)", ["--sampler", "vllm", "--rollout_dtype", "bfloat16", "--tis_cap", "2"]),
    "geo": ("vLLM bf16, geometric mask (--geo_mask_delta 0.001)", ["--sampler", "vllm", "--rollout_dtype", "bfloat16",
                                                                   "--geo_mask_delta", "0.001"]),
    "veto": ("vLLM bf16, sequence TIS and veto (--tis_level sequence --tis_cap 2 --tis_veto 0.5)",
             ["--sampler", "vllm", "--rollout_dtype", "bfloat16", "--tis_level", "sequence", "--tis_cap", "2",
              "--tis_veto", "0.5"]),
    "m2po": ("vLLM bf16, M2PO (--m2po_tau 0.04)", ["--sampler", "vllm", "--rollout_dtype", "bfloat16", "--m2po_tau",
                                                   "0.04"]),
}
GAP = ["mismatch_k3", "mismatch_ratio_max", "mismatch_ratio_min", "is_ess"]
ACTED = ["tis_clip_frac", "geo_masked_frac", "tis_veto_frac", "m2po_masked_frac"]


def run(name, args, extra, out_dir):
    cmd = [sys.executable, "lab/grpo.py", *ROWS[name][1], "--num_steps", str(args.steps), "--eval_every",
           str(args.steps), "--log_rollouts", "0", "--save_model", "False", "--output_dir", str(out_dir / name),
           *extra]
    began = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"row": name, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in open(out_dir / name / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] > 0]
    later = steps[1:] or steps
    started = [line for line in proc.stderr.splitlines() if line.startswith("vLLM ")]
    out = {"row": name, "wall_s": time.time() - began, "engine_start": started[0] if started else "",
           "step_s": statistics.median(r["time/step_s"] for r in later),
           "generation_s": statistics.median(r["time/generation_s"] for r in later),
           "accuracy": [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]}
    for key in GAP + ACTED:
        values = [r[f"train/{key}"] for r in steps if f"train/{key}" in r]
        out[key] = statistics.fmean(values) if values else None
    return out


def cell(value, spec):
    return "" if value is None else format(value, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"Comma list of {', '.join(ROWS)}.")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run.")
    parser.add_argument("--out", default=str(ROOT / "runs/bench_vllm/vllm.md"),
                        help="Markdown file for the report, and the raw numbers beside it as .json.")
    args, extra = parser.parse_known_args()  # the rest goes to every lab/grpo.py run
    names = args.rows.split(",")
    for name in names:
        if name not in ROWS:
            parser.error(f"--rows: unknown {name!r} (one of {', '.join(ROWS)})")
    out_dir = Path(args.out).parent
    results = []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        results.append(run(name, args, extra, out_dir))
    lines = ["| sampler | s/step | sampling s/step | mismatch_k3 | ratio max | ratio min | is_ess | acted on "
             "(tis clip / geo mask / veto / m2po) | held-out accuracy |", "|---" * 9 + "|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {ROWS[r['row']][0]} | failed: {r['failed']} |" + " |" * 7)
            continue
        acted = " / ".join(cell(r[k], ".4f") for k in ACTED)
        lines.append(f"| {ROWS[r['row']][0]} | {r['step_s']:.3f} | {r['generation_s']:.3f} | "
                     f"{cell(r['mismatch_k3'], '.2e')} | {cell(r['mismatch_ratio_max'], '.4f')} | "
                     f"{cell(r['mismatch_ratio_min'], '.4f')} | {cell(r['is_ess'], '.4f')} | {acted} | "
                     f"{' -> '.join(f'{a:.3f}' for a in r['accuracy'])} |")
    starts = "; ".join(f"{r['row']}: {r['engine_start']}" for r in results if r.get("engine_start"))
    report = "\n".join([f"Command: `{shlex.join(['python', 'bench/vllm.py', *sys.argv[1:]])}`; "
                        f"{time.strftime('%Y-%m-%d')}; {args.steps} steps of lab/grpo.py each.", "",
                        *lines, "", f"Engine starts: {starts or 'none'}.", ""])
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
