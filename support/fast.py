"""The fast log-probs and generation the loops run: the same signatures and results as their spec,
`common.token_logprobs` and `common.generate`, proven equal to them (values and gradients, the same
draws from the same seed) by tests/test_fast.py. Read the spec; this is how it is made cheap:

- a group's prompt runs once, and each of its rows continues it from a copy of its keys and values
  (`shared_prompt_cache`), for about 1 / G of the prompts' work in scoring and in sampling;
- only the completion's logits are computed, and the log-softmax is taken a chunk of rows at a time
  as gather - logsumexp, so no (B, T, V) log-softmax copy is ever materialised;
- sampling is a decode loop of its own (`decode`): the steps of transformers' generate for exactly the
  sampler's settings, in which a row that has emitted EOS leaves the batch, so the later steps run only
  the rows still going (fewer row-steps whenever completions end at different lengths), with the same
  draws, since one draw is still made for every row;
- under DeepSpeed ZeRO-3 the weights are gathered once for a whole generate call, not once per token
  (`models.gathered_parameters`).

What the lab's features need from each step (the drawn tokens' log-probs, the processed scores, the rows told to a
routing record, steps of fixed shapes on a GPU) is the lab's own loop on these pieces: lab/decode.py.
"""
import torch

import common
from support import models

# Rows of (C, V) fp32 logits that token_logprobs takes at once: 2**24 floats (64 MiB) bound the
# temporary copies whatever the vocabulary; the embedded model's whole batch fits in one chunk.
LOGPROB_CHUNK_ELEMENTS = 2 ** 24


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

    Adjacent rows with the same prompt (a group of samples) share the prompt's forward pass: it runs
    once per group and keeps its keys and values, each row gets its group's copy of them, and only
    the last prompt token and the completion run row by row. Values and gradients are those of one pass
    over every full row (the copies' gradients add up in the prompt's pass), for about 1 / G of the
    prompts' work. Rows that share nothing take the same two passes at no extra cost, so the number of
    forward calls never depends on the data (under ZeRO-3 each is a collective every rank must make).
    Gradient checkpointing keeps no cache where gradients are recorded, and ZeRO-3 cannot reduce a mixture-of-experts
    block's gradient from two passes: then it is the one pass. Without
    gradients (the scoring passes) transformers' checkpointed layers run as they are, cache included, and
    the model's modules are not even looked at.
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
    ZeRO-3's gathering (models.zero3_moe_leaves: its gradient is reduced once per forward). Else one pass."""
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
    with common.sampling_mode(model), models.gathered_parameters(model):
        chunks = []
        for i in range(0, len(prompt_ids), n):
            ids, mask = prompt_ids[i:i + n], prompt_mask[i:i + n]
            rows = torch.arange(len(ids), device=ids.device).repeat_interleave(num_samples)  # K adjacent
            cache = shared_prompt_cache(model, ids, mask, rows) if ids.shape[1] > 1 else None
            chunks.append(decode(model, ids[rows], mask[rows], cache, gen))
    return common.pad_completions(chunks, tokenizer.pad_token_id)
