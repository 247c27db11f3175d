"""Keep routing on the embedded mixture-of-experts policy (docs/stability.md): GRPO with two updates per batch
(--num_epochs 2, so that R2 has a pi_old pass to replay) samples with a bfloat16 copy of the policy
(--rollout_dtype bfloat16) or with the policy of --lag steps ago (--rollout_lag), with --keep_routing none, r2
and r3, each with truncated importance sampling per token and per sequence (--tis_cap 2, --tis_level), over
seeds. Per run: the routing mismatch (completion token, MoE layer pairs routed otherwise by the trainer than by
the sampler), train/mismatch_k3 at step 1 and over the run, the gradient norm, and held-out accuracy.

    python bench/keep_routing.py                                     # docs/stability.md's first table: 24 runs
    python bench/keep_routing.py --learning_rate 1e-3 --steps 30 --out runs/keep_routing_1e-3   # its second
    python bench/keep_routing.py --steps 2 --seeds 0 --samplers bfloat16 --out /tmp/kr   # smoke test

The first took 20 minutes on 2 CPU cores shared with other work. Runs one after another (--jobs at a time), one
thread each (bench/stability.py's run_cached: a finished run with the same command is reused). Writes
results.md (the table and the command) and results.json into --out.
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

SAMPLERS = {"bfloat16": ["--rollout_dtype", "bfloat16"], "stale": ["--rollout_lag", "LAG"]}


def run_one(sampler, keep, level, seed, args):
    run_dir = Path(args.out) / f"{sampler}-{keep}-{level}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "lab" / "grpo.py"), "--model_name_or_path", str(ROOT / "embedded_model" / "moe"),
           "--seed", str(seed), "--num_steps", str(args.steps), "--eval_every", str(args.steps), "--log_every",
           str(args.steps), "--save_model", "false", "--num_epochs", "2", "--learning_rate", str(args.learning_rate),
           "--keep_routing", keep, "--tis_cap", "2", "--tis_level", level, "--output_dir", str(run_dir),
           *[str(args.lag) if a == "LAG" else a for a in SAMPLERS[sampler]]]
    return run_cached(cmd, run_dir, args.force)


def summarise(run_dir):
    rows = [r for r in run.read_metrics(run_dir / "metrics.jsonl") if "train/mismatch_k3" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"after": summary["eval_accuracy_after"], "before": summary["eval_accuracy_before"],
            "routing": statistics.mean(r["train/routing_mismatch"] for r in rows),
            "k3_step1": rows[0]["train/mismatch_k3"], "k3": statistics.mean(r["train/mismatch_k3"] for r in rows),
            "ess": statistics.mean(r["train/is_ess"] for r in rows),
            "grad_norm": statistics.mean(r["train/grad_norm"] for r in rows),
            "grad_norm_max": max(r["train/grad_norm"] for r in rows)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="grpo.py --num_steps of every run.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--samplers", nargs="+", choices=list(SAMPLERS), default=list(SAMPLERS))
    parser.add_argument("--lag", type=int, default=2, help="--rollout_lag of the stale sampler.")
    parser.add_argument("--learning_rate", type=float, default=3e-4, help="grpo.py --learning_rate.")
    parser.add_argument("--jobs", type=int, default=1, help="Runs at the same time.")
    parser.add_argument("--out", default="runs/keep_routing")
    parser.add_argument("--force", action="store_true", help="Rerun finished runs.")
    args = parser.parse_args()

    settings = [(sampler, keep, level) for sampler in args.samplers for keep in ("none", "r2", "r3")
                for level in ("token", "sequence")]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {setting: [pool.submit(run_one, *setting, seed, args) for seed in args.seeds] for setting in settings}
        results = {" ".join(setting): [summarise(f.result()) for f in fs] for setting, fs in futures.items()}
    lines = ["| sampler | keep routing | TIS | routing mismatch | mismatch k3, step 1 | mismatch k3, mean | IS ESS "
             "| grad norm mean / max | held-out accuracy (start → end) |", "|---|---|---|---|---|---|---|---|---|"]
    for (sampler, keep, level), (name, runs) in zip(settings, results.items()):
        col = {key: [r[key] for r in runs] for key in runs[0]}
        sampler = f"{args.lag} steps stale" if sampler == "stale" else sampler
        lines.append(f"| {sampler} | {keep} | {level} | {mean_std(col['routing'], '.4f')} "
                     f"| {mean_std(col['k3_step1'], '.2e')} | {mean_std(col['k3'], '.2e')} "
                     f"| {mean_std(col['ess'], '.4f')} "
                     f"| {mean_std(col['grad_norm'], '.2f')} / {max(col['grad_norm_max']):.2f} "
                     f"| {mean_std(col['before'], '.3f')} → {mean_std(col['after'], '.3f')} |")
    command = shlex.join(["python", "bench/keep_routing.py", *sys.argv[1:]])
    text = "\n".join([f"`{command}` ({len(args.seeds)} seeds, {args.steps} steps each, learning rate "
                      f"{args.learning_rate}; mean ± std over seeds; routing mismatch, k3, ESS and grad norm: "
                      "means over the steps; max: over every step and seed)", "", *lines, ""])
    write_results(args.out, text, results)


if __name__ == "__main__":
    main()
