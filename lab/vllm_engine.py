"""--sampler vllm (docs/vllm.md): a vLLM engine draws the rollouts, ReMax's greedy completions and the evaluation's
greedy decode, as TRL, verl and OpenRLHF sample with an inference engine. The engine runs in a process of its own,
under the Python of an environment of its own (--vllm_python; `bash lab/install_vllm.sh` makes it), as TRL's server
mode does: vLLM's builds pin the transformers and torch they were built with, and this repository's loops need a
newer transformers than vLLM accepts. Nothing of vLLM is imported here: the trainer sends token ids and receives
token ids (lab/vllm_worker.py is the other side).

What is sampled is what is scored, and where it cannot be, the difference is measured: the engine draws each token
from exactly --temperature, --top_k and --top_p and returns its log-prob under that distribution (the behaviour
policy mu: rollout.sampler_logp), which the lab's mismatch metrics (train/mismatch_k3, the ratios' extremes, ESS)
and corrections (--tis_cap, --geo_mask_delta, --tis_veto, --m2po_tau) compare with the trainer's log-probs, as they
do a low-precision copy's. Before each sampling the engine takes the policy's weights if an optimizer step changed
them (LoRA: merged; ZeRO-3: gathered), so every batch is drawn from the current policy. Each completion is drawn
with its own seed, taken from the trainer's random state: a run is repeatable, and a resumed run draws as the
uninterrupted one would."""
import json
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time

import torch

from lab import tool_process
from support import config, models

ENGINE_PYTHON = os.path.join(config.ROOT, ".venv-vllm", "bin", "python")
INSTALL = "bash lab/install_vllm.sh"
START_TIMEOUT_S = 1800  # a first start compiles kernels: minutes on a busy 2-core machine


def check(cfg):
    """Before any model loads: what the engine cannot do here, one error line each."""
    refuse = [(getattr(cfg, "rollout_lag", 0) > 0, "--rollout_lag: the engine samples with the current weights"),
              (bool(getattr(cfg, "environment", "") or getattr(cfg, "tools", "")),
               "--environment or --tools: episodes are played by this repository's decode loop"),
              (cfg.keep_routing != "none", "--keep_routing: vLLM does not return a mixture of experts' routing")]
    for refused, what in refuse:
        if refused:
            raise SystemExit(f"error: --sampler vllm does not run with {what}.")
    python = cfg.vllm_python or ENGINE_PYTHON
    if not os.access(python, os.X_OK):
        raise SystemExit(f"error: --sampler vllm: no engine environment at {python}: run `{INSTALL}` (docs/vllm.md), "
                         "or give --vllm_python the Python of an environment with vLLM installed.")


def model_len(cfg):
    """The engine's max_model_len: --max_prompt_length + --max_new_tokens, at most the model's
    max_position_embeddings (which vLLM will not exceed)."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(cfg.model_name_or_path), "max_position_embeddings", None)
    need = cfg.max_prompt_length + cfg.max_new_tokens
    return need if limit is None else min(limit, need)


def check_lengths(cfg, tokenizer, examples):
    """Before any model loads: the longest prompt plus --max_new_tokens fits in the engine's max_model_len."""
    from support import tasks

    longest = max(int(tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples[i:i + 256]], "cpu")[1]
                      .sum(1).max()) for i in range(0, len(examples), 256))
    limit = model_len(cfg)
    if longest + cfg.max_new_tokens > limit:
        raise SystemExit(f"error: --sampler vllm: the longest prompt ({longest} tokens) plus --max_new_tokens "
                         f"({cfg.max_new_tokens}) is longer than the engine may hold ({limit} tokens: the "
                         "model's max_position_embeddings, or --max_prompt_length + --max_new_tokens): lower "
                         "--max_new_tokens, or drop long prompts with --max_prompt_length.")


