"""The rollout viewer's cost in run time: the same run with the default --log_rollouts and with --log_rollouts 0,
one after the other for --rounds rounds (the order alternates), each a fresh process. On a machine shared with
other jobs a run is now and then slowed many times over, so the headline is the median over the rounds of each
round's ratio: a slowed run moves one ratio, not the median. Wall time and the process's CPU time are both shown.

    python bench/viewer_cost.py                                  # lab/grpo.py --num_steps 20 --eval_every 10, 12 rounds
    python bench/viewer_cost.py --script lab/remax.py --rounds 6 -- --num_steps 50
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_run(script, args, output_dir):
    """(wall seconds, CPU seconds) of `python script args --output_dir output_dir`, which must succeed."""
    shutil.rmtree(output_dir, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, script, *args, "--output_dir", str(output_dir)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"error: {script} {' '.join(args)} failed:\n{err[-2000:]}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", default="lab/grpo.py")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("args", nargs="*", help="The run's flags (after --; default: the command in the docstring).")
    args = parser.parse_args(argv)
    run_args = args.args or ["--num_steps", "20", "--eval_every", "10", "--save_model", "False"]
    variants = {"default": [], "off": ["--log_rollouts", "0"]}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            names = list(variants) if r % 2 == 0 else list(reversed(variants))
            rounds.append({name: timed_run(args.script, run_args + variants[name], Path(tmp) / name) for name in names})
            print(f"round {r}: " + ", ".join(f"{name} {wall:.2f} s wall, {cpu:.2f} s CPU"
                                             for name, (wall, cpu) in rounds[-1].items()), flush=True)
    for i, what in enumerate(("wall", "CPU")):
        ratios = [row["default"][i] / row["off"][i] for row in rounds]
        print(f"{what}: default / off = {statistics.median(ratios):.4f} (median of {len(ratios)} rounds' ratios; "
              f"median times {statistics.median(row['default'][i] for row in rounds):.2f} s and "
              f"{statistics.median(row['off'][i] for row in rounds):.2f} s)")


if __name__ == "__main__":
    main()
