"""bench/gpu_check.py and bench/decode_gpu.py without a GPU: they say so and exit 0; with --allow_cpu a tiny model runs
gpu_check's code path."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("script", ["gpu_check", "decode_gpu"])
def test_a_gpu_benchmark_without_cuda_says_so_and_exits_0(tmp_path, script):
    """bench/gpu_check.py and bench/decode_gpu.py (the decode benchmark): without a GPU they measure nothing and write
    nothing."""
    out = (tmp_path / script).with_suffix(".md")
    proc = subprocess.run([sys.executable, f"bench/{script}.py", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "No CUDA GPU here" in proc.stdout and "--allow_cpu" in proc.stdout
    assert not out.exists()


def test_gpu_check_allow_cpu_runs_the_code_path_on_a_tiny_model(tmp_path):
    out = (tmp_path / "gpu_check").with_suffix(".md")
    cmd = [sys.executable, "bench/gpu_check.py", "--allow_cpu", "--algorithms", "remax", "--precisions", "bf16",
           "--steps", "2", "--batch_size", "4", "--micro_batch_size", "2", "--max_new_tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "| CPU | bf16 | remax | 1 |" in text
    (r,) = json.loads(out.with_suffix(".json").read_text())
    assert (r["precision"], r["algorithm"], r["on_gpu"], r["timed_steps"]) == ("bf16", "remax", False, 1)
    assert r["completion_len"] > 0 and r["peak_bytes"] > 0 and r["step_s"] > 0
    assert r["generation_tokens_per_s"] > 0 and r["tokens_per_s"] > 0
