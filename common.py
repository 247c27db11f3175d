"""What the five algorithm files share: KL estimators, masking, log-probs, generation, the
built-in task and its rewards, model loading, logging and plots.

Nothing in here belongs to one algorithm. The math (KL estimators, masking, aggregation,
reward-to-go) is pure: tensors in, tensors out. See shared ALGORITHMS.md §3 for the KL math.
"""
import ast
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED_MODEL = os.path.join(HERE, "embedded_model")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------------------
# Configuration shared by every algorithm (each file subclasses it with what it adds)
# ----------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    model_name_or_path: str = field(default=EMBEDDED_MODEL, metadata={"help": "HF causal LM: Hub name or local folder (default: the embedded tiny model)."})
    dataset: str = field(default="arithmetic", metadata={"help": "'arithmetic' (built-in task, no download), 'gsm8k' (Hub openai/gsm8k) or a local .json/.jsonl/.parquet file."})
    prompt_column: str = field(default="question", metadata={"help": "Prompt column of --dataset gsm8k or a local file."})
    answer_column: str = field(default="answer", metadata={"help": "Answer column (final number after '####', in \\boxed{}, or the last number); '' for prompts without answers (reward model only)."})
    eval_size: int = field(default=200, metadata={"help": "Held-out prompts for a real dataset (its test split, else the last rows of the file)."})
    use_chat_template: bool = field(default=True, metadata={"help": "Wrap prompts in the tokenizer's chat template when it has one."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts longer than this many tokens are dropped from the data (with a warning): truncating a question makes it unanswerable."})
    torch_dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 (use with --mixed_precision bf16/fp16 in accelerate), bfloat16 or float16 (pure low precision)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward: less memory, ~30%% more time."})
    reward_model: str = field(default="", metadata={"help": "AutoModelForSequenceClassification (Hub name or folder) scoring (prompt, completion) with its own tokenizer and chat template."})
    reward_model_dtype: str = field(default="float32", metadata={"help": "dtype of the reward model (float32, bfloat16, float16)."})
    reward_model_weight: float = field(default=1.0, metadata={"help": "reward = rule_reward_weight * rule reward + reward_model_weight * reward-model score."})
    rule_reward_weight: float = field(default=1.0, metadata={"help": "Weight of the rule-based (correctness) reward; 0 with --reward_model for pure RLHF."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0 = full fine-tuning). With LoRA the reference is the same model with the adapter disabled: no second copy."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Comma-separated module names for LoRA, or 'all-linear'."})
    merge_lora: bool = field(default=False, metadata={"help": "Save the final model with the LoRA adapter merged into the weights (else the adapter alone)."})
    save_steps: int = field(default=0, metadata={"help": "Write a resumable checkpoint every N steps (0 = only on Ctrl-C/SIGTERM)."})
    resume_from: str = field(default="", metadata={"help": "A checkpoint folder (output_dir/checkpoint-N) to continue from."})
    reward_scales: str = field(default="uniform", metadata={"help": "'uniform': reward 1/0 for right/wrong; 'hetero': each task family has its own reward range (as a learned reward model gives different prompt kinds), see HETERO_SCALES."})
    output_dir: str = field(default="", metadata={"help": "Where metrics, plots and the final model go (default: runs/<script name>)."})
    seed: int = field(default=0, metadata={"help": "Random seed; rank r samples with seed + r."})
    num_steps: int = field(default=200, metadata={"help": "Optimizer steps (one rollout batch each)."})
    batch_size: int = field(default=64, metadata={"help": "Sampled completions per step per process (the ones the loss trains on)."})
    learning_rate: float = field(default=1e-4, metadata={"help": "Policy learning rate (AdamW). Tiny model default; papers use ~1e-6 for 7B models."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear learning-rate warm-up steps, then constant."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value (0 turns clipping off)."})
    max_new_tokens: int = field(default=8, metadata={"help": "Maximum completion length in tokens."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; log-probs are computed at the same temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling. Below 1, samples come from a truncated distribution but log-probs from the full one (a small off-policy bias)."})
    eval_every: int = field(default=25, metadata={"help": "Held-out greedy accuracy every N steps (and at start and end)."})
    log_every: int = field(default=10, metadata={"help": "Print a metrics line every N steps (every step goes to metrics.jsonl)."})
    report_to: str = field(default="none", metadata={"help": "Extra trackers: 'none', 'tensorboard' or 'wandb'."})
    save_model: bool = field(default=True, metadata={"help": "Save the final policy with save_pretrained (+ tokenizer) in output_dir/final."})

    def __post_init__(self):
        positive = ("num_steps", "batch_size", "learning_rate", "max_new_tokens", "temperature", "eval_every", "log_every")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name} must be > 0 (got {getattr(self, name)}).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1] (got {self.top_p}).")
        if self.max_grad_norm < 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (got {self.max_grad_norm}).")
        if self.reward_scales not in ("uniform", "hetero"):
            raise ValueError(f"--reward_scales must be 'uniform' or 'hetero' (got {self.reward_scales!r}).")
        if self.report_to not in ("none", "tensorboard", "wandb"):
            raise ValueError(f"--report_to must be none, tensorboard or wandb (got {self.report_to!r}).")
        if self.dataset not in ("arithmetic", "gsm8k"):
            if not self.dataset.endswith((".json", ".jsonl", ".parquet")):
                raise ValueError(f"--dataset must be 'arithmetic', 'gsm8k' or a .json/.jsonl/.parquet file (got {self.dataset!r}).")
            if not os.path.isfile(self.dataset):
                raise ValueError(f"--dataset {self.dataset!r}: no such file.")
        for name in ("torch_dtype", "reward_model_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"--{name} must be one of {sorted(DTYPES)} (got {getattr(self, name)!r}).")
        for name in ("max_prompt_length", "eval_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be > 0 (got {getattr(self, name)}).")
        for name in ("lora_r", "save_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0 (got {getattr(self, name)}).")
        if self.resume_from and not os.path.isfile(os.path.join(self.resume_from, "trainer_state.json")):
            raise ValueError(f"--resume_from {self.resume_from!r} is not a checkpoint folder (no trainer_state.json).")
        if self.rule_reward_weight == 0 and not self.reward_model:
            raise ValueError("--rule_reward_weight 0 leaves no reward: give --reward_model too.")
        if not self.answer_column and not self.reward_model and self.dataset != "arithmetic":
            raise ValueError("--answer_column '' (no answers) needs a --reward_model to score completions.")


def make_accelerator(cfg):
    """An Accelerator that falls back to CPU (gloo between processes) when there is no GPU,
    so `accelerate launch --multi_gpu --num_processes 2 x.py` (or `torchrun --nproc_per_node 2`)
    gives 2-process data parallelism on a laptop. (`accelerate launch --cpu --num_processes 2`
    starts ONE process in accelerate 1.x unless an MPI hostfile is given.)"""
    from accelerate import Accelerator

    cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true")
    return Accelerator(cpu=cpu, log_with=None if cfg.report_to == "none" else cfg.report_to, project_dir=cfg.output_dir)


def parse_config(config_class, args=None):
    """Parse the command line into `config_class`; a bad value exits with one clear line."""
    from transformers import HfArgumentParser

    try:
        (cfg,) = HfArgumentParser(config_class).parse_args_into_dataclasses(args=args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not cfg.output_dir:
        cfg.output_dir = os.path.join("runs", os.path.splitext(os.path.basename(sys.argv[0]))[0])
    return cfg


# ----------------------------------------------------------------------------------------
# KL estimators (ALGORITHMS.md §3). Samples y ~ q = pi_theta, target KL(pi_theta || pi_ref).
# ----------------------------------------------------------------------------------------
def kl_k1(logp, ref_logp):
    """k1 = log q - log p, per token.

    Value: unbiased for KL(q||p), but can be negative and has high variance.
    As a loss term (gradient through logp): E[grad k1] = 0, so it does nothing useful.
    As a detached penalty in the reward: E[k1 * score] = grad KL(q||p), the correct one
    (for sequences, use the reward-to-go of the per-token k1). PPO, ReMax, RLOO use this.
    """
    # BEGIN SOLUTION
    return logp - ref_logp
    # END SOLUTION


def kl_k2(logp, ref_logp):
    """k2 = 0.5 (log q - log p)^2, per token.

    Value: biased (third order in the log-ratio), low variance, >= 0.
    As a loss term: E[grad k2] = grad KL(q||p), the reverse-KL gradient.
    As a detached penalty in the reward: a wrong gradient.
    """
    # BEGIN SOLUTION
    return 0.5 * (logp - ref_logp) ** 2
    # END SOLUTION


def kl_k3(logp, ref_logp):
    """k3 = p/q - log(p/q) - 1, per token ("low_var_kl"; Schulman's estimator).

    Value: unbiased for KL(q||p), >= 0, low variance.
    As a loss term: E[grad k3] = grad KL(p||q), the FORWARD KL gradient; this is what
    GRPO's loss term optimises.
    As a detached penalty in the reward: a wrong gradient.
    """
    # BEGIN SOLUTION
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1
    # END SOLUTION


# ----------------------------------------------------------------------------------------
# Masking and loss aggregation
# ----------------------------------------------------------------------------------------
def masked_sum(x, mask, dim=None):
    """Sum of x where mask is 1 (masked entries may hold anything, even NaN)."""
    # BEGIN SOLUTION
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)
    # END SOLUTION


def masked_mean(x, mask, dim=None):
    """Mean of x where mask is 1; an all-masked slice gives 0."""
    # BEGIN SOLUTION
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp(min=1)
    # END SOLUTION


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the masked entries (std with Bessel's correction, as TRL).
    With shift_mean=False the mean is added back (only the scale changes)."""
    # BEGIN SOLUTION
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
    # END SOLUTION


def completion_mask(completion_ids, eos_token_id):
    """1 up to and including the first EOS, 0 after it (padding after EOS included).
    A completion with no EOS (cut at max length) keeps every token."""
    # BEGIN SOLUTION
    is_eos = completion_ids == eos_token_id
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before t
    return (eos_before == 0).long()
    # END SOLUTION


def aggregate_loss(per_token_loss, mask, mode, max_len=None):
    """Reduce a (B, T) per-token loss to a scalar.

    token-mean:               sum over all tokens / number of tokens (DAPO; ReMax code).
    seq-mean-token-mean:      mean over sequences of each sequence's token mean (GRPO paper).
    seq-mean-token-sum-norm:  mean over sequences of (token sum / max_len), max_len a constant
                              (Dr. GRPO: no per-sequence length normalisation). Default T.
    """
    # BEGIN SOLUTION
    if mode == "token-mean":
        return masked_sum(per_token_loss, mask) / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token_loss, mask, dim=1).mean()
    if mode == "seq-mean-token-sum-norm":
        max_len = per_token_loss.shape[1] if max_len is None else max_len
        return (masked_sum(per_token_loss, mask, dim=1) / max_len).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGG_MODES}")
    # END SOLUTION


def reward_to_go(x, mask):
    """Per-token sum over t' >= t of x[t'] (masked), i.e. the return with gamma = 1."""
    # BEGIN SOLUTION
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])
    # END SOLUTION


# ----------------------------------------------------------------------------------------
# Log-probs and generation
# ----------------------------------------------------------------------------------------
def position_ids_from_mask(attention_mask):
    """Positions that skip left padding, the same ones `generate` uses."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, with_entropy=False):
    """Log-probs of the last `num_completion_tokens` tokens of `input_ids` under `model`,
    at the sampling temperature, computed in fp32. Returns (B, C) log-probs (and entropies).

    Only the completion's logits are computed (`logits_to_keep`), and the log-softmax is
    taken one sequence at a time as gather - logsumexp, so no full (B, T, V) log-softmax
    copy is ever materialised.
    """
    c = num_completion_tokens
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), logits_to_keep=c + 1, use_cache=False)
    logits = out.logits[:, -(c + 1):-1, :]  # (B, C, V): position t predicts token t+1
    targets = input_ids[:, -c:]
    logps, entropies = [], []
    for row_logits, row_targets in zip(logits, targets):
        row = row_logits.float() / temperature
        lse = torch.logsumexp(row, dim=-1)
        logps.append(row.gather(-1, row_targets[:, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                entropies.append(lse - (torch.softmax(row, -1) * row).sum(-1))
    logps = torch.stack(logps)
    return (logps, torch.stack(entropies)) if with_entropy else logps


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1, greedy=False):
    """Sample `num_samples` completions per prompt (or one greedy completion).
    Prompts are left-padded; returns completion ids (B * num_samples, C), padded after EOS.
    Works for a bare, DDP-wrapped (pass accelerator.unwrap_model) or peft model."""
    from transformers import GenerationConfig

    if greedy:
        gen = GenerationConfig(do_sample=False, max_new_tokens=cfg.max_new_tokens)
        num_samples = 1
    else:
        gen = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                               max_new_tokens=cfg.max_new_tokens, num_return_sequences=num_samples)
    gen.pad_token_id, gen.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    with gathered_parameters(model):
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen)
    model.train(was_training)
    completion_ids = out[:, prompt_ids.shape[1]:]
    if completion_ids.shape[1] == 0:  # cannot happen with max_new_tokens >= 1; keep shapes sane
        completion_ids = torch.full_like(prompt_ids[:, :1], tokenizer.eos_token_id)
    return completion_ids


