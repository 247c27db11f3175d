"""The sampler process on one GPU (docs/async.md): grpo.py in turn with its updates, then with --async_rollouts 1,
for --steps steps each on a randomly initialised model of Qwen2.5-0.5B's shape (bench/gpu_check.py's: its
vocabulary, the embedded tokenizer, random 0/1 rewards, nothing downloaded), in float32. Both processes of an
asynchronous run share the one GPU. From metrics.jsonl, the medians over the steps after the first (whose time
holds the sampler process's start): the learner's seconds per step, its wait for the batch, its update, the sampler
process's seconds per batch, and the staleness. Sized to run in under 4 minutes on an H100 (model built once, two
runs of about a minute each).

Without CUDA it says so and exits 0. With --allow_cpu it runs instead, on CPU, a 2-layer model of the same family
and vocabulary, to test the code path (tests/test_async.py); its numbers mean nothing.

    python bench/async_gpu.py                                    # -> runs/async_gpu/async_gpu.md
    python bench/async_gpu.py --allow_cpu --steps 2 --batch_size 4 --max_new_tokens 4 --out /tmp/async_gpu.md
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.cost import child_env, make_large_model  # noqa: E402
from bench.gpu_check import QWEN25_05B, TINY  # noqa: E402
from support.run import read_metrics  # noqa: E402

VARIANTS = {"synchronous": [], "K = 1": ["--async_rollouts", "1"]}


def run_one(name, model_path, args, workdir):
    """grpo.py through bench/gpu_check.py's child (random rewards, no evaluation): the medians of its steps 2 on."""
    out_dir = Path(workdir) / name.replace(" ", "").replace("=", "")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--child", str(ROOT / "lab" / "grpo.py"),
           str(out_dir) + ".json", "--", "--model_name_or_path", model_path, "--num_steps", str(args.steps),
           "--batch_size", str(args.batch_size), "--num_generations", "4", "--micro_batch_size",
           str(min(args.micro_batch_size, args.batch_size)), "--max_new_tokens", str(args.max_new_tokens), "--eval_every", "1000000",
           "--log_every", "1000000", "--log_rollouts", "0", "--save_model", "False", "--seed", "0", "--output_dir",
           str(out_dir), *VARIANTS[name]]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    steps = [r for r in read_metrics(out_dir / "metrics.jsonl") if "train/grad_norm" in r][1:]

    def median(key):
        return statistics.median(r.get(key, 0.0) for r in steps)
    return {"variant": name, "timed_steps": len(steps), "step_s": median("time/step_s"),
            "wait_s": median("time/generation_s"), "update_s": median("time/forward_backward_s"),
            "sampler_s": median("time/sampler_generation_s") + median("time/sampler_scoring_s"),
            "staleness": statistics.mean(r.get("train/staleness_mean", 0.0) for r in steps),
            "run_s": time.time() - start}


def table(results):
    lines = ["| sampling | s/step (learner) | speed-up | learner: wait for the batch, s | learner: forward/backward, s "
             "| sampler process: sampling + scoring, s per batch | staleness (steps) | run, s |", "|---" * 8 + "|"]
    for r in results:
        lines.append(f"| {r['variant']} | {r['step_s']:.3f} | {results[0]['step_s'] / r['step_s']:.2f}× "
                     f"| {r['wait_s']:.3f} | {r['update_s']:.3f} | {r['sampler_s']:.3f} | {r['staleness']:.2f} "
                     f"| {r['run_s']:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="grpo.py --num_steps of each run; the first is not timed.")
    parser.add_argument("--batch_size", type=int, default=32, help="Sampled completions per step (4 per prompt).")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="Sequences per forward/backward pass.")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="Completion length (reached: EOS is rare).")
    parser.add_argument("--allow_cpu", action="store_true", help="Without CUDA, run a tiny model on CPU instead.")
    parser.add_argument("--out", default=str(ROOT / "runs/async_gpu/async_gpu.md"),
                        help="Markdown file for the table, the raw numbers beside it as .json.")
    args = parser.parse_args()

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("No CUDA GPU here: bench/async_gpu.py measures the sampler process on a GPU. --allow_cpu runs a tiny "
              "model on CPU instead, to test the code path.")
        return
    device = torch.cuda.get_device_name() if on_gpu else "CPU (--allow_cpu: a tiny model, to test the code path only)"
    start, results = time.time(), []
    with tempfile.TemporaryDirectory(prefix="async_gpu_") as tmp:
        model_path = make_large_model(os.path.join(tmp, "model"), QWEN25_05B if on_gpu else TINY)
        for name in VARIANTS:
            print(f"{name} ...", file=sys.stderr, flush=True)
            results.append(run_one(name, model_path, args, tmp))
    text = "\n".join([
        f"Device: {device}; torch {torch.__version__}. Model: random Qwen2.5-0.5B shape ({'2 layers, ' * (not on_gpu)}"
        f"vocabulary 151,936), float32; grpo.py, {args.steps} steps per run, the first left out (medians over the "
        f"rest); batch {args.batch_size} (4 per prompt), micro-batch {args.micro_batch_size}, max_new_tokens "
        f"{args.max_new_tokens}; random 0/1 rewards; no evaluation. Speed-up: against the first row.",
        f"Command: `{shlex.join(['python', 'bench/async_gpu.py', *sys.argv[1:]])}`; {time.time() - start:.0f} s.", "",
        table(results), ""])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
