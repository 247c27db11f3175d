"""Asynchronous rollouts on the embedded task (docs/async.md): GRPO sampling in turn with its updates, against a
sampler process running --async_rollouts K = 1 and 2 steps ahead, over seeds: the learner's wall time per step and
the held-out accuracy after the same number of steps. Every run is given the machine's two cores (OMP_NUM_THREADS=2):
the synchronous one as two threads, the asynchronous one split between its two processes, a thread each
(async_sampling.split_threads). The variant "synchronous, 1 thread" is the synchronous run on one core.

Runs one after another (a run uses up to two cores); a run whose run.json shows the same command and a finished
summary.json is reused (--force reruns it).

    python bench/async.py                                             # docs/async.md's table: 3 seeds, 200 steps
    python bench/async.py --seeds 0 --variants synchronous "synchronous, 1 thread"    # two cores or one, in turn
    python bench/async.py --learning_rate 3e-4 --variants synchronous "K = 4" "K = 4 + TIS" "K = 4 + M2PO"
    python bench/async.py --steps 2 --seeds 0 --out /tmp/async        # smoke test
    python bench/async.py --environment calculator --variants synchronous "K = 1" --out runs/async_agents  # episodes
    python bench/async.py --steps 20 --seeds 0 --variants "K = 1" --timeline docs/figures/async_timeline.png

Writes to --out (default runs/async): results.md (the table and the command), results.json and one folder per run.
--timeline PNG: the first asynchronous run's timeline.jsonl (the wall-clock spans of each process's phases, written by
lab/async_sampling.py) drawn as two lanes, the learner's and the sampler process's, over --timeline_steps.
"""
import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.stability import mean_std, run_cached, write_results  # noqa: E402
from support import run  # noqa: E402

VARIANTS = {  # name -> (extra grpo.py arguments, OMP_NUM_THREADS of the run: an asynchronous one splits them)
    "synchronous": ([], 2),
    "synchronous, 1 thread": ([], 1),
    "K = 1": (["--async_rollouts", "1"], 2),
    "K = 2": (["--async_rollouts", "2"], 2),
    "K = 4": (["--async_rollouts", "4"], 2),
    "K = 4 + TIS": (["--async_rollouts", "4", "--tis_cap", "2"], 2),
    "K = 4 + M2PO": (["--async_rollouts", "4", "--m2po_tau", "0.04"], 2),
    "K = 8": (["--async_rollouts", "8"], 2),
    "K = 8 + TIS": (["--async_rollouts", "8", "--tis_cap", "2"], 2),
    "K = 8 + M2PO": (["--async_rollouts", "8", "--m2po_tau", "0.04"], 2),
}


def run_one(name, seed, args):
    flags, threads = VARIANTS[name]
    lr = [] if args.learning_rate is None else ["--learning_rate", str(args.learning_rate)]
    environment = ["--environment", args.environment] if args.environment else []
    label = name.replace(" ", "").replace(",", "_").replace("=", "").replace("+", "_")
    run_dir = Path(args.out) / (f"{label}{'-lr' + lr[1] if lr else ''}{'-' + args.environment if environment else ''}"
                                f"-threads{threads}-seed{seed}")
    cmd = [sys.executable, str(ROOT / "lab" / "grpo.py"), "--seed", str(seed), "--num_steps", str(args.steps),
           "--eval_every", str(args.steps), "--log_every", str(args.steps), "--save_model", "false",
           "--output_dir", str(run_dir), *lr, *environment, *flags]
    return run_cached(cmd, run_dir, args.force, threads)


def summarise(run_dir):
    """Held-out accuracy, and per step after the first (whose time holds the sampler process's start): the
    learner's seconds per step, its wait for the batch, the staleness and the mismatch."""
    first, *steps = [r for r in run.read_metrics(run_dir / "metrics.jsonl") if "train/grad_norm" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"before": summary["eval_accuracy_before"], "after": summary["eval_accuracy_after"],
            "first_step_s": first["time/step_s"],
            **{key: statistics.median(r.get(f"time/{phase}_s", 0.0) for r in steps) for key, phase in [
                ("step_s", "step"), ("wait_s", "generation"), ("scoring_s", "scoring"),
                ("update_s", "forward_backward"), ("sampler_generation_s", "sampler_generation"),
                ("sampler_scoring_s", "sampler_scoring")]},
            "staleness": statistics.mean(r.get("train/staleness_mean", 0.0) for r in steps),
            "mismatch_k3": statistics.mean(r.get("train/mismatch_k3", 0.0) for r in steps),
            "m2po_masked": statistics.mean(r.get("train/m2po_masked_frac", 0.0) for r in steps),
            "wall_s": summary["wall_time_s"]}