class Engine:
    """The trainer's handle on the engine's process: `generate` (common.generate's signature, with logprobs the
    drawn tokens' log-probs too), `weights_changed` (after an update: the next sampling hands the engine the policy's
    weights first), `close`. device: the trainer's (a GPU: the engine shares it); rank: the trainer's process index."""

    def __init__(self, cfg, device, rank):
        self.stale, self.cuda = True, device.type == "cuda"  # stale: the engine holds other weights than the policy
        self.dtype = getattr(torch, getattr(cfg, "rollout_dtype", cfg.torch_dtype))
        settings = {"model": cfg.model_name_or_path, "dtype": str(self.dtype).removeprefix("torch."),
                    "max_model_len": model_len(cfg),
                    "memory": cfg.vllm_memory or (0.3 if self.cuda else 0.1), "seed": cfg.seed + rank,
                    "device": "cuda" if self.cuda else "cpu"}
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.log = os.path.join(cfg.output_dir, f"vllm_engine{rank or ''}.log")
        self.folder = tempfile.mkdtemp(prefix="vllm-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
        env.pop("OMP_NUM_THREADS", None)  # the engine samples while the trainer waits: it may take every core
        if self.cuda:  # colocated: the trainer's GPU (its index among those CUDA_VISIBLE_DEVICES shows)
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            index = device.index or 0
            env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
        here, there = multiprocessing.Pipe()
        began = time.perf_counter()
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [cfg.vllm_python or ENGINE_PYTHON, os.path.join(config.ROOT, "lab", "vllm_worker.py"),
                 str(there.fileno()), json.dumps(settings)], pass_fds=[there.fileno()], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=tool_process.die_with_parent)  # the kernel kills the engine when the trainer dies
        there.close()
        self.conn = here
        ready = self.receive(START_TIMEOUT_S, "start")["ready"]
        self.start_s = time.perf_counter() - began
        config.say(f"vLLM {ready['vllm']} started in {self.start_s:.1f} s (its log: {self.log})")

    def receive(self, timeout, what):
        """The engine's answer, or one error line (its own, or its log's last line when it died)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                state = "stopped" if self.process.returncode is not None else "did not answer"
                self.close()
                raise SystemExit(f"error: --sampler vllm: the engine {state} during {what} ({self.last_log_line()}); "
                                 f"its log: {self.log}")
        try:
            answer = json.loads(self.conn.recv_bytes())
        except EOFError:
            answer = {"error": self.last_log_line()}
        if "error" in answer:
            self.close()
            raise SystemExit(f"error: --sampler vllm: the engine failed during {what}: {answer['error']} "
                             f"(its log: {self.log})")
        return answer

    def ask(self, request, what, timeout=3600):
        try:
            self.conn.send_bytes(json.dumps(request).encode())
        except OSError:  # the engine is gone: receive says why
            pass
        return self.receive(timeout, what)

    def last_log_line(self):
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip() and "Traceback" not in line]
            errors = [line for line in lines if "Error" in line or "error" in line]
            return (errors or lines or ["nothing logged"])[-1][:300]
        except OSError:
            return "no log"

    def weights_changed(self):
        """The policy took an update: the engine takes its weights before it samples again."""
        self.stale = True

    def sync(self, model):
        """Hand the engine the policy's weights when an update changed them since it last took them (the first call
        always: the engine starts from the model's folder, the policy from there or from a checkpoint)."""
        if not self.stale:
            return
        path = os.path.join(self.folder, "weights.safetensors")
        from safetensors.torch import save_file
        with models.gathered_parameters(model):
            save_file(checkpoint_weights(model, self.dtype), path)
        self.ask({"op": "load", "path": path}, "loading the policy's weights")
        os.remove(path)
        self.stale = False

    @torch.no_grad()
    def generate(self, model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1, greedy=False, logprobs=False):
        """common.generate's (B * num_samples, C) completion ids, each prompt's samples adjacent, padded after EOS,
        drawn by the engine with the policy's current weights; with logprobs also the (B * num_samples, C) log-prob
        of each drawn token under the distribution it was drawn from (0 after EOS). On a GPU the engine sleeps
        between calls (vLLM's sleep mode, level 1: its weights wait in CPU memory, its cache is freed), so that
        training has the GPU's memory back."""
        if self.cuda:
            self.ask({"op": "wake"}, "waking up")
        self.sync(model)
        k = 1 if greedy else num_samples
        prompts = [row[keep.bool()].tolist() for row, keep in zip(prompt_ids, prompt_mask) for _ in range(k)]
        # the trainer's random state (a greedy decode draws nothing: it leaves that state as our decode loop does)
        seeds = [0] * len(prompts) if greedy else torch.randint(0, 2 ** 31 - 1, (len(prompts),)).tolist()
        answer = self.ask({"op": "generate", "prompts": prompts, "seeds": seeds, "greedy": greedy,
                           "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
                           "max_tokens": cfg.max_new_tokens, "stop_token_ids": [tokenizer.eos_token_id]}, "sampling")
        if self.cuda:
            self.ask({"op": "sleep"}, "going to sleep")
        width = max(1, max(len(t) for t in answer["tokens"]))
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        logp = torch.zeros(len(prompts), width)
        for i, (tokens, lps) in enumerate(zip(answer["tokens"], answer["logprobs"])):
            ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logp[i, :len(lps)] = torch.tensor(lps)
        device = prompt_ids.device
        return (ids.to(device), logp.to(device)) if logprobs else ids.to(device)

    def close(self):
        """End the engine's process (it ends by itself when the trainer dies) and remove its weights' folder."""
        if self.process.poll() is None:
            try:
                self.conn.send_bytes(json.dumps({"op": "close"}).encode())
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@torch.no_grad()
def checkpoint_weights(model, dtype):
    """The model's weights under the names of its checkpoint (model.layers.0...., tied ones once), in dtype: a
    peft model's with each LoRA adapter merged into its layer (W + B A * alpha / r), its adapters left as they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    deltas = {name: module.get_delta_weight(module.active_adapters[0]) for name, module in base.named_modules()
              if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and module.active_adapters}
    weights = {}
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        module = name.rpartition(".")[0].removesuffix(".base_layer")
        weight = p + deltas[module] if name.endswith(".weight") and module in deltas else p
        weights[name.replace(".base_layer.", ".")] = weight.detach().to("cpu", dtype).contiguous()
    return weights
