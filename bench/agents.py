"""Agents measured: the embedded agent model (embedded_model/agent) trained with --environment calculator on its
task (--dataset tool_arithmetic), over seeds, and what an episode costs against a single turn.

Learning: `python ALGORITHM.py --environment calculator --seed S` for each --algorithms and --seeds, --steps steps.
Reported per algorithm, as mean (min..max) over seeds, before (step 0) and after (the last step): held-out greedy
accuracy and tool calls per episode, overall and per family, from the greedy evaluation episodes; and over the
training steps' first and last 10%: train/turns, train/tool_calls, train/tool_errors, train/truncated_frac,
train/env_token_frac and train/correct.

Cost: the same model and task, GRPO, one seed, --cost_steps steps, with the calculator and without it (a single
turn: no turn ends at </tool>, nothing is inserted, the completion runs to its EOS or --max_new_tokens). Reported:
seconds per step (median over steps 2..), the model's tokens per step (train/completion_len x --batch_size) and the
seconds per 1,000 of them, whose ratio is the price of the episodes per sampled token (the turns' extra forward
passes over the inserted results, the tool calls, the Python of the loop), in one run of this script.

Each run is a subprocess, --jobs at a time, one torch thread each; a run whose summary.json exists is reused
(--force reruns).

    python bench/agents.py                                            # docs/agents.md
    python bench/agents.py --algorithms grpo --seeds 0 --steps 4 --eval_every 2 --cost_steps 3 --out /tmp/agents

Writes to --out (default runs/agents): results.md (the tables, the command), results.json, agents.png (held-out
accuracy and tool calls per episode against the step, per family, mean over seeds) and one folder per run.
"""
import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import exploration  # noqa: E402
from support import run  # noqa: E402