def gathered_parameters(model):
    """Under DeepSpeed ZeRO-3 each rank holds a shard of every weight; generating token by
    token from shards gathers them at every step (10-100x slower). Gather once for the whole
    generate call instead. A no-op without ZeRO-3."""
    sharded = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not sharded:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(sharded)


def tokenize_prompts(tokenizer, prompts, device):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def decode_completions(tokenizer, completion_ids, mask):
    return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]


# ----------------------------------------------------------------------------------------
# The built-in task: arithmetic in families of different difficulty
# ----------------------------------------------------------------------------------------
# name: (operand digit counts, operator). Easy to hard for a 1M-parameter model.
FAMILIES = {
    "add_2x1": ((2, 1), "+"),
    "sub_2x2": ((2, 2), "-"),
    "add_2x2": ((2, 2), "+"),
    "mul_2x1": ((2, 1), "*"),
    "add_3x3": ((3, 3), "+"),
}
# reward for (wrong, right) per family under --reward_scales hetero: one offset and scale per
# family, as a learned reward model puts different prompt kinds on different scales.
# Same gap (1) between right and wrong everywhere, offsets from -5 to +5: a baseline removes the
# offsets exactly; plain REINFORCE pushes up whatever it samples on the positive families and
# down on the negative ones. All within ReMax's advantage clip of 5.
HETERO_SCALES = {"add_2x1": (4.0, 5.0), "sub_2x2": (-5.0, -4.0), "add_2x2": (2.0, 3.0), "mul_2x1": (-3.0, -2.0), "add_3x3": (0.0, 1.0)}
HELD_OUT_FRACTION = 5  # one prompt in 5 (by hash) is held out: never trained on


