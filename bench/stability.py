"""Train-inference mismatch on the embedded task (docs/stability.md): GRPO samples with a bfloat16
copy of the policy (--rollout_dtype bfloat16) while it trains in float32, or with the policy of
--lag optimizer steps ago (--rollout_lag), over seeds, with no correction, with truncated importance
sampling (--tis_cap) and with geometric sequence masking (--geo_mask_delta); a float32 run (the
trainer samples, no mismatch) is the reference.

Runs one after another (--jobs at a time), one thread each; a run whose run.json shows the same
command and a finished summary.json is reused (--force reruns it). A run takes 20-40 s on one core here.

    python bench/stability.py                                   # docs/stability.md's bfloat16 table: 12 runs, 5 min
    python bench/stability.py --lag 8 --learning_rate 3e-4 --seeds 0 1 2 3 4   # its stale-sampler table: 25 runs, 12 min
    python bench/stability.py --seeds 0 --variants float32 stale --lag 4   # a row pair of its settings tried
    python bench/stability.py --lag 8 --learning_rate 3e-4 --variants stale "stale + TIS" "stale + M2PO"  # async.md
    python bench/stability.py --steps 2 --seeds 0 --variants bfloat16 --out /tmp/stab   # smoke test

Writes to --out (default runs/stability): results.md (the table and the command), results.json and
one folder per run.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support import run  # noqa: E402

VARIANTS = {  # name -> extra grpo.py arguments; LAG stands for --lag
    "float32": [],
    "bfloat16": ["--rollout_dtype", "bfloat16"],
    "bfloat16 + TIS": ["--rollout_dtype", "bfloat16", "--tis_cap", "2"],
    "bfloat16 + geometric mask": ["--rollout_dtype", "bfloat16", "--geo_mask_delta", "0.01"],
    "stale": ["--rollout_lag", "LAG"],
    "stale + TIS": ["--rollout_lag", "LAG", "--tis_cap", "2"],
    "stale + geometric mask": ["--rollout_lag", "LAG", "--geo_mask_delta", "0.05"],
    "stale + M2PO": ["--rollout_lag", "LAG", "--m2po_tau", "0.04"],
}
BFLOAT16_TABLE = ["float32", "bfloat16", "bfloat16 + TIS", "bfloat16 + geometric mask"]
STALE_TABLE = ["float32", "bfloat16", "stale", "stale + TIS", "stale + geometric mask"]


def run_one(name, seed, args):
    label = label_of(name, args).replace(" + ", "_").replace(" ", "_")
    lr = [] if args.learning_rate is None else ["--learning_rate", str(args.learning_rate)]
    run_dir = Path(args.out) / f"{label}{'-lr' + lr[1] if lr else ''}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "lab" / "grpo.py"), "--seed", str(seed), "--num_steps", str(args.steps),
           "--eval_every", str(args.steps), "--log_every", str(args.steps), "--save_model", "false",
           "--output_dir", str(run_dir), *lr, *[str(args.lag) if a == "LAG" else a for a in VARIANTS[name]]]
    return run_cached(cmd, run_dir, args.force)


def run_cached(cmd, run_dir, force=False, threads=1):
    """Run cmd (a training script writing to run_dir) with `threads` threads, its output in run_dir/log.txt; a run
    that already finished with the same command (run_dir/run.json) is reused unless force."""
    info_path = run_dir / "run.json"
    if not force and info_path.exists() and (run_dir / "summary.json").exists() \
            and json.loads(info_path.read_text()).get("command") == cmd:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"error: {shlex.join(cmd)} failed, see {run_dir / 'log.txt'}")
    info_path.write_text(json.dumps({"command": cmd, "wall_s": round(time.time() - start, 1)}))
    return run_dir


def label_of(name, args):
    """The table's name of a variant: "stale" with its lag."""
    return name.replace("stale", f"{args.lag} steps stale")


# what the mismatch metrics read when the trainer samples (they are then not logged, docs/metrics.md)
NO_MISMATCH = {"train/mismatch_k3": 0.0, "train/mismatch_ratio_max": 1.0, "train/mismatch_ratio_min": 1.0,
               "train/tis_clip_frac": 0.0, "train/geo_masked_frac": 0.0, "train/m2po_masked_frac": 0.0}


