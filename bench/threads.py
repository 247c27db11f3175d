"""How a plain `python grpo.py` gets its one thread, measured: seconds per step of the same run started three ways,
alternated in rounds, each with an --output_dir of its own.

- `launch`: `python grpo.py` with OMP_NUM_THREADS unset: helpers.launch starts the process again with
  OMP_NUM_THREADS=1, so torch starts its thread pools with one thread (what the scripts do).
- `omp1`: `OMP_NUM_THREADS=1 python grpo.py`, what `accelerate launch` gives each process.
- `set_after`: OMP_NUM_THREADS unset, torch imported (its pools started with a thread per core), then
  torch.set_num_threads(1) and main() called: what the scripts did before they started again.

The median of time/step_s over the steps after the first (metrics.jsonl), and the wall time of the command.

    python bench/threads.py --script grpo.py --steps 100 --rounds 3     # -> a markdown table on stdout
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("launch", "omp1", "set_after")


def command(way, script, args):
    """(argv, env) of one way of starting `script` with `args`."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    if way == "launch":
        return [sys.executable, script, *args], env
    if way == "omp1":
        return [sys.executable, script, *args], {**env, "OMP_NUM_THREADS": "1"}
    name = os.path.splitext(script)[0]
    code = (f"import sys, torch; torch.set_num_threads(1); sys.argv = {[script, *args]!r}; "
            f"sys.path.insert(0, {ROOT!r}); import {name}; {name}.main()")
    return [sys.executable, "-c", code], env


def step_seconds(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["time/step_s"] for r in rows if r["step"] > 1 and "time/step_s" in r]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", default="grpo.py")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = WAYS[r % 3:] + WAYS[:r % 3]  # each way first once in three rounds
            for way in order:
                out = os.path.join(tmp, f"{way}_{r}")
                flags = ["--num_steps", str(args.steps), "--eval_every", str(10 * args.steps), "--output_dir", out]
                argv, env = command(way, args.script, flags)
                start = time.time()
                subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
                results[way].append((statistics.median(step_seconds(out)), time.time() - start))
    print(f"`python bench/threads.py --script {args.script} --steps {args.steps} --rounds {args.rounds}`; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| way | median s/step, each round | wall s, each round |\n|---|---|---|")
    for way in WAYS:
        steps, walls = zip(*results[way])
        print(f"| `{way}` | {', '.join(f'{s:.4f}' for s in steps)} | {', '.join(f'{w:.1f}' for w in walls)} |")


if __name__ == "__main__":
    main()
