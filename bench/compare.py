"""Results: every algorithm side by side on the embedded task, at an equal budget, over seeds.
Two claims are tested: the survey's "PPO, ReMax, GRPO and RLOO reach comparable
performance", and ReMax's "plain REINFORCE fails when reward scales differ across prompts and a
baseline fixes it" (the --reward_scales hetero variant of the task).

Equal budget: every run trains on the same number of sampled completions, --steps rollout
batches of --batch_size (64). What each algorithm spends to get them differs, and is reported
rather than hidden: ReMax also decodes one greedy response per prompt (2x the sequences
generated), DAPO's dynamic sampling generates extra rounds and drops groups, PPO takes
num_epochs x num_mini_batches = 16 optimizer steps per batch and trains a critic. The figures
put held-out accuracy and training reward against all three axes: completions trained on,
sequences generated, and wall-clock seconds. Everything else is each script's default
(learning rates, KL coefficients, group size 8, ...), so each algorithm runs as its file ships.

Each run is `python lab/<script>.py --seed S --num_steps N ...` in its own subprocess, --jobs at a
time with --threads torch threads each; its peak resident memory (ru_maxrss from wait4) is
recorded. A run whose run.json says it finished with the same command is reused, so an
interrupted comparison continues where it stopped (--force reruns everything).

    python bench/compare.py                                   # docs/results.md: 36 runs, 23 min on 2 CPU cores
    python bench/compare.py --algorithms reinforce remax --tasks hetero --seeds 0 1 2 3 4
    python bench/compare.py --steps 2 --eval_every 1 --seeds 0 1 --out /tmp/cmp   # smoke test

Writes to --out (default runs/compare): results.md (tables, machine, command), results.json
(every run and every aggregate), compare_<task>.png (one figure per task variant), and one
folder per run (metrics.jsonl, summary.json, log.txt, run.json).
"""
import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from itertools import accumulate
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support import run, tasks  # noqa: E402
import torch  # noqa: E402

# name -> (script, extra arguments); colours fixed so the figures of both tasks match
ALGORITHMS = {
    "reinforce": ("lab/remax.py", ["--baseline", "none"]),
    "remax": ("lab/remax.py", []),
    "grpo": ("lab/grpo.py", []),
    "rloo": ("lab/rloo.py", []),
    "dapo": ("lab/dapo.py", []),
    "ppo": ("lab/ppo.py", []),
}
COLORS = {"reinforce": "tab:gray", "remax": "tab:blue", "grpo": "tab:orange", "rloo": "tab:green",
          "dapo": "tab:red", "ppo": "tab:purple"}
TASKS = {"uniform": [], "hetero": ["--reward_scales", "hetero"]}
TASK_TITLES = {"uniform": "reward 1 if right, 0 if wrong",
               "hetero": "--reward_scales hetero: each family's reward on its own offset (-5..+4)"}
# rough relative cost per step at one thread (measured here), to start the longest runs first
COST = {"reinforce": 0.2, "remax": 0.3, "grpo": 0.24, "rloo": 0.23, "dapo": 0.3, "ppo": 1.3}
REWARD_WINDOW = 25  # moving average of the per-step training reward in the figure and table


# ----------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------
def run_command(algo, task, seed, args, run_dir):
    script, extra = ALGORITHMS[algo]
    return [sys.executable, str(ROOT / script), "--seed", str(seed), "--num_steps", str(args.steps),
            "--batch_size", str(args.batch_size), "--eval_every", str(args.eval_every), "--log_every", str(args.steps),
            "--save_model", "false", "--output_dir", str(run_dir), *extra, *TASKS[task]]


def is_done(run_dir, cmd):
    path = run_dir / "run.json"
    if not path.exists():
        return False
    info = json.loads(path.read_text())
    return info.get("returncode") == 0 and info.get("command") == cmd and (run_dir / "summary.json").exists()