def summarise(run_dir):
    rows = run.read_metrics(run_dir / "metrics.jsonl")
    steps = [{**NO_MISMATCH, **r} for r in rows if "train/grad_norm" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"before": summary["eval_accuracy_before"], "after": summary["eval_accuracy_after"],
            "k3": statistics.mean(r["train/mismatch_k3"] for r in steps),
            "ratio_max": max(r["train/mismatch_ratio_max"] for r in steps),
            "ratio_min": min(r["train/mismatch_ratio_min"] for r in steps),
            "tis_clip": statistics.mean(r["train/tis_clip_frac"] for r in steps),
            "masked": statistics.mean(r["train/geo_masked_frac"] for r in steps),
            "m2po_masked": statistics.mean(r["train/m2po_masked_frac"] for r in steps),
            "grad_norm_mean": statistics.mean(r["train/grad_norm"] for r in steps),
            "grad_norm_max": max(r["train/grad_norm"] for r in steps),
            "steps": len(steps), "grad_norm_above_5": sum(r["train/grad_norm"] > 5 for r in steps),
            "train_correct": statistics.mean(r["train/correct"] for r in steps),
            **{phase: statistics.median(r[f"time/{phase}_s"] for r in steps)
               for phase in ("generation", "scoring", "forward_backward")},
            "wall_s": json.loads((run_dir / "run.json").read_text())["wall_s"]}


def mean_std(values, fmt):
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def write_results(out, text, results):
    """Writes results.md (the table, also printed) and results.json (every run's numbers) into out."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.md").write_text(text)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=1))
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="grpo.py --num_steps of every run.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lag", type=int, default=0, help="--rollout_lag of the stale variants (> 0: their table).")
    parser.add_argument("--learning_rate", type=float, default=None, help="grpo.py --learning_rate (default: its).")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        help="Default: the bfloat16 table, or with --lag the stale table.")
    parser.add_argument("--jobs", type=int, default=1, help="Runs at the same time.")
    parser.add_argument("--out", default="runs/stability")
    parser.add_argument("--force", action="store_true", help="Rerun finished runs.")
    args = parser.parse_args()
    args.variants = args.variants or (STALE_TABLE if args.lag > 0 else BFLOAT16_TABLE)
    if args.lag == 0 and any(name.startswith("stale") for name in args.variants):
        parser.error("the stale variants need --lag > 0")

    with ThreadPoolExecutor(args.jobs) as pool:
        run_dirs = {name: [pool.submit(run_one, name, seed, args) for seed in args.seeds] for name in args.variants}
        results = {label_of(name, args): [summarise(run_dir.result()) for run_dir in dirs]
                   for name, dirs in run_dirs.items()}
    lines = ["| sampler, correction | held-out accuracy (start → end) | train accuracy | mismatch k3 per token "
             "| token ratio min / max | TIS capped | sequences masked | grad norm mean / max "
             "| steps with grad norm > 5 | largest grad norm per seed | s per step: sampling / scoring / update |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        col = {key: [r[key] for r in runs] for key in runs[0]}
        lines.append(f"| {name} | {mean_std(col['before'], '.3f')} → {mean_std(col['after'], '.3f')} "
                     f"| {mean_std(col['train_correct'], '.3f')} | {mean_std(col['k3'], '.1e')} "
                     f"| {min(col['ratio_min']):.3g} / {max(col['ratio_max']):.3g} "
                     f"| {mean_std(col['tis_clip'], '.4f')} | {mean_std(col['masked'], '.4f')} "
                     f"| {mean_std(col['grad_norm_mean'], '.2f')} / {max(col['grad_norm_max']):.2f} "
                     f"| {sum(col['grad_norm_above_5'])} of {sum(col['steps'])} "
                     f"| {min(col['grad_norm_max']):.1f}–{max(col['grad_norm_max']):.1f} "
                     f"| {statistics.median(col['generation']):.3f} / {statistics.median(col['scoring']):.3f} / "
                     f"{statistics.median(col['forward_backward']):.3f} |")
    command = shlex.join(["python", "bench/stability.py", *sys.argv[1:]])
    text = "\n".join([f"`{command}` ({len(args.seeds)} seeds, {args.steps} steps each; mean ± std over seeds; train "
                      "accuracy: the sampled completions' over every step; ratios and the max grad norm: the extremes "
                      "over every step; times: medians)", "", *lines, ""])
    write_results(args.out, text, results)


if __name__ == "__main__":
    main()
