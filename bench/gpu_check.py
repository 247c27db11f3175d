"""Every algorithm on a GPU: peak GPU memory, time per step and generation speed of remax.py, grpo.py,
rloo.py, dapo.py and ppo.py, each for --steps steps on a randomly initialised model of Qwen2.5-0.5B's shape,
under `accelerate launch --mixed_precision bf16` and then fp16 on one GPU; with two or more GPUs also under
DeepSpeed ZeRO-3 on all of them (configs/zero3.yaml; ppo.py refuses DeepSpeed and is left out there).

Run in part on one NVIDIA H200 (docs/results/gpu_check_h200.md: ReMax, GRPO, RLOO in bf16; GRPO and PPO in fp16);
never with two GPUs or more. Its code path is tested on CPU with a tiny model (--allow_cpu, tests/test_gpu_check.py).
The report is rewritten after each run, so a run cut short keeps the rows it finished.

The model has Qwen2.5-0.5B's shape (hidden 896, MLP 4864, 24 layers, 14 heads, 2 KV heads, tied embeddings)
and vocabulary size (151,936: the completion logits are a large part of a step's memory), random weights, and
the embedded character tokenizer, which decodes the ids it knows and drops the others: nothing is downloaded.
With 151,936 tokens the random model almost never samples EOS, so completions run to --max_new_tokens. It
answers nothing right either, so the child replaces the reward with a random 0/1 per completion: the
advantages are not all 0, and DAPO's dynamic sampling keeps groups instead of dropping every one.

Each run is a subprocess, `accelerate launch [--config_file configs/zero3.yaml --num_processes N]
--mixed_precision P bench/gpu_check.py --child SCRIPT RESULT -- FLAGS`. The child is bench/cost.py's run_child:
it imports the script and runs its main() with held-out evaluation stubbed out and saving off, and records
torch.cuda.max_memory_allocated() over the whole run, one file per process (the table shows the largest).
From metrics.jsonl, averaged over the steps after the first: s/step (time/step_s), generation tokens/s
(completion tokens generated per second of the generation phase: train/completion_len x train/generated /
time/generation_s, so ReMax's greedy decodes count at the sampled mean length) and completion tokens per
second of the whole step (time/tokens_per_s).

Without CUDA it says so and exits 0. With --allow_cpu it runs instead, on CPU, a 2-layer model of the same
family and vocabulary, to test the code path; its numbers mean nothing.

    python bench/gpu_check.py                                           # -> runs/gpu_check/gpu_check.md
    python bench/gpu_check.py --algorithms remax,grpo --precisions bf16 --steps 5
    python bench/gpu_check.py --allow_cpu --algorithms remax --steps 2 --batch_size 4 --max_new_tokens 4
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.cost import ALGORITHMS, child_env, make_large_model, write_report  # noqa: E402
from support.run import read_metrics  # noqa: E402

# Qwen2.5-0.5B's shape and vocabulary; TINY is the same family for the CPU smoke path
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = {**QWEN25_05B, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
MiB = 2 ** 20


# ----------------------------------------------------------------------------------------
# child: bench/cost.py's, with a random reward
# ----------------------------------------------------------------------------------------
def random_reward_scorer(cfg, device, reward_model=None):
    """A reward of 0 or 1 at random per completion, in place of tasks.reward_scorer: the learner's reward_fn and
    (--async_rollouts) the sampler process's."""
    import torch

    def score(examples, completions, episodes=None):
        correct = torch.randint(0, 2, (len(completions),), device=device).float()
        return correct, correct, {}, None

    return score


def run_child(script, result_path, script_args):
    import torch

    from bench.cost import run_child as run_cost_child
    from support import tasks

    if torch.cuda.is_available():  # this process's GPU before run_child touches one: else every rank opens GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    tasks.reward_scorer = random_reward_scorer
    run_cost_child(script, f"{result_path}.rank{os.environ.get('RANK', '0')}", script_args)


