"""The models: the tokenizer, the policy (full or LoRA), the frozen reference, the optimizer, saving with
save_pretrained; and the fast log-probs and generation the loops run them with (a group's prompt run once for its
rows, a chunked log-softmax, a decode loop the ended rows leave, ZeRO-3's weights gathered once per generate call),
which have the signatures and results of their spec, `common.token_logprobs` and `common.generate`: read the spec
(tests/test_fast.py proves them equal in values, gradients and draws). The lab's sampler (a lower precision or stale
copy: lab/sampling.py) and what it keeps of each step (the draws' log-probs, the processed scores, routing, fixed
shapes on a GPU: lab/decode.py) are the lab's, built on these pieces."""
import copy
import os
import sys
import types
import warnings
from contextlib import contextmanager

import torch

import common
from support import config


def disable_dropout(model):
    """Log-probs must be computed with dropout off."""
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


def check_prompts_tokenize(tokenizer, examples, cfg, say=True, checked=2000):
    """Before any model loads: one error line when a prompt encodes to no token (a folder without the tokenizer's
    files gives transformers' empty tokenizer, which encodes everything to nothing), and (say: on one process) one
    warning when prompts lose characters to the tokenizer (the embedded model's drops what it does not know:
    'Tom has 16 eggs' reads '16'). The first `checked` examples."""
    lossy = []
    for ex in examples[:checked]:
        ids = tokenizer(ex["prompt"], add_special_tokens=False).input_ids
        if not ids:
            raise SystemExit(f"error: --model_name_or_path {cfg.model_name_or_path!r}: its tokenizer encodes the "
                             f"prompt {ex['prompt'][:60]!r} to no token. Does the folder hold the tokenizer's files "
                             "(tokenizer.json or vocab.json and merges.txt, tokenizer_config.json)? Else the "
                             "prompt's characters are none the tokenizer knows: give a model whose tokenizer reads "
                             "--dataset.")
        if "".join(tokenizer.decode(ids).split()) != "".join(ex["prompt"].split()):
            lossy.append(ex["prompt"])
    if lossy and say:
        ids = tokenizer(lossy[0], add_special_tokens=False).input_ids
        print(f"warning: {len(lossy)} of {min(len(examples), checked)} prompts lose characters to the tokenizer of "
              f"--model_name_or_path {cfg.model_name_or_path!r} (e.g. {lossy[0][:60]!r} reads "
              f"{tokenizer.decode(ids)[:60]!r}): the policy never sees them. The embedded model's tokenizer knows "
              "the arithmetic task's characters alone (docs/embedded_model.md); give a model whose tokenizer reads "
              "--dataset.", file=sys.stderr,
              flush=True)


def check_same_tokenizer(student, teacher):
    """Distillation compares the two models' log-probs of the same token ids: --teacher must share the student's
    vocabulary (the same id for every token, the same EOS). Reads the two tokenizers only."""
    check_model_path(teacher, "--teacher")
    a, b = (load_tokenizer(types.SimpleNamespace(model_name_or_path=path)) for path in (student, teacher))
    config.check(a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id, f"--teacher {teacher!r} has "
                 f"another tokenizer than the student {student!r}: distillation needs the same token ids; give a "
                 "teacher of its family.")


def load_model(cfg, trainable=True):
    """A causal LM from a Hub name or local folder, dropout off, in --torch_dtype; with
    --lora_r the trainable model gets a LoRA adapter; frozen (eval, no grad) if not trainable."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=getattr(torch, cfg.torch_dtype))
    disable_dropout(model)
    zero3_moe_leaves(model)
    if not trainable:
        return model.eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora_r > 0:
        model = add_lora(model, lora_config(cfg, "CAUSAL_LM"))
    return model.train()  # dropout is off; train mode only lets gradient checkpointing act


def zero3_moe_leaves(model):
    """Under DeepSpeed ZeRO-3, each mixture-of-experts block is made one leaf of its weight gathering: its experts
    are fetched together and their gradients reduced once. (A block runs each expert's weights once per routed
    group of tokens, and ZeRO-3's per-weight hooks would reduce a gradient twice.)"""
    from transformers.integrations import is_deepspeed_zero3_enabled

    routers = {id(m) for m in model.modules() if type(m).__name__.endswith("TopKRouter")}  # as lab/routing.py's
    blocks = {type(m) for m in model.modules() if any(id(c) in routers for c in m.children())}
    if blocks and is_deepspeed_zero3_enabled():
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, list(blocks))


