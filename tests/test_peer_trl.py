"""bench/peer_trl.py without TRL (CI has none): the step clock's arithmetic, the reward TRL is handed,
and a smoke run of our side."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from lab import config as lab_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("peer_trl", ROOT / "bench" / "peer_trl.py")
peer_trl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer_trl)


def run_of(ends, accuracy=0.5):
    """A run whose steps end at the given times, half of each step's wall time on the CPU; every phase 0.1 s."""
    steps = [{"t": t, "cpu": t / 2, "generation": 0.1, "scoring": 0.1, "forward_backward": 0.1, "completion_len": 4.0}
             for t in ends]
    return {"steps": steps, "accuracy": accuracy, "peak_rss": 2, "baseline_rss": 1}


def test_step_times_are_gaps_between_step_ends_without_warmup_and_last_step():
    # ends 0, 10, 11, 13, 16, 99: warmup 1 leaves out the step ending at 10, the last (with evaluation) the 99
    rows = peer_trl.step_rows(run_of([0, 10, 11, 13, 16, 99]), warmup=1)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["cpu"] for r in rows] == [0.5, 1, 1.5]
    assert abs(rows[0]["rest"] - 0.7) < 1e-12  # the wall time no phase accounts for


def test_ratio_is_ours_over_trl_median_per_seed_and_pooled():
    results = {"ours": [run_of([0, 1, 2, 3, 4, 5]), run_of([0, 2, 4, 6, 8, 10])],  # medians 1 and 2
               "trl": [run_of([0, 4, 8, 12, 16, 20]), run_of([0, 4, 8, 12, 16, 20])]}  # medians 4 and 4
    summary = peer_trl.summarise(results, warmup=1)
    assert summary["ours"]["seed_ratios"] == {"step": [0.25, 0.5], "cpu": [0.25, 0.5]}
    assert summary["ours"]["step"] == 1.5 and summary["trl"]["step"] == 4  # median of 1,1,1,2,2,2 and of 4s


def test_trl_reward_is_the_project_reward_in_trl_signature():
    reward = peer_trl.trl_reward(lab_config.LabConfig(reward_scales="hetero"))
    got = reward(prompts=["12+3=", "12+3=", "9*9="], completions=["15", "16", "81"], answer=["15", "15", "81"],
                 family=["add_2x1", "add_2x1", "mul_2x1"], completion_ids=None)
    assert got == [5.0, 4.0, -2.0]  # HETERO_SCALES: add_2x1 (4, 5), mul_2x1 (-3, -2)


def test_our_side_runs_without_trl(tmp_path):
    out = tmp_path / "peer_table"
    cmd = [sys.executable, "bench/peer_trl.py", "--trl_python", "", "--settings", "embedded", "--algorithms", "rloo",
           "--seeds", "0", "--steps", "4", "--batch_size", "16", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in out.read_text().splitlines() if line.startswith("| rloo | rloo.py |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[2]) > 0 and 0 <= float(cells[-1].split()[0]) <= 1  # s/step and held-out accuracy