AGENT = ["--model_name_or_path", "embedded_model/agent", "--dataset", "tool_arithmetic", "--max_new_tokens", "40"]
COST_BATCH = 64  # completions per step of the cost runs
TRAIN_KEYS = ("train/turns", "train/tool_calls", "train/tool_errors", "train/truncated_frac", "train/env_token_frac",
              "train/correct")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["grpo"], choices=["grpo", "rloo", "dapo", "remax", "ppo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--cost_steps", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/agents")
    parser.add_argument("--force", action="store_true")
    return parser.parse_args()


def runs_of(args, out):
    """{key: (command, folder)}: the learning runs, then the two cost runs."""
    common_flags = ["--log_rollouts", "0", "--save_model", "False"]
    runs = {}
    for algorithm in args.algorithms:
        for seed in args.seeds:
            folder = out / f"{algorithm}_s{seed}"
            runs[algorithm, seed] = ([sys.executable, f"lab/{algorithm}.py", "--environment", "calculator", "--seed",
                                      str(seed), "--num_steps", str(args.steps), "--eval_every", str(args.eval_every),
                                      *common_flags, "--output_dir", str(folder)], folder)
    for arm, flags in (("episodes", ["--environment", "calculator"]), ("single_turn", AGENT)):
        folder = out / f"cost_{arm}"
        runs["cost", arm] = ([sys.executable, "lab/grpo.py", *flags, "--batch_size", str(COST_BATCH), "--num_steps",
                              str(args.cost_steps), "--eval_every",
                              str(10 ** 6), *common_flags, "--output_dir", str(folder)], folder)
    return runs


def run_all(args, runs):
    """Start the runs not done yet, --jobs at a time (bench/exploration.py's), the two cost runs after the others,
    together, nothing beside them."""
    exploration.run_all(args, {key: run for key, run in runs.items() if key[0] != "cost"})
    exploration.run_all(args, {key: run for key, run in runs.items() if key[0] == "cost"})


def learning(args, runs):
    """Per algorithm: each eval/ metric before and after, each train/ metric over the first and last 10% of steps."""
    results = {}
    for algorithm in args.algorithms:
        per_seed = []
        for seed in args.seeds:
            rows = run.read_metrics(runs[algorithm, seed][1] / "metrics.jsonl")
            evals = [row for row in rows if "eval/accuracy" in row]
            train = [row for row in rows if "train/turns" in row]
            n = max(1, len(train) // 10)
            entry = {}
            for key in evals[0]:
                if key.startswith("eval/"):
                    entry[f"{key} before"], entry[f"{key} after"] = evals[0][key], evals[-1][key]
            for key in TRAIN_KEYS:
                entry[f"{key} first"] = sum(row[key] for row in train[:n]) / n
                entry[f"{key} last"] = sum(row[key] for row in train[-n:]) / n
            per_seed.append(entry)
        results[algorithm] = {"runs": per_seed,
                              **{k: exploration.summarise([r[k] for r in per_seed]) for k in per_seed[0]}}
    return results


def cost(args, runs):
    out = {}
    for arm in ("episodes", "single_turn"):
        rows = [row for row in run.read_metrics(runs["cost", arm][1] / "metrics.jsonl") if "time/step_s" in row][1:]
        step_s = statistics.median(row["time/step_s"] for row in rows)
        tokens = statistics.mean(row["train/completion_len"] for row in rows) * COST_BATCH
        out[arm] = {"step_s": step_s, "tokens": tokens, "s_per_1k_tokens": 1000 * step_s / tokens,
                    "generation_s": statistics.median(row["time/generation_s"] for row in rows)}
    out["ratio_per_token"] = out["episodes"]["s_per_1k_tokens"] / out["single_turn"]["s_per_1k_tokens"]
    return out


def cell(stats):
    return f"{stats['mean']:.3f} ({stats['min']:.3f}..{stats['max']:.3f})"


def write_table(args, results, costs, path):
    lines = [f"`python bench/agents.py {shlex.join(sys.argv[1:])}`: --environment calculator on the embedded agent "
             f"model, {args.steps} steps, seeds {args.seeds}; mean (min..max) over seeds. Held-out greedy episodes at "
             "step 0 and at the last step; train/ values averaged over the first and the last 10% of the steps.", ""]
    for algorithm in args.algorithms:
        r = results[algorithm]
        evals = sorted({k.rsplit(" ", 1)[0] for k in r if k.startswith("eval/")})
        lines += [f"**{algorithm}.py**", "", "| held-out | before | after |", "|---|---|---|"]
        lines += [f"| {k[5:]} | {cell(r[k + ' before'])} | {cell(r[k + ' after'])} |" for k in evals]
        lines += ["", "| training | first 10% | last 10% |", "|---|---|---|"]
        lines += [f"| {k[6:]} | {cell(r[k + ' first'])} | {cell(r[k + ' last'])} |" for k in TRAIN_KEYS]
        lines.append("")
    lines += [f"Cost (grpo.py, seed 0, {args.cost_steps} steps, the same model and task):", "",
              "| run | s / step | model tokens / step | s / 1k model tokens | generation s / step |", "|---|---|---|---|---|"]
    for arm in ("episodes", "single_turn"):
        c = costs[arm]
        lines.append(f"| {arm.replace('_', ' ')} | {c['step_s']:.3f} | {c['tokens']:.0f} | {c['s_per_1k_tokens']:.3f} | "
                     f"{c['generation_s']:.3f} |")
    lines += ["", f"Episodes cost {costs['ratio_per_token']:.2f}x a single turn per model token."]
    path.write_text("\n".join(lines) + "\n")


def plot(args, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.algorithms), 2, figsize=(11, 3.6 * len(args.algorithms)), squeeze=False)
    for ax_row, algorithm in zip(axes, args.algorithms):
        curves = {}
        for seed in args.seeds:
            for row in run.read_metrics(runs[algorithm, seed][1] / "metrics.jsonl"):
                for key, value in row.items():
                    if key.startswith(("eval/acc_", "eval/tool_calls_")):
                        curves.setdefault(key, {}).setdefault(row["step"], []).append(value)
        for key, points in sorted(curves.items()):
            ax = ax_row[0] if key.startswith("eval/acc_") else ax_row[1]
            steps = sorted(points)
            family = key.split("/")[1].replace("acc_", "").replace("tool_calls_", "")
            ax.plot(steps, [sum(points[s]) / len(points[s]) for s in steps], label=family)
        ax_row[0].set_title(f"{algorithm}: held-out accuracy per family (mean over {len(args.seeds)} seeds)")
        ax_row[1].set_title(f"{algorithm}: tool calls per greedy episode")
        for ax in ax_row:
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    args = parse_args()
    out = Path(args.out)
    runs = runs_of(args, out)
    run_all(args, runs)
    results, costs = learning(args, runs), cost(args, runs)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "learning": results, "cost": costs}, indent=1))
    write_table(args, results, costs, out / "results.md")
    plot(args, runs, out / "agents.png")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