def is_held_out(prompt):
    return int(hashlib.md5(prompt.encode()).hexdigest(), 16) % HELD_OUT_FRACTION == 0


def arithmetic_example(family, rng):
    (da, db), op = FAMILIES[family]
    a = rng.randint(10 ** (da - 1) if da > 1 else 0, 10 ** da - 1)
    b = rng.randint(10 ** (db - 1) if db > 1 else 0, 10 ** db - 1)
    if op == "-" and b > a:
        a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(answer), "family": family}


def arithmetic_examples(n, seed, held_out):
    """n examples, families in turn, all from the held-out split or all from the train split."""
    rng, examples, families = random.Random(seed), [], list(FAMILIES)
    while len(examples) < n:
        ex = arithmetic_example(families[len(examples) % len(families)], rng)
        if is_held_out(ex["prompt"]) == held_out:
            examples.append(ex)
    return examples


# ----------------------------------------------------------------------------------------
# Real data (GSM8K or a local file) and the math reward
# ----------------------------------------------------------------------------------------
NUMBER = r"-?[\d,]*\.?\d+"


def normalize_number(text):
    """'1,234.50' -> '1234.5'; exact string comparison after this."""
    text = text.replace(",", "").strip()
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def extract_final_number(text):
    """The final answer of a math completion: after '####', else in \\boxed{}, else the last
    number; None if there is no number."""
    for pattern in (r"####\s*(" + NUMBER + ")", r"\\boxed\{\s*(" + NUMBER + r")\s*\}", "(" + NUMBER + ")"):
        found = re.findall(pattern, text)
        if found:
            return normalize_number(found[-1] if pattern != r"####\s*(" + NUMBER + ")" else found[0])
    return None


