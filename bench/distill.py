"""On-policy distillation (opd.py) beside ReMax (remax.py) and GRPO (grpo.py) from the same start, the embedded
student, over seeds: held-out accuracy against optimizer steps, completions generated and seconds; the embedded
teacher's held-out accuracy as the ceiling; opd's reverse KL to the teacher over training.

Every run is `python <script> --seed S --num_steps N --eval_every E --output_dir OUT/<method>_seedS`, each file's
defaults otherwise, in its own subprocess, one at a time, OMP_NUM_THREADS=1 (a run whose summary.json exists is
reused). The curves are read from each run's metrics.jsonl; the tables (mean ± sample std over the seeds) are
printed and written to runs/distill/distill.md (under --out) with the command that made them.

    python bench/distill.py --seeds 0 1 2 --steps 300        # docs/distillation.md's tables

Completions generated per step: --batch_size (64) for every method; ReMax also decodes one greedy response per
prompt, 64 more. Seconds: the sum of time/step_s up to that step (rollout, scoring, update; an evaluation step also
holds its evaluation), so loading the models and the evaluation before step 1 are not counted. Wall-clock seconds
depend on what else the machine runs: each run also records its process's CPU seconds (user + system, loading
included) and the 1-minute load average when it ended, in OUT/<method>_seedS/bench.json.
"""
import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"OPD": ("opd.py", 64), "ReMax": ("remax.py", 128), "GRPO": ("grpo.py", 64)}  # completions per step
THRESHOLDS = (0.5, 0.6, 0.7, 0.75)


def teacher_accuracy():
    """The embedded teacher's held-out greedy accuracy, evaluated as opd.py evaluates its ceiling."""
    sys.path.insert(0, str(ROOT))
    import opd
    from support import helpers

    cfg = opd.Config()
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, _, eval_data = helpers.load_data(cfg, accelerator)
    teacher = helpers.load_teacher(cfg, accelerator)
    return helpers.evaluate(teacher, tokenizer, eval_data, cfg, accelerator)["eval/accuracy"]


def launch(cmd, out_dir):
    """Run one training process; record its wall and CPU seconds and the load average in out_dir/bench.json."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    info = {"wall_s": time.time() - t0, "load_1min": os.getloadavg()[0],
            "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}
    (out_dir / "bench.json").write_text(json.dumps(info))
    print(f"{shlex.join(cmd[1:4])}: {info['wall_s']:.0f} s, {info['cpu_s']:.0f} CPU s, "
          f"load {info['load_1min']:.1f}", flush=True)


def read_run(out_dir, per_step):
    """evals: (step, accuracy, completions generated, seconds) at each evaluation; kl: train/kl_seq per step;
    step_s: time/step_s per step; info: bench.json."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    run = {"evals": [], "kl": {}, "step_s": [], "info": json.loads((out_dir / "bench.json").read_text())}
    elapsed = 0.0
    for row in rows:
        if "time/step_s" in row:
            elapsed += row["time/step_s"]
            run["step_s"].append(row["time/step_s"])
        if "train/kl_seq" in row:
            run["kl"][row["step"]] = row["train/kl_seq"]
        if "eval/accuracy" in row:
            run["evals"].append((row["step"], row["eval/accuracy"], row["step"] * per_step, elapsed))
    return run


def mean_std(values, fmt):
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.mean(values), fmt)} ± {format(spread, fmt)}"


def tables(runs, ceiling, steps, kl_window):
    """Markdown: accuracy at each evaluated step; steps / completions / seconds to each threshold; opd's KL;
    the cost of a step."""
    eval_steps = sorted({e[0] for seeds in runs.values() for run in seeds for e in run["evals"]})
    shown = [s for s in eval_steps if s % (20 if s <= 100 else 50) == 0 or s == steps]  # the table's columns
    out = ["Held-out greedy accuracy (250 prompts) after N optimizer steps:", "",
           "| method | " + " | ".join(f"{s}" for s in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for name, seeds in runs.items():
        cells = [mean_std([dict(e[:2] for e in run["evals"])[s] for run in seeds], ".3f") for s in shown]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append(f"| teacher (ceiling) | {ceiling:.3f} |" + " |" * (len(shown) - 1))

    out += ["", "First evaluation at or above each accuracy: optimizer steps, completions generated, seconds "
            "(mean ± std over the seeds that reach it):", "",
            "| method | accuracy | seeds | steps | completions | seconds |", "|---|---|---|---|---|---|"]
    for name, seeds in runs.items():
        for threshold in THRESHOLDS:
            hits = [next((e for e in run["evals"] if e[1] >= threshold), None) for run in seeds]
            hits = [h for h in hits if h is not None]
            if not hits:
                out.append(f"| {name} | {threshold} | 0/{len(seeds)} | not reached | not reached | not reached |")
                continue
            out.append(f"| {name} | {threshold} | {len(hits)}/{len(seeds)} | {mean_std([h[0] for h in hits], '.0f')} "
                       f"| {mean_std([h[2] for h in hits], ',.0f')} | {mean_std([h[3] for h in hits], '.1f')} |")

    marks = [(1, kl_window), (steps // 2 - kl_window + 1, steps // 2), (steps - kl_window + 1, steps)]
    out += ["", "OPD's sampled reverse KL to the teacher, `train/kl_seq` (nats per completion), mean over steps:", "",
            "| method | " + " | ".join(f"steps {a}-{b}" for a, b in marks) + " |", "|---" * (len(marks) + 1) + "|"]
    cells = [mean_std([statistics.mean(run["kl"][s] for s in range(a, b + 1)) for run in runs["OPD"]], ".3f")
             for a, b in marks]
    out.append("| OPD | " + " | ".join(cells) + " |")

    out += ["", "| method | completions generated per step | s / step (median) | seconds, all steps | "
            "CPU s of the process | load average at its end |", "|---|---|---|---|---|---|"]
    for name, seeds in runs.items():
        loads = [run["info"]["load_1min"] for run in seeds]
        median = mean_std([statistics.median(r["step_s"]) for r in seeds], ".3f")
        out.append(f"| {name} | {METHODS[name][1]} | {median} "
                   f"| {mean_std([sum(r['step_s']) for r in seeds], '.1f')} "
                   f"| {mean_std([r['info']['cpu_s'] for r in seeds], '.1f')} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--out", default="runs/distill")
    parser.add_argument("--force", action="store_true", help="Rerun the runs whose summary.json exists.")
    args = parser.parse_args()
    started = time.time()
    runs = {}
    for name, (script, per_step) in METHODS.items():
        for seed in args.seeds:
            out_dir = Path(args.out).resolve() / f"{name}_seed{seed}"
            cmd = [sys.executable, script, "--seed", str(seed), "--num_steps", str(args.steps),
                   "--eval_every", str(args.eval_every), "--output_dir", str(out_dir)]
            if args.force or not (out_dir / "summary.json").exists() or not (out_dir / "bench.json").exists():
                launch(cmd, out_dir)
            runs.setdefault(name, []).append(read_run(out_dir, per_step))
    ceiling = teacher_accuracy()
    command = shlex.join(["python", "bench/distill.py", *sys.argv[1:]])
    text = (f"`{command}` ({(time.time() - started) / 60:.1f} min)\n\n"
            + tables(runs, ceiling, args.steps, kl_window=min(10, args.steps // 2)))
    (Path(args.out) / f"{Path(__file__).stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