def add_lora(model, lora):
    """The model with a LoRA adapter (peft). peft 0.21 calls transformers' deprecated is_gradient_checkpointing:
    its FutureWarning is the libraries', not a call of ours, and is kept out of the run's output."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora)


def lora_config(cfg, task_type):
    """The LoRA adapter of --lora_r, --lora_alpha and --lora_target_modules. task_type SEQ_CLS (the
    PPO critic) also trains the classification head `score` in full."""
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    targets = targets if targets == "all-linear" else targets.split(",")
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets, task_type=task_type)


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


def prepare_frozen(accelerator, model):
    """A frozen model (the reference, the reward model) on the device, run in the policy's precision:
    with the same weights both compute the same log-probs, so the KL to the reference starts at
    exactly 0. Call after accelerator.prepare(policy, ...). Without DeepSpeed: the device and the
    mixed-precision autocast of accelerate. Under DeepSpeed: an evaluation engine
    (no optimizer) from the policy's config, so it gets the policy's bf16/fp16 weights, and under
    ZeRO-3 its shards and hooks: a model loaded under ZeRO-3 is a set of empty shards until an
    engine gathers them at each forward. The LoRA reference (the policy's own weights) is returned
    as it is. None stays None."""
    plugin = accelerator.state.deepspeed_plugin
    if model is None or plugin is not None and isinstance(model, AdapterDisabled):
        return model
    if plugin is None:
        return accelerator.prepare_model(model, evaluation_mode=True)
    import deepspeed

    ds_config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        ds_config.pop(key, None)
    if ds_config["zero_optimization"]["stage"] != 3:
        ds_config["zero_optimization"] = {"stage": 0}  # nothing to shard without gradients and optimizer state
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()  # DeepSpeedEngine.eval() returns None, not the engine
    return engine


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
    if not isinstance(cached, str):  # one short request, rather than a minute of the loaders' retries
        from huggingface_hub import HfApi

        try:
            HfApi().model_info(name, timeout=10)
        except Exception as e:
            kinds = {c.__name__ for c in type(e).__mro__}
            if kinds & {"TransportError", "ConnectionError", "Timeout", "TimeoutException", "TimeoutError"}:
                raise SystemExit(f"error: {flag} {name!r} is not a local folder and not in the HF cache, and the Hub "
                                 f"cannot be reached ({type(e).__name__}): connect, download it first (hf download "
                                 f"{name}), or pass a local folder.") from None
            if "RepositoryNotFoundError" in kinds:
                raise SystemExit(f"error: {flag} {name!r}: no such model on the Hub (or a private one: log in with "
                                 "hf auth login), and not a local folder.") from None


def make_optimizer(model, cfg, learning_rate=None):
    """AdamW over the trainable weights at learning_rate (--learning_rate unless given), without weight
    decay, and the constant schedule after --warmup_steps."""
    from transformers import get_constant_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel for every tensor's update (the same AdamW; on CPU 2.7x faster than the default loop)
    lr = cfg.learning_rate if learning_rate is None else learning_rate
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    return optimizer, get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps)


def sharding(model):
    """What this process holds of the prepared model, in elements: the weights (all of them, or
    its ZeRO-3 shard) and the optimizer's fp32 master weights (its ZeRO-1/2/3 partition), beside
    the model's size. Without DeepSpeed every process holds everything."""
    params = list(model.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    optimizer = getattr(model, "optimizer", None)  # a DeepSpeed engine's ZeRO optimizer
    partitions = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(optimizer, "fp32_partitioned_groups_flat", None)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
    optimizer_local = sum(t.numel() for t in partitions) if partitions else trainable
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else 0
    return {"zero_stage": stage, "params": full, "params_local": local, "trainable": trainable,
            "optimizer_local": optimizer_local}


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


@contextmanager
def gathered_parameters(model):
    """Under DeepSpeed ZeRO-3 each rank holds a shard of every weight, and hooks on every module
    gather a module's weights before its forward and release them after: generating token by
    token would gather the whole model once per token (10-100x slower). Gather it once for the
    whole generate call instead, with DeepSpeed's hooks taken off (else the release hooks free
    the gathered weights again after each token, for models beyond DeepSpeed's reuse window)
    and put back after, the same ones in the same order. A no-op without ZeRO-3."""
    sharded = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not sharded:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(sharded):
        for p in sharded:
            p.ds_active_sub_modules.clear()  # no module holds them now: the exit may release them
        saved = []
        for module in model.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                saved.append((hooks, dict(hooks)))
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__module__", "").startswith("deepspeed."):
                        del hooks[key]
        try:
            yield
        finally:
            for hooks, original in saved:  # in place: the hooks' handles point at these dicts
                hooks.clear()
                hooks.update(original)


# ---- running the models: the fast log-probs and generation ----
LOGPROB_CHUNK_ELEMENTS = 2 ** 24  # (C, V) logits' rows token_logprobs takes at once: 64 MiB of fp32, any vocabulary


def shared_prompt_cache(model, prompt_ids, prompt_mask, rows):
    """The keys and values of each prompt's tokens but its last, computed once per prompt, then copied
    to every row that continues it: row i of the cache is prompt rows[i]'s. The last prompt token and
    what follows it then run row by row. Scoring a group's rows and sampling a prompt's K completions
    both share their prompt this way."""
    position_ids = common.position_ids_from_mask(prompt_mask)
    cache = model(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
                  position_ids=position_ids[:, :-1], logits_to_keep=1, use_cache=True).cache
    cache.reorder_cache(rows)
    return cache


def completion_logits(model, input_ids, attention_mask, num_completion_tokens):
    """The (B, C, V) logits that predict the last C tokens of each row (position t predicts t + 1).

    Adjacent rows with the same prompt (a group of samples) share the prompt's forward pass: it runs once per group
    and keeps its keys and values, each row gets its group's copy of them, and only the last prompt token and the
    completion run row by row. Values and gradients are those of one pass over every full row (the copies' gradients
    add up in the prompt's pass), for about 1 / G of the prompts' work. Rows that share nothing take the same two
    passes at no extra cost, so the number of forward calls never depends on the data (under ZeRO-3 each is a
    collective every rank must make). When `shares_prompt` says no, it is the one pass.
    """
    c = num_completion_tokens
    position_ids = common.position_ids_from_mask(attention_mask)
    if not shares_prompt(model, input_ids, c):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=c + 1, use_cache=False)
        return out.logits[:, -(c + 1):-1, :]
    first, group = prompt_groups(input_ids, attention_mask, c)
    cache = shared_prompt_cache(model, input_ids[first, :-c], attention_mask[first, :-c], group)
    out = model(input_ids=input_ids[:, -c - 1:-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, -c - 1:-1], cache=cache, logits_to_keep=c, use_cache=True)
    return out.logits


def shares_prompt(model, input_ids, num_completion_tokens):
    """Whether `completion_logits` runs each group's prompt once: when the rows hold a prompt token before the last,
    and, with gradients, no layer is checkpointed (it keeps no cache) and no mixture-of-experts block is a leaf of
    ZeRO-3's gathering (`zero3_moe_leaves`: its gradient is reduced once per forward). Else one pass."""
    one_pass = torch.is_grad_enabled() and any(getattr(module, "gradient_checkpointing", False) or
                                               getattr(module, "_z3_leaf", False) for module in model.modules())
    return input_ids.shape[1] >= num_completion_tokens + 2 and not one_pass


def prompt_groups(input_ids, attention_mask, num_completion_tokens):
    """(first, group): the first row of each group of adjacent rows with the same prompt (the ids and mask before
    the last C columns), and each row's group."""
    c = num_completion_tokens
    prompts = torch.cat([input_ids[:, :-c], attention_mask[:, :-c]], dim=1)
    _, group, counts = torch.unique_consecutive(prompts, dim=0, return_inverse=True, return_counts=True)
    return counts.cumsum(0) - counts, group


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, with_entropy=False,
                   top_k=0, top_p=1.0):
    """common.token_logprobs, computed from `completion_logits` (a group's prompt once) by `logprobs_from_logits`.
    Returns (B, C) fp32 log-probs (and entropies)."""
    c = num_completion_tokens
    logits = completion_logits(model, input_ids, attention_mask, c)  # (B, C, V)
    return logprobs_from_logits(logits, input_ids[:, -c:], temperature, with_entropy, top_k, top_p)