def load_task(cfg, tokenizer=None):
    """(train examples, held-out eval examples). Every example: prompt (as fed to the policy),
    raw_prompt, answer, family, check ('exact' for arithmetic, 'number' for math data)."""
    if cfg.dataset == "arithmetic":
        return arithmetic_examples(20_000, seed=cfg.seed, held_out=False), arithmetic_examples(250, seed=1234, held_out=True)
    import datasets

    try:
        if cfg.dataset == "gsm8k":
            splits = datasets.load_dataset("openai/gsm8k", "main")
            train_rows, eval_rows = splits["train"], splits["test"].select(range(min(cfg.eval_size, len(splits["test"]))))
        else:
            kind = "parquet" if cfg.dataset.endswith(".parquet") else "json"
            rows = datasets.load_dataset(kind, data_files=cfg.dataset, split="train")
            if len(rows) < 2:
                raise SystemExit(f"error: --dataset {cfg.dataset!r} has {len(rows)} rows; need at least 2 (train and eval).")
            n_eval = min(cfg.eval_size, len(rows) // 2)
            train_rows, eval_rows = rows.select(range(len(rows) - n_eval)), rows.select(range(len(rows) - n_eval, len(rows)))
    except (ConnectionError, OSError) as e:
        raise SystemExit(f"error: --dataset {cfg.dataset!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}). "
                         "Offline? Download it first, or pass a local .jsonl file.")
    columns = [c for c in (cfg.prompt_column, cfg.answer_column) if c]
    missing = [c for c in columns if c not in train_rows.column_names]
    if missing:
        flags = " / ".join(f"--{'prompt' if c == cfg.prompt_column else 'answer'}_column {c!r}" for c in missing)
        raise SystemExit(f"error: --dataset {cfg.dataset!r} has no column {flags}; its columns are {train_rows.column_names}.")
    return [math_examples(rows, cfg, tokenizer, split) for rows, split in ((train_rows, "train"), (eval_rows, "eval"))]


def math_examples(rows, cfg, tokenizer, split):
    examples, too_long = [], 0
    for row in rows:
        question = str(row[cfg.prompt_column] or "").strip()
        if not question:
            continue
        prompt = question
        if cfg.use_chat_template and tokenizer is not None and tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        if tokenizer is not None and len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > cfg.max_prompt_length:
            too_long += 1
            continue
        answer = extract_final_number(str(row[cfg.answer_column])) if cfg.answer_column else None
        examples.append({"prompt": prompt, "raw_prompt": question, "answer": answer, "family": "all", "check": "number"})
    if too_long:
        print(f"warning: dropped {too_long} {split} prompts longer than --max_prompt_length {cfg.max_prompt_length} tokens", flush=True)
    if not examples:
        raise SystemExit(f"error: no usable {split} prompts in --dataset {cfg.dataset!r} (empty prompts, or all longer than --max_prompt_length).")
    return examples


def is_correct(completion, answer, check="exact"):
    if answer is None:
        return False
    if check == "number":
        return extract_final_number(completion) == answer
    return completion.strip() == answer


def compute_rewards(examples, completions, reward_scales="uniform"):
    """Rule-based reward. Returns (rewards, correct) as float tensors (B,)."""
    correct = torch.tensor([float(is_correct(c, ex["answer"], ex.get("check", "exact"))) for c, ex in zip(completions, examples)])
    if reward_scales == "uniform":
        return correct.clone(), correct
    lo_hi = torch.tensor([HETERO_SCALES.get(ex["family"], (0.0, 1.0)) for ex in examples])
    return lo_hi[:, 0] + (lo_hi[:, 1] - lo_hi[:, 0]) * correct, correct


class RewardModel:
    """Scores (prompt, completion) with an AutoModelForSequenceClassification, its own
    tokenizer and chat template; frozen, no grad, optionally in its own dtype."""

    def __init__(self, name, dtype, device):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_model_path(name, flag="--reward_model")
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(name, dtype=DTYPES[dtype]).to(device).eval().requires_grad_(False)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device

    @torch.no_grad()
    def __call__(self, prompts, completions):
        if self.tokenizer.chat_template:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, add_special_tokens=not self.tokenizer.chat_template)
        return self.model(**enc.to(self.device)).logits[:, 0].float()


