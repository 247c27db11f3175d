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


@pytest.mark.parametrize("script, flags", [("gpu_check", []), ("gpu_check", ["--recipe"]), ("decode_gpu", [])])
def test_a_gpu_benchmark_without_cuda_says_so_and_exits_0(tmp_path, script, flags):
    """bench/gpu_check.py (its --recipe too) and bench/decode_gpu.py (the decode benchmark): without a GPU they
    print one line, measure nothing and write nothing."""
    out = (tmp_path / script).with_suffix(".md")
    proc = subprocess.run([sys.executable, f"bench/{script}.py", *flags, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "No CUDA GPU here" in proc.stdout and "--allow_cpu" in proc.stdout and len(proc.stdout.splitlines()) == 1
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


def test_gpu_check_recipe_allow_cpu_runs_grpo_on_a_gsm8k_shaped_file_with_a_bpe_tokenizer(tmp_path):
    """--recipe's code path on CPU: two steps of grpo.py (the lesson) on the GSM8K-shaped file, with the tokenizer
    built here; lab/grpo.py --sampler vllm is left out with the reason where vLLM or the flag is missing."""
    out = (tmp_path / "recipe").with_suffix(".md")
    cmd = [sys.executable, "bench/gpu_check.py", "--recipe", "--allow_cpu", "--batch_size", "8", "--micro_batch_size",
           "4", "--max_new_tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert results[0]["algorithm"] == "grpo" and results[0]["timed_steps"] == 1 and results[0]["tokens_per_s"] > 0
    text = out.read_text()
    assert "| grpo | " in text and "tokenizer built here, 2,003 tokens" in text
    assert ("| grpo_vllm | " in text) != ("--sampler vllm: not run" in text)


def test_the_recipes_memory_arithmetic_is_the_docs():
    """docs/scaling.md: about 45 GB per GPU for Qwen2.5-1.5B in recipe (a), 19 GB for Qwen2.5-0.5B."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import QWEN25_05B, docs_estimate_bytes

    qwen15 = {**QWEN25_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28}
    assert round(docs_estimate_bytes(qwen15, 1.54e9, micro_batch=4, new_tokens=512) / 1e9) == 45
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_05B)).parameters())
    assert round(params / 1e6) == 494  # Qwen2.5-0.5B's 494M, the embedding tied
    assert round(docs_estimate_bytes(QWEN25_05B, params, micro_batch=4, new_tokens=512) / 1e9) == 19
