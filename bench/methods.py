"""The reading list's methods beside their base on the embedded task, over seeds: REINFORCE++ (and its baseline
variant) beside GRPO and RLOO, VAPO beside PPO, Kimi k1.5's length penalty and prioritised sampling beside plain
GRPO in the lab. Every run is `python <script> <flags> --seed S --num_steps N --eval_every N` in its own
subprocess, one at a time, with --threads torch threads (a run whose summary.json exists is reused); the table (mean +- std over the seeds) is printed and
written to --out/<experiment>.md with the command that made it.

    python bench/methods.py reinforce_pp --seeds 0 1 2 --steps 150      # docs/algorithms.md's tables
    python bench/methods.py vapo --seeds 0 1 2 --steps 30
    python bench/methods.py length --seeds 0 1 2 --steps 150
    python bench/methods.py priority --seeds 0 1 2 --steps 150
    python bench/methods.py priority_pool --seeds 0 1 2 --steps 150    # a pool of 200 prompts, each seen again
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# each experiment: its runs (a name and the script with its flags) and the metrics its table shows
EXPERIMENTS = {
    "reinforce_pp": ({"GRPO": "grpo.py", "RLOO": "rloo.py", "REINFORCE++": "reinforce_pp.py",
                      "REINFORCE++-baseline": "reinforce_pp.py --baseline group"},
                     ("train/kl_seq", "train/frac_zero_std_groups")),
    "vapo": ({"PPO": "lab/ppo.py", "VAPO": "lab/ppo.py --vapo True --num_generations 1"},  # docs/results.md: G = 1
             ("first/train/value_loss", "first/train/explained_variance", "train/explained_variance")),
    "length": ({"GRPO": "lab/grpo.py", "GRPO + length penalty": "lab/grpo.py --length_penalty 1.0",
                "GRPO + length penalty 0.1": "lab/grpo.py --length_penalty 0.1"},
               ("train/completion_len", "train/length_reward")),
    "priority": ({"GRPO": "lab/grpo.py", "GRPO + prioritised sampling": "lab/grpo.py --prompt_sampling priority"},
                 ("train/frac_zero_std_groups",)),
    "priority_pool": ({"GRPO, 200 prompts": "lab/grpo.py --train_size 200",
                       "GRPO + prioritised sampling, 200 prompts": "lab/grpo.py --train_size 200 "
                                                                    "--prompt_sampling priority"},
                      ("train/frac_zero_std_groups",)),
}


def summarise(out_dir, keys, last=20):
    """Held-out accuracy after training, the median s/step, and each key's mean over the last `last` steps (a key
    `first/<name>`: its value at the first step that logs it)."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] > 0 and "time/step_s" in r]
    result = {"accuracy": json.loads((out_dir / "summary.json").read_text())["eval_accuracy_after"],
              "s/step": statistics.median(r["time/step_s"] for r in train)}
    for key in keys:
        if key.startswith("first/"):
            values = [r[key[len("first/"):]] for r in rows if key[len("first/"):] in r]
            result[key] = values[0] if values else float("nan")
        else:
            values = [r[key] for r in train[-last:] if key in r]
            result[key] = statistics.mean(values) if values else float("nan")
    return result


def table(results, keys):
    """Markdown: one row per run name, each cell mean +- std over the seeds."""
    columns = ["accuracy", *keys, "s/step"]
    lines = ["| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, seeds in results.items():
        cells = []
        for column in columns:
            values = [s[column] for s in seeds if s[column] == s[column]]  # NaN: the run does not log it
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3g} ± {spread:.2g}" if values else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/methods")
    parser.add_argument("--force", action="store_true", help="Rerun the runs whose summary.json exists.")
    args = parser.parse_args()
    runs, keys = EXPERIMENTS[args.experiment]
    results = {}
    for name, script in runs.items():
        for seed in args.seeds:
            out_dir = Path(args.out) / args.experiment / f"{name.replace(' ', '_')}_seed{seed}"
            cmd = [sys.executable, *shlex.split(script), "--seed", str(seed), "--num_steps", str(args.steps),
                   "--eval_every", str(args.steps), "--output_dir", str(out_dir)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            done = (out_dir / "summary.json").exists() and not args.force  # a finished run is reused
            proc = subprocess.CompletedProcess(cmd, 0) if done else subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"error: {shlex.join(cmd)} failed:\n{proc.stderr[-3000:]}")
            results.setdefault(name, []).append(summarise(out_dir, keys))
            print(name, seed, results[name][-1], flush=True)
    text = f"`{shlex.join(['python', 'bench/methods.py', *sys.argv[1:]])}`\n\n" + table(results, keys)
    (Path(args.out) / f"{args.experiment}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