def make_reward_fn(cfg, device):
    """reward_fn(examples, completions) -> (rewards, correct) on `device`. Rule reward, a reward
    model, or a weighted sum of both. A non-finite reward stops before any update."""
    reward_model = RewardModel(cfg.reward_model, cfg.reward_model_dtype, device) if cfg.reward_model else None

    def reward_fn(examples, completions):
        try:
            rewards, correct = compute_rewards(examples, completions, cfg.reward_scales)
            rewards, correct = cfg.rule_reward_weight * rewards.to(device), correct.to(device)
            if reward_model is not None:
                scores = reward_model([ex.get("raw_prompt", ex["prompt"]) for ex in examples], completions)
                rewards = rewards + cfg.reward_model_weight * scores
        except Exception as e:  # a reward that raises: say on what, and apply nothing
            raise SystemExit(f"error: the reward raised {type(e).__name__}: {e} (first prompt {examples[0]['prompt'][:200]!r}, "
                             f"completion {completions[0][:200]!r}); step not applied.") from e
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise SystemExit(f"error: non-finite reward {rewards[i].item()} for prompt {examples[i]['prompt'][:200]!r} and completion "
                                     f"{completions[i][:200]!r}; step not applied. Check the reward function / --reward_model.")
        return rewards, correct

    return reward_fn


