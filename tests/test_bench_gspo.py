"""bench/gspo.py, which makes docs/results.md's GSPO table: 2 steps, one seed, a tiny batch."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gspo_benchmark_smoke_run_prints_one_row_per_variant(tmp_path):
    cmd = [sys.executable, "bench/gspo.py", "--seeds", "0", "--num_steps", "2", "--num_epochs", "2",
           "--batch_size", "16", "--jobs", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    names = ["| GRPO, on-policy (mu = 1)", "| GRPO, token ratio, eps 0.2 (mu = 2)",
             "| GSPO, sequence ratio, eps 3e-4 / 4e-4 (mu = 2)"]
    # the summary table, then held-out accuracy at each evaluation (steps 0 and 2)
    assert [row.split(" | ")[0] for row in rows] == ["| variant", *names, "| held-out accuracy at step", *names]
    assert rows[4] == "| held-out accuracy at step | 0 | 2 |"
    assert (tmp_path / "results.md").read_text().strip() == proc.stdout.strip()

    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == ["grpo_mu1", "grpo", "gspo"]
    for variant, flags in [("grpo_mu1", ["--num_epochs", "1"]), ("grpo", ["--num_epochs", "2"]),
                           ("gspo", ["--num_epochs", "2", "--importance_sampling_level", "sequence"])]:
        run_dir = tmp_path / f"{variant}_s0"
        command = json.loads((run_dir / "run.json").read_text())["command"]
        assert command[-len(flags):] == flags and "--epsilon" not in command  # each level's default clip range
        (run,) = results[variant]
        assert 0 <= run["before"] <= 1 and 0 <= run["after"] <= 1 and run["wall_s"] > 0
        assert json.loads((run_dir / "summary.json").read_text())["eval_accuracy_after"] == run["after"]
    assert results["grpo_mu1"][0]["approx_kl"] == 0  # on-policy: the ratio is 1


def test_gspo_benchmark_refuses_one_epoch():
    proc = subprocess.run([sys.executable, "bench/gspo.py", "--num_epochs", "1"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--num_epochs must be > 1" in proc.stderr