LANES = {"learner": {"generation": ("wait for the batch", "0.85"), "reward": ("reward", "tab:olive"),
                     "scoring": ("scoring (reference)", "tab:orange"), "forward_backward": ("forward/backward", "tab:red"),
                     "optimizer": ("optimizer step", "tab:purple"), "publish": ("publish weights", "black")},
         "sampler": {"wait": ("wait for weights", "0.85"), "generation": ("sampling", "tab:blue"),
                     "scoring": ("scoring (the reference)", "tab:cyan"),
                     "reward": ("texts and rewards", "tab:green")}}


def plot_timeline(path, out, steps):
    """The learner's and the sampler's phases (timeline.jsonl's spans) over `steps` (first, last), as two lanes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    rows = [r for r in rows if steps[0] <= r["step"] <= steps[1]]
    origin = min(span[1] for r in rows for span in r["learner"])
    fig, ax = plt.subplots(figsize=(11, 2.6))
    shown = set()
    for y, lane in enumerate(["sampler", "learner"]):
        for r in rows:
            for phase, start, end in r[lane]:
                label, color = LANES[lane].get(phase, (phase, "tab:gray"))
                ax.barh(y, end - start, left=start - origin, height=0.6, color=color,
                        label=None if (lane, phase) in shown else f"{lane}: {label}")
                shown.add((lane, phase))
        if lane == "learner":
            for r in rows:  # each step's end: its weights published
                ax.text(r["learner"][-1][2] - origin, 1.36, str(r["step"]), ha="center", fontsize=7)
    ax.set_yticks([0, 1], ["sampler process", "learner"])
    ax.set_xlabel("seconds (wall clock); numbers: the learner's steps, at their end")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="grpo.py --num_steps of every run.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--learning_rate", type=float, default=None, help="grpo.py --learning_rate (default: its).")
    parser.add_argument("--environment", default="", help="grpo.py --environment of every run (calculator: the agent "
                        "model's episodes, docs/agents.md).")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["synchronous", "K = 1", "K = 2"])
    parser.add_argument("--out", default="runs/async")
    parser.add_argument("--force", action="store_true", help="Rerun finished runs.")
    parser.add_argument("--timeline", default="", help="Draw the first asynchronous run's timeline in this PNG.")
    parser.add_argument("--timeline_steps", type=int, nargs=2, default=[5, 10], help="Its first and last step.")
    args = parser.parse_args()

    results, timelines = {}, []
    for seed in args.seeds:  # seed by seed: a run that the machine slowed down is beside its neighbours
        for name in args.variants:
            run_dir = run_one(name, seed, args)
            results.setdefault(name, []).append(summarise(run_dir))
            timelines += [run_dir / "timeline.jsonl"] if (run_dir / "timeline.jsonl").exists() else []
    if args.timeline:
        if not timelines:
            sys.exit("error: --timeline: no asynchronous run among --variants.")
        plot_timeline(timelines[0], args.timeline, args.timeline_steps)
    sync = statistics.mean(r["step_s"] for r in results[args.variants[0]])
    lines = ["| sampling | held-out accuracy (start → end) | s per step (learner) | speed-up "
             "| learner, s per step: wait for the batch / scoring / update "
             "| sampler process, s per batch: sampling / scoring (reference) | staleness (steps) | mismatch k3 per token "
             "| first step, s | wall time of the run, s |", "|---" * 10 + "|"]
    for name, runs in results.items():
        col = {key: [r[key] for r in runs] for key in runs[0]}
        lines.append(f"| {name} | {mean_std(col['before'], '.3f')} → {mean_std(col['after'], '.3f')} "
                     f"| {mean_std(col['step_s'], '.3f')} | {sync / statistics.mean(col['step_s']):.2f}× "
                     f"| {mean_std(col['wait_s'], '.3f')} / {mean_std(col['scoring_s'], '.3f')} / "
                     f"{mean_std(col['update_s'], '.3f')} | {mean_std(col['sampler_generation_s'], '.3f')} / "
                     f"{mean_std(col['sampler_scoring_s'], '.3f')} | {statistics.mean(col['staleness']):.2f} "
                     f"| {mean_std(col['mismatch_k3'], '.1e')} | {mean_std(col['first_step_s'], '.1f')} "
                     f"| {mean_std(col['wall_s'], '.0f')} |")
    command = shlex.join(["python", "bench/async.py", *sys.argv[1:]])
    text = "\n".join([f"`{command}` ({len(args.seeds)} seeds, {args.steps} steps each; mean ± std over seeds; "
                      f"times: medians over steps 2-{args.steps}; speed-up: against the first row)", "", *lines, ""])
    write_results(args.out, text, results)


if __name__ == "__main__":
    main()
