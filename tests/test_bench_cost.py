"""bench/cost.py: a tiny smoke run (embedded model, 2 steps) and the exactness of its accounting."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402

from transformers import AutoModelForCausalLM  # noqa: E402

from support import config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_cost_benchmark_smoke_run_accounts_model_state_exactly(tmp_path):
    out = tmp_path / "cost.md"
    cmd = [sys.executable, "bench/cost.py", "--models", "embedded", "--algorithms", "remax,ppo", "--steps", "2", "--warmup", "1",
           "--batch_size", "8", "--max_new_tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "| remax | 1 + 1 |" in text and "| ppo | 2 + 1 |" in text and "ReMax / ppo" in text
    results = json.loads(out.with_suffix(".json").read_text())["embedded"]

    policy = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    n = sum(p.numel() for p in policy.parameters())  # tied embeddings counted once
    fp32 = 4
    # ReMax: policy (param + grad + 2 Adam moments) and a frozen reference (param only)
    assert sum(m["state_bytes"] for m in results["remax"]["models"]) == (4 + 1) * n * fp32
    assert results["remax"]["adam_state_bytes_measured"] == 2 * n * fp32
    # PPO adds the critic: the backbone without the LM head (tied here, so no saving) plus a hidden-size head
    hidden = policy.config.hidden_size
    critic = n + hidden
    assert sum(m["state_bytes"] for m in results["ppo"]["models"]) == (4 * n + 4 * critic + n) * fp32
    assert results["ppo"]["adam_state_bytes_measured"] == 2 * (n + critic) * fp32
    for r in results.values():
        assert r["peak_rss_bytes"] > r["baseline_rss_bytes"] > 0
        assert r["timed_steps"] == 1 and r["time"]["step"] > 0
        assert abs(sum(v for k, v in r["time"].items() if k != "step") - r["time"]["step"]) < 1e-6
