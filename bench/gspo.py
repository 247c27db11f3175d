"""GSPO beside GRPO on the embedded task (docs/results.md#gspo-beside-grpo): with --num_epochs > 1
each batch is reused, so the two losses part (with one update per batch their gradients are equal,
docs/group_family.md#gspo-grpopy---importance_sampling_level-sequence). Three variants, over seeds:
GRPO with --num_epochs (token-level ratio, its default epsilon 0.2), GSPO with --num_epochs
(--importance_sampling_level sequence, its default clip range 1 - 3e-4 .. 1 + 4e-4), and on-policy
GRPO (--num_epochs 1) as the reference. Every other flag is grpo.py's default.

Runs --jobs at a time, one thread each; a run whose run.json shows the same command and a
finished summary.json is reused (--force reruns it).

    python bench/gspo.py --num_steps 300 --jobs 2                          # docs/results.md's tables: 9 runs
    python bench/gspo.py --jobs 2                                          # the same at grpo.py's 600 steps
    python bench/gspo.py --seeds 0 --num_steps 2 --batch_size 8 --out /tmp/gspo   # smoke test

Writes to --out (default runs/gspo_cmp): results.md (the table and the command), results.json and
one folder per run (<variant>_s<seed>).
"""
import argparse
import json
import shlex
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.stability import mean_std, run_cached, write_results  # noqa: E402
from support import run  # noqa: E402

VARIANTS = {  # folder name -> (table name, extra grpo.py arguments); EPOCHS stands for --num_epochs
    "grpo_mu1": ("GRPO, on-policy (mu = 1)", ["--num_epochs", "1"]),
    "grpo": ("GRPO, token ratio, eps 0.2 (mu = EPOCHS)", ["--num_epochs", "EPOCHS"]),
    "gspo": ("GSPO, sequence ratio, eps 3e-4 / 4e-4 (mu = EPOCHS)",
             ["--num_epochs", "EPOCHS", "--importance_sampling_level", "sequence"]),
}


def run_one(variant, seed, args):
    run_dir = Path(args.out) / f"{variant}_s{seed}"
    cmd = [sys.executable, str(ROOT / "lab" / "grpo.py"), "--seed", str(seed), "--num_steps", str(args.num_steps),
           "--output_dir", str(run_dir), "--save_model", "False",
           *(["--batch_size", str(args.batch_size)] if args.batch_size else []),
           *[str(args.num_epochs) if a == "EPOCHS" else a for a in VARIANTS[variant][1]]]
    return run_cached(cmd, run_dir, args.force)


def summarise(run_dir):
    """One run's numbers: held-out accuracy at the start and the end, the train/ metrics' mean over steps
    (grpo.py logs those of the last update of each batch, the most off-policy one) and its wall time."""
    rows = run.read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "train/grad_norm" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    return {"before": evals[0]["eval/accuracy"], "after": evals[-1]["eval/accuracy"],
            "curve": {r["step"]: r["eval/accuracy"] for r in evals},
            "clip_frac": statistics.mean(r["train/clip_frac_low"] + r["train/clip_frac_high"] for r in steps),
            "clip_frac_low": statistics.mean(r["train/clip_frac_low"] for r in steps),
            "clip_frac_high": statistics.mean(r["train/clip_frac_high"] for r in steps),
            "approx_kl": statistics.mean(r["train/approx_kl"] for r in steps),
            "grad_norm": statistics.mean(r["train/grad_norm"] for r in steps),
            "train_correct": statistics.mean(r["train/correct"] for r in steps),
            "wall_s": json.loads((run_dir / "run.json").read_text())["wall_s"]}


def name_of(variant, num_epochs):
    return VARIANTS[variant][0].replace("EPOCHS", str(num_epochs))


def table(results, num_epochs):
    lines = ["| variant | held-out accuracy (start → end) | end, per seed | clipped (low + high) | approx KL "
             "| grad norm | train accuracy | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for variant, runs in results.items():
        col = {key: [r[key] for r in runs] for key in runs[0]}
        start = format(col["before"][0], ".3f") if len(set(col["before"])) == 1 else mean_std(col["before"], ".3f")
        lines.append(f"| {name_of(variant, num_epochs)} | {start} → **{mean_std(col['after'], '.3f')}** "
                     f"| {' / '.join(format(a, '.3f') for a in col['after'])} "
                     f"| {mean_std(col['clip_frac'], '.4f')} | {mean_std(col['approx_kl'], '.1e')} "
                     f"| {mean_std(col['grad_norm'], '.2f')} | {mean_std(col['train_correct'], '.3f')} "
                     f"| {mean_std(col['wall_s'], '.0f')} |")
    return lines


def curve_table(results, num_epochs):
    """Held-out accuracy at every evaluation, mean over seeds."""
    steps = list(next(iter(results.values()))[0]["curve"])
    lines = ["| held-out accuracy at step | " + " | ".join(map(str, steps)) + " |", "|---" * (len(steps) + 1) + "|"]
    for variant, runs in results.items():
        means = [statistics.mean(r["curve"][step] for r in runs) for step in steps]
        lines.append(f"| {name_of(variant, num_epochs)} | " + " | ".join(format(m, ".3f") for m in means) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num_steps", type=int, default=600, help="grpo.py --num_steps of every run.")
    parser.add_argument("--num_epochs", type=int, default=4, help="mu of the GRPO and GSPO variants (> 1).")
    parser.add_argument("--batch_size", type=int, default=None, help="grpo.py --batch_size (default: its).")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=1, help="Runs at the same time.")
    parser.add_argument("--out", default="runs/gspo_cmp")
    parser.add_argument("--force", action="store_true", help="Rerun finished runs.")
    args = parser.parse_args()
    if args.num_epochs < 2:
        parser.error("--num_epochs must be > 1: with one update per batch GSPO's gradient is GRPO's")

    with ThreadPoolExecutor(args.jobs) as pool:  # seed-major, so that a seed's variants finish together
        futures = {(v, s): pool.submit(run_one, v, s, args) for s in args.seeds for v in args.variants}
        results = {v: [summarise(futures[v, s].result()) for s in args.seeds] for v in args.variants}
    command = shlex.join(["python", "bench/gspo.py", *sys.argv[1:]])
    runs_s = sum(r["wall_s"] for runs in results.values() for r in runs)
    text = "\n".join([f"`{command}` ({len(args.seeds)} seeds, {args.num_steps} steps each, {args.jobs} at a time, "
                      f"one thread each; the runs' wall times sum to {runs_s:.0f} s; mean ± std over seeds; clipped, "
                      "approx KL, grad norm and train accuracy: means over every step, of the last update of each "
                      "batch)", "",
                      *table(results, args.num_epochs), "", *curve_table(results, args.num_epochs), ""])
    write_results(args.out, text, results)


if __name__ == "__main__":
    main()