class PromptSampler:
    """Endless shuffled batches of examples; each rank draws from its own shard."""

    def __init__(self, examples, batch_size, seed, rank=0, world_size=1):
        self.examples, self.batch_size = examples[rank::world_size], batch_size
        self.rng, self.order = random.Random(seed), []

    def state_dict(self):
        return {"rng": repr(self.rng.getstate()), "order": self.order}

    def load_state_dict(self, state):
        self.rng.setstate(ast.literal_eval(state["rng"]))
        self.order = list(state["order"])

    def next(self):
        batch = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            batch.append(self.examples[self.order.pop()])
        return batch


@torch.no_grad()
def evaluate(model, tokenizer, examples, cfg, accelerator, batch_size=256):
    """Held-out greedy accuracy per family and overall, sharded over ranks and summed."""
    shard = examples[accelerator.process_index::accelerator.num_processes]
    families = sorted({ex["family"] for ex in examples})
    counts = torch.zeros(2, len(families), device=accelerator.device)  # (correct, total)
    unwrapped = accelerator.unwrap_model(model)
    for i in range(0, len(shard), batch_size):
        batch = shard[i:i + batch_size]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [ex["prompt"] for ex in batch], accelerator.device)
        completion_ids = generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg, greedy=True)
        texts = decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, tokenizer.eos_token_id))
        for text, ex in zip(texts, batch):
            j = families.index(ex["family"])
            counts[0, j] += is_correct(text, ex["answer"], ex.get("check", "exact"))
            counts[1, j] += 1
    counts = accelerator.reduce(counts, reduction="sum")
    metrics = {"eval/accuracy": (counts[0].sum() / counts[1].sum()).item()}
    for j, fam in enumerate(families):
        metrics[f"eval/acc_{fam}"] = (counts[0, j] / counts[1, j].clamp(min=1)).item()
    return metrics


# ----------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------
def disable_dropout(model):
    """Log-probs must be computed with dropout off (ALGORITHMS.md §4)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key, value in vars(model.config).items():
        if "dropout" in key and isinstance(value, float):
            setattr(model.config, key, 0.0)


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    check_model_path(cfg.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg, trainable=True):
    """A causal LM from a Hub name or local folder, dropout off, in --torch_dtype; with
    --lora_r the trainable model gets a LoRA adapter; frozen (eval, no grad) if not trainable."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=DTYPES[cfg.torch_dtype])
    disable_dropout(model)
    if not trainable:
        return model.eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets = cfg.lora_target_modules if cfg.lora_target_modules == "all-linear" else cfg.lora_target_modules.split(",")
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets, task_type="CAUSAL_LM"))
    return model.train()  # dropout is off; train mode only lets gradient checkpointing act


class AdapterDisabled(torch.nn.Module):
    """The LoRA policy with its adapter switched off: the reference model at no memory cost."""

    def __init__(self, peft_model):
        super().__init__()
        self.peft_model = [peft_model]  # a list, so the policy's weights are not registered twice

    def forward(self, **kwargs):
        with self.peft_model[0].disable_adapter():
            return self.peft_model[0](**kwargs)


def load_reference(cfg, policy):
    """The frozen reference pi_ref: the policy's adapter disabled under LoRA, else a copy.
    Call before accelerator.prepare(policy)."""
    return AdapterDisabled(policy).eval() if cfg.lora_r > 0 else load_model(cfg, trainable=False)


