"""bench/memory.py: a tiny smoke run (embedded model, 4-token completions) and the AdamW state it allocates early."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.memory import allocate_adamw_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_memory_benchmark_smoke_run_measures_every_configuration(tmp_path):
    out = (tmp_path / "memory").with_suffix(".md")
    cmd = [sys.executable, "bench/memory.py", "--model", "embedded", "--batch_sizes", "4", "8",
           "--micro_batch_size", "2", "--max_whole_batch", "4", "--max_new_tokens", "4", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # resident memory: the CPU path
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for row in ("| remax | 4 | 2 | 8 | 4.0 |", "| remax | 8 | 2 | 8 | 4.0 |",
                "| remax | 4 | none (whole batch) | 8 | 4.0 |"):
        assert row in text
    results = json.loads(out.with_suffix(".json").read_text())
    assert [(r["batch_size"], r["micro_batch_size"]) for r in results] == [(4, 2), (8, 2), (4, 0)]
    for r in results:
        assert r["completion_len"] == 4  # EOS held back: every completion is max_new_tokens long
        # AdamW's two moments, allocated before the first step, for the one trainable model (the policy)
        assert r["adam_state_bytes"] == 2 * r["gradient_bytes"] == 2 * r["models"][0]["trainable_bytes"]
        assert 0 < r["runtime_bytes"] < r["loaded_bytes"] < r["model_and_optimizer_bytes"] < r["peak_bytes"]
        assert r["step_s"] > 0 and r["steps"] == 1


@pytest.mark.parametrize("fused", [False, True])
def test_allocating_adamw_state_before_the_first_step_leaves_the_updates_unchanged(fused):
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01, fused=fused) for m in models]
    allocate_adamw_state(optimizers[1])
    for x in torch.randn(3, 5, 4):
        for model, optimizer in zip(models, optimizers):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