# ----------------------------------------------------------------------------------------
# parent: build the model, one subprocess per (setting, precision, algorithm), the table
# ----------------------------------------------------------------------------------------
def count_params(model_path):
    """Parameters of the saved model, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def run_one(algorithm, precision, launch, model_path, args, workdir):
    name = f"{algorithm}_{precision}_{launch['name']}"
    out_dir, result_path = Path(workdir) / name, Path(workdir) / f"{name}.json"
    script_args = ["--model_name_or_path", model_path, "--num_steps", str(args.steps),
                   "--batch_size", str(args.batch_size), "--micro_batch_size", str(args.micro_batch_size),
                   "--max_new_tokens", str(args.max_new_tokens), "--eval_every", "1000000", "--log_every", "1000000",
                   "--save_model", "False", "--seed", "0", "--output_dir", str(out_dir)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch["flags"], "--num_machines", "1",
           "--dynamo_backend", "no", "--mixed_precision", precision, str(Path(__file__).resolve()), "--child",
           str(ROOT / "lab" / f"{algorithm}.py"), str(result_path), "--", *script_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[{name}] failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"algorithm": algorithm, "precision": precision, "setting": launch["name"],
                "failed": f"exit {proc.returncode}"}
    ranks = [json.loads(p.read_text()) for p in sorted(Path(workdir).glob(f"{name}.json.rank*"))]
    rows = read_metrics(out_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "time/step_s" in r]  # DAPO skips a step that kept no group
    timed = steps[1:] or steps
    if not timed:
        print(f"[{name}] trained no step", file=sys.stderr)
        return {"algorithm": algorithm, "precision": precision, "setting": launch["name"], "failed": "no step trained"}
    on_gpu = ranks[0]["cuda_peak_bytes"] is not None

    def mean(value):
        return sum(value(r) for r in timed) / len(timed)

    return {"algorithm": algorithm, "precision": precision, "setting": launch["name"], "device": ranks[0]["device"],
            "processes": len(ranks), "on_gpu": on_gpu, "timed_steps": len(timed),
            "peak_bytes": max(r["cuda_peak_bytes"] if on_gpu else r["peak_rss_bytes"] for r in ranks),
            "step_s": mean(lambda r: r["time/step_s"]),
            "generation_tokens_per_s": mean(lambda r: r["train/completion_len"] * r["train/generated"]
                                            / r["time/generation_s"]),
            "tokens_per_s": mean(lambda r: r["time/tokens_per_s"]),
            "completion_len": mean(lambda r: r["train/completion_len"])}


def table(results):
    on_gpu = any(r.get("on_gpu") for r in results)
    peak = "peak GPU memory allocated (MiB)" if on_gpu else "peak RSS (MiB)"
    lines = [f"| setting | precision | algorithm | processes | {peak} | s/step | generation tokens/s | "
             "step tokens/s | completion len | steps timed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['setting']} | {r['precision']} | {r['algorithm']} | failed: {r['failed']} "
                         "| | | | | | |")
            continue
        lines.append(f"| {r['setting']} | {r['precision']} | {r['algorithm']} | {r['processes']} "
                     f"| {r['peak_bytes'] / MiB:,.0f} | {r['step_s']:.3f} | {r['generation_tokens_per_s']:,.0f} "
                     f"| {r['tokens_per_s']:,.0f} | {r['completion_len']:.1f} | {r['timed_steps']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="Comma list of scripts.")
    parser.add_argument("--precisions", default="bf16,fp16", help="Comma list of accelerate --mixed_precision values.")
    parser.add_argument("--steps", type=int, default=3, help="Training steps per run; the first is not timed.")
    parser.add_argument("--batch_size", type=int, default=16, help="Sampled completions per step per process.")
    parser.add_argument("--micro_batch_size", type=int, default=8,
                        help="Sequences per forward/backward pass (rloo.py: a multiple of its 8 samples per prompt).")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="Completion length (reached: EOS is rare).")
    parser.add_argument("--allow_cpu", action="store_true", help="Without CUDA, run a tiny model on CPU instead.")
    parser.add_argument("--out", default=str(ROOT / "runs/gpu_check/gpu_check.md"),
                        help="Markdown file for the table, and the raw numbers next to it as .json ('' = stdout only).")
    args = parser.parse_args()
    for name in args.algorithms.split(","):
        if name not in ALGORITHMS:
            parser.error(f"--algorithms: unknown {name!r} (one of {', '.join(ALGORITHMS)})")

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("No CUDA GPU here: bench/gpu_check.py measures GPU memory and speed, and has nothing to measure. "
              "--allow_cpu runs a tiny model on CPU instead, to test the code path.")
        return
    gpus = torch.cuda.device_count() if on_gpu else 0
    launches = [{"name": "1 GPU" if on_gpu else "CPU", "flags": ["--num_processes", "1"]}]
    if gpus >= 2:
        launches.append({"name": f"ZeRO-3 x {gpus}", "flags": ["--config_file", str(ROOT / "configs" / "zero3.yaml"),
                                                               "--num_processes", str(gpus)]})
    runs = [(algorithm, precision, launch) for launch in launches for precision in args.precisions.split(",")
            for algorithm in args.algorithms.split(",")
            if not (algorithm == "ppo" and launch["name"].startswith("ZeRO"))]  # ppo.py refuses DeepSpeed
    results, start = [], time.time()
    device = torch.cuda.get_device_name() if on_gpu else "CPU (--allow_cpu: a tiny model, to test the code path only)"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        model_path = make_large_model(os.path.join(tmp, "model"), QWEN25_05B if on_gpu else TINY)
        params = count_params(model_path)
        for algorithm, precision, launch in runs:
            print(f"[{launch['name']}, {precision}] {algorithm} ...", file=sys.stderr, flush=True)
            results.append(run_one(algorithm, precision, launch, model_path, args, tmp))
            header = [f"Device: {device}; {gpus} GPU(s); torch {torch.__version__}.",
                      f"Model: random Qwen2, {params / 1e6:.1f}M parameters; {args.steps} steps per run, the first "
                      f"left out of the times; batch {args.batch_size}, micro-batch {args.micro_batch_size}, "
                      f"max_new_tokens {args.max_new_tokens}; random 0/1 rewards; each script's defaults otherwise.",
                      f"Command: `{shlex.join(['python', 'bench/gpu_check.py', *sys.argv[1:]])}`; "
                      f"{time.time() - start:.0f} s; {len(results)} of {len(runs)} runs."]
            # after each run: cut short by a time limit, the report keeps the rows it finished
            write_report(args.out, "\n".join(header) + "\n\n" + table(results) + "\n", results)
    if any("failed" in r for r in results):
        raise SystemExit("error: some runs failed (above)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        separator = sys.argv.index("--")
        run_child(sys.argv[2], sys.argv[3], sys.argv[separator + 1:])
    else:
        main()