def logprobs_from_logits(logits, targets, temperature=1.0, with_entropy=False, top_k=0, top_p=1.0):
    """The (B, C) fp32 log-probs of `targets` (B, C) under their (B, C, V) logits, as common.token_logprobs takes
    them (and their entropies), a chunk of rows at a time: LOGPROB_CHUNK_ELEMENTS bounds each chunk, and no
    (B, C, V) log-softmax copy is made."""
    rows = max(1, LOGPROB_CHUNK_ELEMENTS // (targets.shape[1] * logits.shape[-1]))
    logps, entropies = [], []
    for start in range(0, len(logits), rows):
        chunk = logits[start:start + rows].float() / temperature  # (rows, C, V)
        chunk_targets = targets[start:start + rows, :, None]
        if top_k > 0 or top_p < 1.0:
            # the sampled token stays in: a rounding difference from generate() must not give log 0
            kept = common.sampling_mask(chunk.detach(), top_k, top_p).isfinite()
            kept.scatter_(-1, chunk_targets, True)
            chunk = chunk.masked_fill(~kept, float("-inf"))
        lse = torch.logsumexp(chunk, dim=-1)
        logps.append(chunk.gather(-1, chunk_targets).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(chunk, -1)
                entropies.append(lse - (probs * chunk.masked_fill(probs == 0, 0)).sum(-1))
    logps = torch.cat(logps)
    return (logps, torch.cat(entropies)) if with_entropy else logps


def decode(model, input_ids, attention_mask, cache, gen):
    """The steps of transformers' generate (its `_sample`) for a GenerationConfig `gen` of common.generation_config:
    the last position's fp32 logits, EOS held back for gen.min_new_tokens, temperature, top-k, top-p
    (common.sampling_mask), one multinomial draw per row (greedy: argmax), until every row has emitted EOS or
    max_new_tokens. `cache` holds every prompt token but the last (None: the whole prompt runs first).
    A row that emitted EOS leaves the batch, its keys and values with it. Its draw is still made, from a
    placeholder distribution, and discarded: the random stream, and so every other row's draw, is generate's.
    Returns (B, C) completion ids, padded after EOS."""
    position_ids = common.position_ids_from_mask(attention_mask)
    tokens = torch.full((len(input_ids), gen.max_new_tokens), gen.pad_token_id, dtype=input_ids.dtype,
                        device=input_ids.device)
    rows = torch.arange(len(input_ids), device=input_ids.device)  # the rows still going
    inputs, positions = (input_ids[:, -1:], position_ids[:, -1:]) if cache is not None else (input_ids, position_ids)
    for t in range(gen.max_new_tokens):
        out = model(input_ids=inputs, attention_mask=attention_mask, position_ids=positions, cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.cache
        token, _ = draw(out.logits[:, -1].float(), gen, t, rows, len(tokens))
        tokens[rows, t] = token
        going = token != gen.eos_token_id
        if not going.any():
            return tokens[:, :t + 1]
        if not going.all():  # the finished rows leave the batch
            keep = going.nonzero().squeeze(1)
            cache.reorder_cache(keep)
            rows, token, attention_mask, positions = rows[keep], token[keep], attention_mask[keep], positions[keep]
        inputs, positions = token[:, None], positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(attention_mask), 1)], dim=1)
    return tokens


