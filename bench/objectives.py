"""The clipped-objective family on the embedded task (docs/objectives.md#measured): lab/grpo.py with --policy_loss
ppo | cispo | sapo | gmpo, each batch reused for --num_epochs optimizer steps (on-policy, with one update per batch,
their gradients are equal: tests/test_objectives.py), over seeds. Every other flag is lab/grpo.py's default (the KL
term, --beta 0.04, included), each objective at its own default clip or gate (PPO eps 0.2; CISPO no lower bound, the
cap r <= 5; SAPO tau 1.0 / 1.05; GMPO the log-clip 0.4).

Runs --jobs at a time, one thread each; a run whose run.json shows the same command and a finished summary.json is
reused (--force reruns it).

    python bench/objectives.py --num_steps 300 --jobs 2                      # docs/objectives.md's table: 12 runs
    python bench/objectives.py --seeds 0 --num_steps 2 --batch_size 8 --out /tmp/objectives   # smoke test

Writes to --out (default runs/objectives): results.md (the table and the command), results.json and one folder per
run (<objective>_s<seed>).
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

OBJECTIVES = {"ppo": "PPO clip, eps 0.2", "cispo": "CISPO, r capped at 5", "sapo": "SAPO, tau 1.0 / 1.05",
              "gmpo": "GMPO, log-clip 0.4"}


def run_one(objective, seed, args):
    run_dir = Path(args.out) / f"{objective}_s{seed}"
    cmd = [sys.executable, str(ROOT / "lab" / "grpo.py"), "--policy_loss", objective, "--num_epochs",
           str(args.num_epochs), "--seed", str(seed), "--num_steps", str(args.num_steps), "--output_dir", str(run_dir),
           "--save_model", "False", *(["--batch_size", str(args.batch_size)] if args.batch_size else [])]
    return run_cached(cmd, run_dir, args.force)


def summarise(run_dir):
    """One run's numbers: held-out accuracy at the start and the end, the train/ metrics' mean over steps (those of
    the last update of each batch, the most off-policy one) and its wall time. The clipped fraction counts the tokens
    past the clip on the side that binds (CISPO: capped, either sign); SAPO clips none: its gate weight is the mean of
    w(r) over the tokens (1 on-policy)."""
    rows = run.read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "train/grad_norm" in r]
    evals = [r for r in rows if "eval/accuracy" in r]

    def mean(key):
        return statistics.mean(r[key] for r in steps) if key in steps[0] else float("nan")
    return {"before": evals[0]["eval/accuracy"], "after": evals[-1]["eval/accuracy"],
            "curve": {r["step"]: r["eval/accuracy"] for r in evals},
            "clip_frac": mean("train/clip_frac_low") + mean("train/clip_frac_high"), "gate": mean("train/gate_weight"),
            "approx_kl": mean("train/approx_kl"), "grad_norm": mean("train/grad_norm"), "entropy": mean("train/entropy"),
            "wall_s": json.loads((run_dir / "run.json").read_text())["wall_s"]}


def table(results):
    lines = ["| objective | held-out accuracy (start → end) | end, per seed | clipped | gate weight | approx KL "
             "| grad norm | entropy | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for objective, runs in results.items():
        col = {key: [r[key] for r in runs] for key in runs[0]}
        start = format(col["before"][0], ".3f") if len(set(col["before"])) == 1 else mean_std(col["before"], ".3f")
        nan = "–"
        lines.append(f"| {OBJECTIVES[objective]} | {start} → **{mean_std(col['after'], '.3f')}** "
                     f"| {' / '.join(format(a, '.3f') for a in col['after'])} "
                     f"| {nan if objective == 'sapo' else mean_std(col['clip_frac'], '.4f')} "
                     f"| {mean_std(col['gate'], '.4f') if objective == 'sapo' else nan} "
                     f"| {mean_std(col['approx_kl'], '.1e')} | {mean_std(col['grad_norm'], '.2f')} "
                     f"| {mean_std(col['entropy'], '.3f')} | {mean_std(col['wall_s'], '.0f')} |")
    return lines


def curve_table(results):
    """Held-out accuracy at every evaluation, mean over seeds."""
    steps = list(next(iter(results.values()))[0]["curve"])
    lines = ["| held-out accuracy at step | " + " | ".join(map(str, steps)) + " |", "|---" * (len(steps) + 1) + "|"]
    for objective, runs in results.items():
        means = [statistics.mean(r["curve"][step] for r in runs) for step in steps]
        lines.append(f"| {OBJECTIVES[objective]} | " + " | ".join(format(m, ".3f") for m in means) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num_steps", type=int, default=300, help="lab/grpo.py --num_steps of every run.")
    parser.add_argument("--num_epochs", type=int, default=4, help="mu: optimizer steps per batch (> 1).")
    parser.add_argument("--batch_size", type=int, default=None, help="lab/grpo.py --batch_size (default: its).")
    parser.add_argument("--objectives", nargs="+", choices=list(OBJECTIVES), default=list(OBJECTIVES))
    parser.add_argument("--jobs", type=int, default=1, help="Runs at the same time.")
    parser.add_argument("--out", default="runs/objectives")
    parser.add_argument("--force", action="store_true", help="Rerun finished runs.")
    args = parser.parse_args()
    if args.num_epochs < 2:
        parser.error("--num_epochs must be > 1: with one update per batch the objectives' gradients are equal")

    with ThreadPoolExecutor(args.jobs) as pool:  # seed-major, so that a seed's objectives finish together
        futures = {(o, s): pool.submit(run_one, o, s, args) for s in args.seeds for o in args.objectives}
        results = {o: [summarise(futures[o, s].result()) for s in args.seeds] for o in args.objectives}
    command = shlex.join(["python", "bench/objectives.py", *sys.argv[1:]])
    runs_s = sum(r["wall_s"] for runs in results.values() for r in runs)
    text = "\n".join([f"`{command}` ({len(args.seeds)} seeds, {args.num_steps} steps each, mu = {args.num_epochs}, "
                      f"{args.jobs} at a time, one thread each; the runs' wall times sum to {runs_s:.0f} s; mean ± std "
                      "over seeds; clipped, gate weight, approx KL, grad norm and entropy: means over every step, of "
                      "the last update of each batch)", "", *table(results), "", *curve_table(results), ""])
    write_results(args.out, text, results)


if __name__ == "__main__":
    main()
