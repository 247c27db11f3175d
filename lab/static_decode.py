"""The decode loop the lab's loops sample with on a GPU: lab/decode.py's `decode` (the same signature, the same draws
from the same seed, proven equal to common.generate by tests/test_fast.py), in steps of fixed shapes.

On a GPU a decode step of a small model is bound by its kernel launches, not by its arithmetic: what saves work on
the CPU (rows that have ended leaving the batch, a cache that grows, a check for the end after every token) costs
more there than it saves. Here every step has the same shapes, so it can be captured once and replayed:

- a static key-value cache (transformers' `StaticCache`) of a fixed number of positions, rounded up to a multiple
  of CACHE_MULTIPLE so that batches whose prompts differ in width by a few tokens reuse one; one cache per
  (rows, positions, dtype, device) is kept with the model and reset by each call, so its buffers stay where the
  captured step reads them;
- a row that has emitted EOS stays in the batch, fed its pad token behind an attention mask of ones, as in
  transformers' own generate; its draw is made and discarded (so the random stream is generate's);
- no host synchronisation inside a step: the end (every row has emitted EOS) is checked every END_CHECK_EVERY
  steps; the steps run past it draw nothing that is kept, and the random generator is set back to where generate
  would have left it, so a later call draws what it would after generate;
- on CUDA the model's forward is compiled once by transformers' own `get_compiled_call` (torch.compile,
  mode="reduce-overhead": CUDA graphs), with the attention mask built outside it as transformers' generate builds
  it (`create_masks_for_generate`).

What transformers' `generate(cache_implementation="static")` does not give, and why this loop exists at all: the
log-prob of each drawn token under the exact distribution it was drawn from (after temperature, top-k and top-p),
kept as it is drawn (the behaviour policy of lab/async_sampling.py, without a scoring pass or every step's
(B, V) scores kept); and a group's prompt run once for its samples (`models.shared_prompt_cache`) rather than once
per sample. The rest (the cache, the compiled forward, the masks) is transformers'.

The first step (the last prompt token, on top of the shared prompt's keys and values) runs uncompiled and fills the
static cache by copying; the steps after it are the fixed-shape ones. Under mixed precision the sampler runs the
model as the learner does (accelerate's autocast wrapper, which `unwrap_model` keeps): its cache and its logits
are those of the forward the learner scores, and the drawn log-probs are kept from what was drawn.
"""
import weakref

import torch

import common

CACHE_MULTIPLE = 64  # static cache lengths are rounded up to this: fewer distinct shapes, so fewer compilations
END_CHECK_EVERY = 8  # steps between two checks for the end (a host synchronisation each)
_CACHES = weakref.WeakKeyDictionary()  # model -> {(rows, positions, dtype, device): StaticCache}