def check_model_path(name, flag="--model_name_or_path"):
    """Fail fast, before anything is loaded, when the model can be found nowhere."""
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise SystemExit(f"error: {flag} {name!r} is a folder without config.json (not a saved HF model).")
        return
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path:
        raise SystemExit(f"error: {flag} {name!r}: no such folder.")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    if not isinstance(cached, str) and offline:
        raise SystemExit(f"error: {flag} {name!r} is not a local folder and not in the HF cache, "
                         "and HF_HUB_OFFLINE is set: download it first or pass a local folder.")


def make_optimizer(model, cfg):
    from transformers import get_constant_schedule_with_warmup

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, weight_decay=0.0)
    return optimizer, get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps)


# ----------------------------------------------------------------------------------------
# Logging and plots
# ----------------------------------------------------------------------------------------
class StepTimer:
    """Wall time of each phase of a step: `with timer("generation"): ...`; metrics() gives
    time/<phase>_s and resets. On a GPU it synchronises so the time is the GPU's too."""

    def __init__(self):
        self.times = {}

    @contextmanager
    def __call__(self, phase):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self):
        out, self.times = {f"time/{k}_s": v for k, v in self.times.items()}, {}
        out["time/step_s"] = sum(out.values())
        return out


def reduce_metrics(accelerator, metrics):
    """Mean of every scalar metric across ranks."""
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist()))


class Checkpointer:
    """Resumable checkpoints: output_dir/checkpoint-N holds accelerate's state (every prepared
    model, optimizer and scheduler, and every rank's RNG states), each rank's prompt-sampler
    state, the step counter, and the policy as save_pretrained (+ tokenizer) so that
    `from_pretrained(checkpoint-N/model)` loads it. Ctrl-C or SIGTERM saves, then stops.

        ckpt = Checkpointer(cfg, accelerator, sampler)
        start = ckpt.resume()                    # 0, or the step of --resume_from
        for step in range(start + 1, ...):
            ...
            if ckpt.step_end(step, policy, tokenizer):   # saves every --save_steps
                break                                    # a signal arrived: saved, stop
    """

    def __init__(self, cfg, accelerator, sampler):
        self.cfg, self.accelerator, self.sampler = cfg, accelerator, sampler
        self.stop_requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request_stop)

    def _request_stop(self, signum, frame):
        if self.stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop_requested = True
        print(f"\nsignal {signum}: saving a checkpoint at the end of this step (Ctrl-C again to quit now)", flush=True)

    def resume(self):
        if not self.cfg.resume_from:
            return 0
        self.accelerator.load_state(self.cfg.resume_from)
        with open(os.path.join(self.cfg.resume_from, f"sampler_rank{self.accelerator.process_index}.json")) as f:
            self.sampler.load_state_dict(json.load(f))
        with open(os.path.join(self.cfg.resume_from, "trainer_state.json")) as f:
            step = json.load(f)["step"]
        if self.accelerator.is_main_process:
            print(f"resumed from {self.cfg.resume_from} at step {step}", flush=True)
        return step

    def save(self, step, policy, tokenizer):
        path = os.path.join(self.cfg.output_dir, f"checkpoint-{step}")
        self.accelerator.save_state(path)
        with open(os.path.join(path, f"sampler_rank{self.accelerator.process_index}.json"), "w") as f:
            json.dump(self.sampler.state_dict(), f)
        save_model(self.accelerator, policy, tokenizer, os.path.join(path, "model"))
        if self.accelerator.is_main_process:
            with open(os.path.join(path, "trainer_state.json"), "w") as f:
                json.dump({"step": step, "config": asdict(self.cfg)}, f, indent=2)
        self.accelerator.wait_for_everyone()
        return path

    def check_finite(self, step, loss, grad_norm, policy, tokenizer):
        """Call between clipping and optimizer.step(): a NaN/inf loss or gradient norm saves the
        last good state (the weights before this update) and stops the run with a message."""
        if torch.isfinite(loss.detach()).all() and torch.isfinite(torch.as_tensor(grad_norm)).all():
            return
        path = self.save(step - 1, policy, tokenizer)
        raise SystemExit(f"error: non-finite loss ({loss.item()}) or gradient norm ({float(grad_norm)}) at step {step}; "
                         f"the update was not applied and the last good state is in {path}. Lower --learning_rate, "
                         "keep --max_grad_norm on, or check the rewards.")

    def step_end(self, step, policy, tokenizer):
        """Save when due or when a signal arrived (on any rank); True means stop now."""
        stop = torch.tensor([float(self.stop_requested)], device=self.accelerator.device)
        stop = self.accelerator.reduce(stop, reduction="sum").item() > 0
        if stop or (self.cfg.save_steps and step % self.cfg.save_steps == 0):
            path = self.save(step, policy, tokenizer)
            if self.accelerator.is_main_process:
                print(f"checkpoint: {path}", flush=True)
        return stop


