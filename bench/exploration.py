"""Exploration budgets measured: GRPO with a uniform budget (G independent samples per prompt) against Knapsack RL's
allocation (--budget knapsack) and TreePO's trees (--sampler tree) on the embedded task, at equal sampled completions
(--batch_size 64 per step), and the trees again at about the uniform arm's decoded tokens (tree_b96: 96 leaves a
step), over seeds.

The training pool is small (--train_size) so that every prompt comes back and its success rate (its latest answers)
means something: with the task's 20,000 prompts a 300-step run draws 2,400 and almost every draw is unseen, where the
knapsack gives the uniform share. Reported per arm, as mean (min..max) over seeds: held-out greedy accuracy at the
end, overall and per family; the mean over steps of train/frac_zero_std_groups (groups whose rewards are all
equal), of train/effective_samples (rows with a non-zero advantage, of --batch_size), of train/completion_len
(tokens per completion) and of train/decoded_per_completion (the tokens decoded per completion: fewer than its
length where a tree shares prefixes).

Each run is `python lab/grpo.py --seed S ...` in its own subprocess, --jobs at a time, one torch thread each; a run
whose summary.json exists is reused (--force reruns).

    python bench/exploration.py                                          # docs/exploration.md
    python bench/exploration.py --steps 4 --eval_every 2 --seeds 0 --out /tmp/expl   # smoke test

Writes to --out (default runs/exploration): results.md (the table, the command), results.json, exploration.png
(held-out accuracy and effective samples against the step, mean over seeds) and one folder per run.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support import run  # noqa: E402

# tree_b96: 12 trees a step, whose decoded tokens are about those of the uniform arm's 8 groups of 8
ARMS = {"uniform": [], "knapsack": ["--budget", "knapsack"], "tree": ["--sampler", "tree"],
        "tree_b96": ["--sampler", "tree", "--batch_size", "96"]}
COLORS = {"uniform": "tab:gray", "knapsack": "tab:orange", "tree": "tab:green", "tree_b96": "tab:olive"}
TRAIN_KEYS = ("train/frac_zero_std_groups", "train/effective_samples", "train/completion_len",
              "train/decoded_per_completion")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--train_size", type=int, default=200, help="Training prompts (40 per family).")
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/exploration")
    parser.add_argument("--force", action="store_true")
    return parser.parse_args()


def command(args, arm, seed, out):
    return [sys.executable, "lab/grpo.py", "--seed", str(seed), "--num_steps", str(args.steps), "--train_size",
            str(args.train_size), "--eval_every", str(args.eval_every), "--log_rollouts", "0", "--save_model",
            "False", "--output_dir", str(out), *ARMS[arm]]


def run_all(args, runs):
    """Start the runs not done yet, --jobs at a time; their wall times in seconds (None: reused)."""
    todo = [(key, cmd, out) for key, (cmd, out) in runs.items() if args.force or not (out / "summary.json").exists()]
    walls, running = {}, []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    while todo or running:
        while todo and len(running) < args.jobs:
            key, cmd, out = todo.pop(0)
            out.mkdir(parents=True, exist_ok=True)
            log = open(out / "log.txt", "w")
            running.append((key, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), time.time(), log))
            print("started", shlex.join(cmd[1:]), flush=True)
        time.sleep(1)
        for item in [r for r in running if r[1].poll() is not None]:
            key, proc, start, log = item
            log.close()
            running.remove(item)
            if proc.returncode != 0:
                sys.exit(f"error: run {key} failed: see {runs[key][1] / 'log.txt'}")
            walls[key] = time.time() - start
    return walls


def summarise(values):
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def main():
    args = parse_args()
    out = Path(args.out)
    runs = {(arm, seed): (command(args, arm, seed, out / f"{arm}_s{seed}"), out / f"{arm}_s{seed}")
            for arm in args.arms for seed in args.seeds}
    walls = run_all(args, runs)
    results = {}
    for arm in args.arms:
        per_seed = []
        for seed in args.seeds:
            rows = run.read_metrics(runs[arm, seed][1] / "metrics.jsonl")
            train = [row for row in rows if "train/effective_samples" in row]
            final = [row for row in rows if "eval/accuracy" in row][-1]
            per_seed.append({**{k: v for k, v in final.items() if k.startswith("eval/")},
                             **{k: sum(row[k] for row in train) / len(train) for k in TRAIN_KEYS},
                             "wall_s": walls.get((arm, seed))})
        results[arm] = {"runs": per_seed, **{k: summarise([r[k] for r in per_seed]) for k in per_seed[0]
                                              if k != "wall_s"}}
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    write_table(args, results, out / "results.md")
    plot(args, runs, out / "exploration.png")
    print((out / "results.md").read_text())


def write_table(args, results, path):
    evals = sorted(k for k in results[args.arms[0]] if k.startswith("eval/"))
    columns = [*evals, *TRAIN_KEYS]
    lines = [f"`python bench/exploration.py {shlex.join(sys.argv[1:])}`: GRPO, {args.steps} steps, "
             f"--train_size {args.train_size}, seeds {args.seeds}; mean (min..max) over seeds; held-out accuracy at "
             "the last step, the train/ columns averaged over the steps.", "",
             "| arm | " + " | ".join(c.split("/")[1] for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for arm in args.arms:
        cells = [f"{results[arm][c]['mean']:.3f} ({results[arm][c]['min']:.3f}..{results[arm][c]['max']:.3f})"
                 for c in columns]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def plot(args, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm in args.arms:
        curves = {"eval/accuracy": {}, "train/effective_samples": {}}
        for seed in args.seeds:
            for row in run.read_metrics(runs[arm, seed][1] / "metrics.jsonl"):
                for key, points in curves.items():
                    if key in row:
                        points.setdefault(row["step"], []).append(row[key])
        for ax, (key, points) in zip(axes, curves.items()):
            steps = sorted(points)
            values = [sum(points[s]) / len(points[s]) for s in steps]
            if key.startswith("train/"):  # a moving average over 25 steps
                values = [sum(values[max(0, i - 24):i + 1]) / len(values[max(0, i - 24):i + 1])
                          for i in range(len(values))]
            ax.plot(steps, values, label=arm, color=COLORS[arm])
            ax.set_title(f"{key} (mean over {len(args.seeds)} seeds)")
            ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
