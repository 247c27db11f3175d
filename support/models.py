"""Models: the tokenizer, the policy (full or LoRA), the frozen reference, the optimizer, saving with
save_pretrained, and the ZeRO-3 weights gathered for generation. (The sampler's copy of the policy, in a lower
precision or stale, is the lab's: lab/sampling.py.)"""
import copy
import os
import sys
import warnings
from contextlib import contextmanager

import torch



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