class MetricLogger:
    """Every step to output_dir/metrics.jsonl (+ tensorboard/wandb); a console line every
    log_every steps. Only the main process writes."""

    def __init__(self, cfg, accelerator, start_step=0):
        self.cfg, self.accelerator = cfg, accelerator
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.start = time.time()
        if accelerator.is_main_process:
            os.makedirs(cfg.output_dir, exist_ok=True)
            kept = [r for r in read_metrics(self.path) if r["step"] <= start_step] if start_step and os.path.exists(self.path) else []
            with open(self.path, "w") as f:  # a resumed run keeps the rows up to its checkpoint
                f.writelines(json.dumps(r) + "\n" for r in kept)
            with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
                json.dump(asdict(cfg), f, indent=2)
        if cfg.report_to != "none":
            accelerator.init_trackers(os.path.basename(cfg.output_dir.rstrip("/")) or "run", config=asdict(cfg))

    def log(self, step, metrics):
        metrics = {"step": step, "time/elapsed_s": round(time.time() - self.start, 3), **metrics}
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.report_to != "none":
            self.accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        if step % self.cfg.log_every == 0 or step == self.cfg.num_steps or "eval/accuracy" in metrics:
            shown = {k: v for k, v in metrics.items() if k in CONSOLE_KEYS or k == "eval/accuracy"}
            print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()), flush=True)

    def finish(self, model):
        """Write summary.json (held-out accuracy before/after, wall time, a weight checksum per
        rank: data-parallel replicas must agree) and curves.png."""
        checksum = torch.tensor([sum(p.detach().double().sum() + p.detach().double().abs().sum() for p in model.parameters())],
                                device=self.accelerator.device)
        checksums = self.accelerator.gather(checksum).tolist()
        if self.cfg.report_to != "none":
            self.accelerator.end_training()
        if not self.accelerator.is_main_process:
            return
        evals = [r for r in read_metrics(self.path) if "eval/accuracy" in r]
        summary = {"eval_accuracy_before": evals[0]["eval/accuracy"] if evals else None,
                   "eval_accuracy_after": evals[-1]["eval/accuracy"] if evals else None,
                   "wall_time_s": round(time.time() - self.start, 1), "num_processes": self.accelerator.num_processes,
                   "replica_weight_checksums": checksums}
        with open(os.path.join(self.cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_metrics(self.path, os.path.join(self.cfg.output_dir, "curves.png"))
        print(f"held-out accuracy {summary['eval_accuracy_before']:.3f} -> {summary['eval_accuracy_after']:.3f} "
              f"in {summary['wall_time_s']:.0f}s; metrics, curves.png and summary.json in {self.cfg.output_dir}", flush=True)


def save_model(accelerator, model, tokenizer, path, merge_lora=False):
    """save_pretrained the (unwrapped) model and its tokenizer, from the main process only.
    A LoRA model saves its adapter, or with merge_lora the merged full weights."""
    accelerator.wait_for_everyone()
    deepspeed = accelerator.state.deepspeed_plugin is not None
    state_dict = accelerator.get_state_dict(model) if deepspeed else None  # gathers ZeRO-3 shards (all ranks)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if merge_lora and hasattr(unwrapped, "merge_and_unload"):
            unwrapped.merge_and_unload().save_pretrained(path)
        else:
            unwrapped.save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)


CONSOLE_KEYS = ("step", "train/reward", "train/kl", "train/entropy", "train/grad_norm", "time/elapsed_s")
PLOT_KEYS = ("train/reward", "eval/accuracy", "train/kl", "train/entropy", "train/grad_norm", "train/completion_len")


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(jsonl_path, png_path, keys=PLOT_KEYS):
    """One panel per metric versus step, from a metrics.jsonl file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    fig, axes = plt.subplots(2, math.ceil(len(keys) / 2), figsize=(4 * math.ceil(len(keys) / 2), 6))
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