def run_all(runs, jobs, threads):
    """Run every (run_dir, cmd) not already done, `jobs` at a time; write run.json for each:
    command, return code, wall seconds and the child's peak RSS (ru_maxrss from wait4)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    pending, running, failed = list(runs), {}, []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run_dir, cmd = pending.pop(0)
                run_dir.mkdir(parents=True, exist_ok=True)
                log = open(run_dir / "log.txt", "w")
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[proc.pid] = (proc, run_dir, cmd, log, time.time())
                print(f"[{time.strftime('%H:%M:%S')}] start {run_dir.relative_to(run_dir.parents[2])}", flush=True)
            pid, status, usage = os.wait4(-1, 0)
            if pid not in running:
                continue
            proc, run_dir, cmd, log, start = running.pop(pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            log.close()
            info = {"command": cmd, "returncode": proc.returncode, "wall_s": round(time.time() - start, 2),
                    "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "threads": threads, "jobs": jobs}
            (run_dir / "run.json").write_text(json.dumps(info, indent=2))
            name = run_dir.relative_to(run_dir.parents[2])
            print(f"[{time.strftime('%H:%M:%S')}] done  {name}: rc {proc.returncode}, {info['wall_s']:.0f}s, "
                  f"peak RSS {info['peak_rss_mib']:.0f} MiB", flush=True)
            if proc.returncode != 0:
                tail = (run_dir / "log.txt").read_text().splitlines()[-15:]
                print(f"error: {name} failed (rc {proc.returncode}); the end of {run_dir / 'log.txt'}:\n  "
                      + "\n  ".join(tail), file=sys.stderr, flush=True)
                failed.append(run_dir)
    finally:
        for proc, *_ in running.values():
            proc.kill()
    return failed


# ----------------------------------------------------------------------------------------
# reading and aggregating (pure: dicts and lists in, dicts out; tested in tests/test_compare.py)
# ----------------------------------------------------------------------------------------
def moving_average(values, window):
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def mean_std(values):
    """Mean and sample standard deviation (n - 1; 0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return mean, std


def mean_of(rows, key):
    """Mean of `key` over the rows that have it (0 if none do)."""
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else 0.0


def optimizer_steps_per_batch(config):
    """Optimizer steps per rollout batch, from a run's config.json."""
    return config.get("num_epochs", 1) * config.get("num_mini_batches", 1)


def summarize_run(rows, config, peak_rss_mib):
    """One run's curves and totals from its metrics.jsonl rows and config.json.

    Training reward is the mean reward of every completion sampled for training; for DAPO that
    is train/reward_sampled (before the dynamic-sampling filter and the overlong shaping), as its
    train/reward covers only the kept, mixed groups. Completions trained on count the batch the
    loss saw (DAPO: the groups kept, which can fall short of the batch; a skipped step trains
    none). Wall-clock is time/elapsed_s: seconds since the logger started (after loading),
    evaluation included. grad_norm is the policy's gradient norm before clipping, averaged over
    steps (PPO: over its minibatch updates); it compares runs of one loss (REINFORCE vs ReMax,
    uniform vs hetero), not losses of different scale.
    """
    steps = [r for r in rows if r["step"] > 0 and ("train/generated" in r)]
    evals = [r for r in rows if "eval/accuracy" in r]
    if not steps or not evals:
        raise ValueError("no training or evaluation rows in metrics.jsonl")
    batch = config["batch_size"]
    trained = []
    for r in steps:
        if "train/groups_kept" in r:
            trained.append(r["train/groups_kept"] * config["num_generations"])
        else:
            trained.append(0 if r.get("train/skipped_step", 0) else batch)
    reward_key = "train/reward_sampled" if "train/reward_sampled" in steps[0] else "train/reward"
    families = sorted(k[len("eval/acc_"):] for k in evals[-1] if k.startswith("eval/acc_"))
    return {
        "step": [r["step"] for r in steps],
        "reward": [r.get(reward_key, float("nan")) for r in steps],
        "elapsed_s": [r["time/elapsed_s"] for r in steps],
        "trained": list(accumulate(trained)),
        "generated": list(accumulate(r["train/generated"] for r in steps)),
        "eval_step": [r["step"] for r in evals],
        "eval_elapsed_s": [r["time/elapsed_s"] for r in evals],
        "eval_accuracy": [r["eval/accuracy"] for r in evals],
        "family_accuracy": {f: evals[-1][f"eval/acc_{f}"] for f in families},
        "family_accuracy_start": {f: evals[0][f"eval/acc_{f}"] for f in families},
        "accuracy_start": evals[0]["eval/accuracy"],
        "accuracy_final": evals[-1]["eval/accuracy"],
        "reward_final": sum(r.get(reward_key, 0.0) for r in steps[-REWARD_WINDOW:]) / len(steps[-REWARD_WINDOW:]),
        "wall_s": rows[-1]["time/elapsed_s"],
        "grad_norm": mean_of(steps, "train/grad_norm"),
        "step_s": mean_of(steps, "time/step_s"),
        "completions_trained": sum(trained),
        "sequences_generated": sum(r["train/generated"] for r in steps),
        "optimizer_steps": len(steps) * optimizer_steps_per_batch(config),
        "peak_rss_mib": peak_rss_mib,
    }


def aggregate(run_summaries):
    """Mean and std over seeds of each run's totals; the curves averaged step by step."""
    keys = ("accuracy_start", "accuracy_final", "reward_final", "grad_norm", "wall_s", "step_s", "completions_trained",
            "sequences_generated", "optimizer_steps", "peak_rss_mib")
    out = {k: mean_std([s[k] for s in run_summaries]) for k in keys}
    out["seeds"] = len(run_summaries)
    families = run_summaries[0]["family_accuracy"]
    out["family_accuracy"] = {f: mean_std([s["family_accuracy"][f] for s in run_summaries]) for f in families}
    out["family_accuracy_start"] = {f: mean_std([s["family_accuracy_start"][f] for s in run_summaries]) for f in families}
    return out


# ----------------------------------------------------------------------------------------
# writing: tables and figures
# ----------------------------------------------------------------------------------------
def fmt(ms, digits=3):
    return f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def markdown_tables(task, per_algo):
    """The summary table and the per-family table of one task variant (markdown lines)."""
    lines = [f"| `{task}` | held-out acc. (start → end) | train reward, last {REWARD_WINDOW} steps | grad norm | wall s | s / step "
             "| completions trained | sequences generated | optimizer steps | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for algo, agg in per_algo.items():
        lines.append(f"| {algo} | {agg['accuracy_start'][0]:.3f} → **{fmt(agg['accuracy_final'])}** | {fmt(agg['reward_final'])} "
                     f"| {agg['grad_norm'][0]:.2f} "
                     f"| {agg['wall_s'][0]:.0f} ± {agg['wall_s'][1]:.0f} | {agg['step_s'][0]:.3f} "
                     f"| {agg['completions_trained'][0]:,.0f} | {agg['sequences_generated'][0]:,.0f} "
                     f"| {agg['optimizer_steps'][0]:,.0f} | {agg['peak_rss_mib'][0]:.0f} |")
    found = next(iter(per_algo.values()))["family_accuracy"]
    families = [f for f in tasks.FAMILIES if f in found]  # easiest first + sorted(f for f in found if f not in tasks.FAMILIES)
    label = lambda f: f"`{f}`" + (f" ({tasks.HETERO_SCALES[f][0]:+.0f}/{tasks.HETERO_SCALES[f][1]:+.0f})"
                                  if task == "hetero" and f in tasks.HETERO_SCALES else "")
    lines += ["", f"| `{task}`, held-out acc. per family at the end | " + " | ".join(label(f) for f in families) + " |",
              "|---|" + "---|" * len(families)]
    start = next(iter(per_algo.values()))["family_accuracy_start"]
    lines.append("| (start) | " + " | ".join(f"{start[f][0]:.2f}" for f in families) + " |")
    for algo, agg in per_algo.items():
        lines.append(f"| {algo} | " + " | ".join(f"{agg['family_accuracy'][f][0]:.2f} ± {agg['family_accuracy'][f][1]:.2f}"
                                                  for f in families) + " |")
    return lines


def band(curves):
    """Pointwise mean, min and max of equal-length curves (lists)."""
    cols = list(zip(*curves))
    return [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def plot_task(task, runs_by_algo, path):
    """2 x 3 panels: held-out accuracy (top) and training reward (bottom) against completions
    trained on, sequences generated and wall-clock seconds; mean over seeds, band = min..max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), sharey="row")
    for algo, runs in runs_by_algo.items():
        n = min(len(r["step"]) for r in runs)  # equal lengths unless a run stopped early
        m = min(len(r["eval_step"]) for r in runs)
        trained = band([r["trained"][:n] for r in runs])[0]
        generated = band([r["generated"][:n] for r in runs])[0]
        elapsed = band([r["elapsed_s"][:n] for r in runs])[0]
        step_of = {s: i for i, s in enumerate(runs[0]["step"][:n])}
        eval_x = {"trained": [], "generated": [], "elapsed": []}
        for s in runs[0]["eval_step"][:m]:  # step 0: nothing trained or generated yet, no time spent
            i = step_of.get(s)
            eval_x["trained"].append(trained[i] if i is not None else 0)
            eval_x["generated"].append(generated[i] if i is not None else 0)
        eval_x["elapsed"] = band([r["eval_elapsed_s"][:m] for r in runs])[0]
        acc, acc_lo, acc_hi = band([r["eval_accuracy"][:m] for r in runs])
        rew, rew_lo, rew_hi = band([moving_average(r["reward"][:n], REWARD_WINDOW) for r in runs])
        label = f"{algo} ({len(runs)} seeds)"
        for col, (x_eval, x_step) in enumerate([(eval_x["trained"], trained), (eval_x["generated"], generated),
                                                 (eval_x["elapsed"], elapsed)]):
            axes[0, col].plot(x_eval, acc, marker="o", markersize=3, color=COLORS[algo], label=label)
            axes[0, col].fill_between(x_eval, acc_lo, acc_hi, color=COLORS[algo], alpha=0.15)
            axes[1, col].plot(x_step, rew, color=COLORS[algo], label=label)
            axes[1, col].fill_between(x_step, rew_lo, rew_hi, color=COLORS[algo], alpha=0.15)
    for col, xlabel in enumerate(["completions trained on", "sequences generated (sampled + greedy + dropped)",
                                  "wall-clock seconds, log scale (evaluation included)"]):
        axes[1, col].set_xlabel(xlabel)
        for row in range(2):
            axes[row, col].grid(alpha=0.3)
    for row in range(2):
        axes[row, 2].set_xscale("log")  # PPO's 16 updates per batch would squeeze the others into the left edge
    axes[0, 0].set_ylabel("held-out greedy accuracy")
    axes[1, 0].set_ylabel(f"training reward (moving avg. {REWARD_WINDOW} steps)")
    axes[0, 0].legend(loc="lower right", fontsize=9)
    fig.suptitle(f"task `{task}`: {TASK_TITLES[task]}; line = mean over seeds, band = min..max")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}


# ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150, help="Rollout batches per run: the equal budget is steps x batch_size completions trained on.")
    p.add_argument("--batch_size", type=int, default=64, help="Sampled completions per step (every script's default).")
    p.add_argument("--eval_every", type=int, default=25, help="Held-out evaluation every N steps (and at start and end).")
    p.add_argument("--jobs", type=int, default=2, help="Runs at a time (the number of cores, with --threads 1).")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS).")
    p.add_argument("--out", default="runs/compare", help="Output folder (results.md, results.json, compare_<task>.png, runs).")
    p.add_argument("--force", action="store_true", help="Rerun runs that already finished with the same command.")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "jobs", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    if args.batch_size % 8:
        p.error(f"--batch_size must be a multiple of 8, the group size of grpo/rloo/dapo (got {args.batch_size})")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct (got {args.seeds})")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out).resolve()
    t0 = time.time()
    plan = [(task, algo, seed, out / task / algo / f"seed{seed}")
            for task in args.tasks for algo in args.algorithms for seed in args.seeds]
    todo = []
    for task, algo, seed, run_dir in plan:
        cmd = run_command(algo, task, seed, args, run_dir)
        if args.force or not is_done(run_dir, cmd):
            todo.append((run_dir, cmd, COST[algo]))
    todo.sort(key=lambda t: -t[2])  # longest first: the jobs finish together
    print(f"{len(plan)} runs ({len(plan) - len(todo)} already done), {args.jobs} at a time, {args.threads} thread(s) each; "
          f"budget per run: {args.steps} steps x {args.batch_size} = {args.steps * args.batch_size:,} completions", flush=True)
    failed = run_all([(d, c) for d, c, _ in todo], args.jobs, args.threads)
    if failed:
        sys.exit(f"error: {len(failed)} run(s) failed: " + ", ".join(str(d) for d in failed))

    results = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "jobs": args.jobs, "threads": args.threads, "steps": args.steps,
               "batch_size": args.batch_size, "runner_wall_s": None, "runs": {}, "aggregate": {}}
    md = []
    for task in args.tasks:
        runs_by_algo, per_algo = {}, {}
        for algo in args.algorithms:
            summaries = []
            for seed in args.seeds:
                run_dir = out / task / algo / f"seed{seed}"
                rows = run.read_metrics(run_dir / "metrics.jsonl")
                config = json.loads((run_dir / "config.json").read_text())
                info = json.loads((run_dir / "run.json").read_text())
                summary = summarize_run(rows, config, info["peak_rss_mib"])
                summaries.append(summary)
                results["runs"][f"{task}/{algo}/seed{seed}"] = {k: v for k, v in summary.items() if not isinstance(v, list)}
            runs_by_algo[algo], per_algo[algo] = summaries, aggregate(summaries)
        results["aggregate"][task] = per_algo
        plot_task(task, runs_by_algo, out / f"compare_{task}.png")
        md += [f"### Task `{task}` ({TASK_TITLES[task]})", "", f"![{task}](compare_{task}.png)", "",
               *markdown_tables(task, per_algo), ""]
    wall = time.time() - t0
    results["runner_wall_s"] = round(wall, 1)
    m = results["machine"]
    head = [f"Generated by `{results['command']}` in {wall / 60:.1f} min "
            f"({len(plan)} runs, {len(plan) - len(todo)} reused from an earlier call; {args.jobs} at a time, {args.threads} torch thread(s) each)",
            f"on {m['cpu']} ({m['cores']} cores), {m['platform']}, Python {m['python']}, torch {m['torch']}.",
            f"Budget per run: {args.steps} steps x {args.batch_size} = {args.steps * args.batch_size:,} sampled completions trained on; "
            f"seeds {', '.join(map(str, args.seeds))}; values are mean ± sample std over seeds "
            f"(grad norm: the policy's before clipping, mean over steps and seeds; wall s, s / step and peak RSS: mean; std of wall s shown).", ""]
    (out / "results.md").write_text("\n".join(head + md))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(head + md))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and " + ", ".join(str(out / f'compare_{t}.png') for t in args.tasks))


if __name__ == "__main__":
    main()