def multinomial_draw(probs):
    """(B,) one token per row of (B, V) probabilities, torch.multinomial(probs, 1)'s draw from the same random stream:
    torch draws one sample as argmax(p / q) with q ~ Exp(1) (the exponential race), after a check of the
    probabilities that reads them on the host. This is that draw without the check (the probabilities here come
    from a softmax)."""
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def draw(logits, gen, t, logprobs):
    """One token per row from (B, V) fp32 logits, as transformers' generate draws it for `gen` at step t (EOS held
    back for gen.min_new_tokens, temperature, top-k, top-p; greedy: argmax), the processed scores, and (logprobs)
    each drawn token's log-prob under them."""
    if t < (gen.min_new_tokens or 0):
        logits = logits.clone()
        logits[:, gen.eos_token_id] = float("-inf")
    if gen.do_sample:
        logits = common.sampling_mask(logits / gen.temperature, gen.top_k or 0, gen.top_p)
        token = multinomial_draw(torch.softmax(logits, dim=-1))
    else:
        token = logits.argmax(dim=-1)
    logp = logits.gather(1, token[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1) if logprobs else None
    return token, logits, logp


def static_cache(model, filled, length):
    """A StaticCache of `length` positions holding the keys and values of the DynamicCache `filled` at its first
    positions: the one kept for this model and shape, reset, or a new one."""
    from transformers import StaticCache

    keys = filled.layers[0].keys
    shape = (len(keys), length, keys.dtype, keys.device)
    caches = _CACHES.setdefault(model, {})
    if shape not in caches:
        caches[shape] = StaticCache(config=model.config, max_cache_len=length)
    cache = caches[shape]
    cache.reset()
    for i, layer in enumerate(filled.layers):
        cache.update(layer.keys, layer.values, i)
    return cache


def compiled_forward(model):
    """transformers' compiled forward (torch.compile with its CompileConfig: reduce-overhead, CUDA graphs), made once
    per model and kept by it; a peft model's base model, which holds the adapters."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf.get_compiled_call(None)


def generator_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_generator_state(device, state):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def decode(model, input_ids, attention_mask, cache, gen, scores=None, logprobs=False, compiled=None):
    """models.decode's draws, in steps of fixed shapes: (B, C) completion ids padded after EOS (logprobs: and the
    (B, C) log-probs of the drawn tokens under the processed scores they were drawn from, 0 after EOS). `cache`
    holds every prompt token but the last (None: the whole prompt runs first). `scores`, a list, receives
    (step, rows, processed scores) for every row, the ended ones included. compiled (None: on CUDA, but not under
    DeepSpeed ZeRO-3, whose weights are gathered anew, elsewhere, for each call): the steps after the first run
    transformers' compiled forward."""
    from transformers.masking_utils import create_masks_for_generate

    if compiled is None:
        compiled = input_ids.is_cuda and not any(hasattr(p, "ds_id") for p in model.parameters())
    b, c, device = len(input_ids), gen.max_new_tokens, input_ids.device
    length = -(-(input_ids.shape[1] + c - 1) // CACHE_MULTIPLE) * CACHE_MULTIPLE
    full_mask = torch.nn.functional.pad(attention_mask, (0, length - attention_mask.shape[1]), value=1)  # (B, L)
    positions = common.position_ids_from_mask(attention_mask)
    inputs, positions = (input_ids[:, -1:], positions[:, -1:]) if cache is not None else (input_ids, positions)
    tokens = torch.full((b, c), gen.pad_token_id, dtype=input_ids.dtype, device=device)
    drawn_logp = torch.zeros(tokens.shape, device=device)
    going = torch.ones(b, dtype=torch.bool, device=device)
    steps_going = torch.zeros(b, dtype=torch.long, device=device)  # each row's completion length so far
    first_score, states = len(scores) if scores is not None else 0, {}
    with torch.no_grad():
        # the first step: the last prompt token (or the whole prompt) on a growing cache, uncompiled
        out = model(input_ids=inputs, attention_mask=attention_mask, position_ids=positions, cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache = static_cache(model, out.cache, length)
        forward = compiled_forward(model) if compiled else model
        positions = positions[:, -1:]
        for t in range(c):
            if t > 0:  # a step of fixed shapes: (B, 1) token and position, a (B, L) mask, the (B, L) cache
                positions = positions + 1
                mask = create_masks_for_generate(config=model.config, attention_mask=full_mask, cache=cache,
                                                 inputs_embeds=torch.empty((b, 1, 0), dtype=model.dtype,
                                                                           device=device),
                                                 position_ids=positions)
                out = forward(input_ids=token[:, None], attention_mask=mask, position_ids=positions, cache=cache,
                              use_cache=True, logits_to_keep=1)
            if gen.do_sample:
                states[t] = generator_state(device)
            token, processed, logp = draw(out.logits[:, -1].float(), gen, t, logprobs)
            if scores is not None:
                scores.append((t, torch.arange(b, device=device), processed.clone()))
            token = torch.where(going, token, gen.pad_token_id)  # an ended row's draw is discarded
            tokens[:, t] = token
            if logprobs:
                drawn_logp[:, t] = torch.where(going, logp, 0.0)
            steps_going += going
            going = going & (token != gen.eos_token_id)
            if (t + 1) % END_CHECK_EVERY == 0 or t + 1 == c:
                if not going.any():
                    break
                states.clear()
    width = int(steps_going.max())  # generate's last step: the one after which no row was going
    if width in states:  # the steps after it drew nothing kept: the generator as generate leaves it
        set_generator_state(device, states[width])
    if scores is not None:
        del scores[first_score + width:]
    return (tokens[:, :width], drawn_logp[:, :width]) if logprobs else tokens[:, :width]