def draw(logits, gen, t, rows, num_rows):
    """The tokens the rows still going (`rows`, of num_rows) draw at step t from their (n, V) fp32 logits, as
    transformers' generate draws them (EOS held back for gen.min_new_tokens, temperature, top-k, top-p; greedy:
    argmax), and the processed scores. The finished rows draw too, from a placeholder (their pad token), and their
    draws are discarded: the random stream, and so every other row's draw, is generate's."""
    if t < (gen.min_new_tokens or 0):
        logits[:, gen.eos_token_id] = float("-inf")
    if not gen.do_sample:
        return logits.argmax(dim=-1), logits
    logits = common.sampling_mask(logits / gen.temperature, gen.top_k or 0, gen.top_p)
    probs = torch.softmax(logits, dim=-1)
    if len(rows) < num_rows:
        placeholder = torch.zeros(num_rows, probs.shape[-1], device=probs.device)
        placeholder[:, gen.pad_token_id] = 1.0
        probs = placeholder.index_copy(0, rows, probs)
    return torch.multinomial(probs, num_samples=1).squeeze(1)[rows], logits


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1, greedy=False):
    """common.generate, with each prompt run once for its samples (`shared_prompt_cache`), which then
    continue it from copies of its keys and values in `decode`: the same draws as generate's own
    num_return_sequences, without K passes over the prompt and without the rows that have ended. Under
    ZeRO-3 the weights are gathered once for the whole call. Returns completion ids (B * num_samples, C),
    each prompt's samples adjacent."""
    num_samples = 1 if greedy else num_samples
    gen = common.generation_config(tokenizer, cfg, greedy)  # one sequence per row: the rows are the K copies
    n = max(1, cfg.generation_batch_size // num_samples) if cfg.generation_batch_size else len(prompt_ids)
    with common.sampling_mode(model), gathered_parameters(model):
        chunks = []
        for i in range(0, len(prompt_ids), n):
            ids, mask = prompt_ids[i:i + n], prompt_mask[i:i + n]
            rows = torch.arange(len(ids), device=ids.device).repeat_interleave(num_samples)  # K adjacent
            cache = shared_prompt_cache(model, ids, mask, rows) if ids.shape[1] > 1 else None
            chunks.append(decode(model, ids[rows], mask[rows], cache, gen))
    return common.pad_completions(chunks, tokenizer.pad_token_id)
