"""The lab's sampling and scoring: support/models.py's, built from its pieces, with what the lab's features need from
each step, which the lesson's loop does not keep:

- the log-prob of each drawn token under the processed scores it was drawn from (`decode(logprobs=True)`): the
  behaviour policy mu of lab/async_sampling.py and agents.CachedTurns, at no scoring pass;
- each step's processed scores (`decode(scores=[...])`) and each token's kept-set size under top-k / top-p
  (`token_logprobs(kept_sizes=[...])`, and `plain_token_logprobs`, common.token_logprobs's, under --fast False):
  the viewer's (lab/view.py);
- on a mixture-of-experts policy, each forward tells an open routing record or replay (lab/routing.py) which rows
  of its block it computes: a group's shared prompt pass runs one row per prompt, which reorder_cache then copies
  to the group's rows (`shared_prompt_cache`), and the decode loop runs only the rows still going (`decode`);
  outside a record or replay the telling costs nothing;
- on a GPU, steps of fixed shapes captured once (lab/static_decode.py), where a step costs its kernel launches
  more than its rows (never inside a routing record, which counts the columns of a growing mask).

The same draws and the same log-probs as support/models.py's (tests/test_routing.py, tests/test_fast.py), so the
lab's loops train what the lesson's do (tests/test_lesson_equals_lab.py).
"""
import torch

import common
from agents import drawn_logprob
from lab import routing, static_decode
from support import models


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, with_entropy=False,
                   top_k=0, top_p=1.0, kept_sizes=None):
    """models.token_logprobs, from `completion_logits`; `kept_sizes`, a list, receives the (B, C) size of the set each
    token was drawn from under top-k / top-p (`kept_set_sizes`)."""
    c = num_completion_tokens
    logits = completion_logits(model, input_ids, attention_mask, c)  # (B, C, V)
    if kept_sizes is not None and (top_k > 0 or top_p < 1.0):
        kept_sizes.append(kept_set_sizes(logits, input_ids[:, -c:], temperature, top_k, top_p))
    return models.logprobs_from_logits(logits, input_ids[:, -c:], temperature, with_entropy, top_k, top_p)


def plain_token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                         with_entropy=False, top_k=0, top_p=1.0, kept_sizes=None):
    """common.token_logprobs, the definition (--fast False), with token_logprobs' `kept_sizes`: counted from the
    logits of its own forward, kept on the way (no second forward: a routing record or replay counts each one)."""
    c, seen = num_completion_tokens, []

    def forward(**inputs):  # the model's forward, its logits kept
        out = model(**inputs)
        seen.append(out.logits[:, -c - 1:-1])
        return out

    scored = common.token_logprobs(forward, input_ids, attention_mask, c, temperature, with_entropy, top_k, top_p)
    if kept_sizes is not None and (top_k > 0 or top_p < 1.0):
        kept_sizes.append(kept_set_sizes(seen[0], input_ids[:, -c:], temperature, top_k, top_p))
    return scored


@torch.no_grad()
def kept_set_sizes(logits, targets, temperature, top_k, top_p):
    """(B, C): how many tokens top-k / top-p kept where each target was drawn, the target counted in as
    models.logprobs_from_logits counts it, a chunk of rows at a time as it takes them."""
    rows, sizes = max(1, models.LOGPROB_CHUNK_ELEMENTS // (targets.shape[1] * logits.shape[-1])), []
    for start in range(0, len(logits), rows):
        kept = common.sampling_mask(logits[start:start + rows].float() / temperature, top_k, top_p).isfinite()
        sizes.append(kept.scatter_(-1, targets[start:start + rows, :, None], True).sum(-1))
    return torch.cat(sizes)


def completion_logits(model, input_ids, attention_mask, num_completion_tokens):
    """models.completion_logits, its shared prompt pass told its rows (`shared_prompt_cache`)."""
    c = num_completion_tokens
    if not models.shares_prompt(model, input_ids, c):  # one pass over the block's own rows: nothing to tell
        return models.completion_logits(model, input_ids, attention_mask, c)
    position_ids = common.position_ids_from_mask(attention_mask)
    first, group = models.prompt_groups(input_ids, attention_mask, c)
    cache = shared_prompt_cache(model, input_ids[first, :-c], attention_mask[first, :-c], group)
    out = model(input_ids=input_ids[:, -c - 1:-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, -c - 1:-1], cache=cache, logits_to_keep=c, use_cache=True)
    return out.logits


def shared_prompt_cache(model, prompt_ids, prompt_mask, rows):
    """models.shared_prompt_cache, its prompt pass told that row i of the block is prompt rows[i]."""
    with routing.rows(model, batch_rows=rows):
        return models.shared_prompt_cache(model, prompt_ids, prompt_mask, rows)


def decode(model, input_ids, attention_mask, cache, gen, scores=None, logprobs=False):
    """models.decode, each step told the rows still going. Returns (B, C) completion ids (logprobs: and each drawn
    token's (B, C) log-prob under the processed scores it was drawn from, 0 after EOS); `scores`, a list, receives
    (step, rows, processed scores)."""
    position_ids = common.position_ids_from_mask(attention_mask)
    tokens = torch.full((len(input_ids), gen.max_new_tokens), gen.pad_token_id, dtype=input_ids.dtype,
                        device=input_ids.device)
    drawn_logp = torch.zeros(tokens.shape, device=input_ids.device) if logprobs else None
    rows = torch.arange(len(input_ids), device=input_ids.device)  # the rows still going
    inputs, positions = (input_ids[:, -1:], position_ids[:, -1:]) if cache is not None else (input_ids, position_ids)
    for t in range(gen.max_new_tokens):
        with routing.rows(model, rows):
            out = model(input_ids=inputs, attention_mask=attention_mask, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1)
        cache = out.cache
        token, logits = models.draw(out.logits[:, -1].float(), gen, t, rows, len(tokens))
        if scores is not None:
            scores.append((t, rows, logits))
        if logprobs:
            drawn_logp[rows, t] = drawn_logprob(logits, token)
        tokens[rows, t] = token
        going = token != gen.eos_token_id
        if not going.any():
            return (tokens[:, :t + 1], drawn_logp[:, :t + 1]) if logprobs else tokens[:, :t + 1]
        if not going.all():  # the finished rows leave the batch
            keep = going.nonzero().squeeze(1)
            cache.reorder_cache(keep)
            rows, token, attention_mask, positions = rows[keep], token[keep], attention_mask[keep], positions[keep]
        inputs, positions = token[:, None], positions[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(attention_mask), 1)], dim=1)
    return (tokens, drawn_logp) if logprobs else tokens


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1, greedy=False, scores=None,
             logprobs=False, fixed_shape=None):
    """models.generate, from `shared_prompt_cache` and `decode` (`scores`: see `decode`, one list entry per step of
    each call; logprobs: also each drawn token's (B * num_samples, C) log-prob, equal to token_logprobs' scoring of
    the same completions without its pass). fixed_shape (None: on CUDA, outside any routing context) decodes with
    static_decode.decode, in steps of fixed shapes, which no record can count the columns of."""
    if fixed_shape is None:
        fixed_shape = prompt_ids.is_cuda and not routing.is_open(model)
    if fixed_shape and routing.is_open(model):
        raise ValueError("a routing record counts the columns of a growing attention mask: sample with "
                         "decode.generate(fixed_shape=False) inside routing.record")
    num_samples = 1 if greedy else num_samples
    gen = common.generation_config(tokenizer, cfg, greedy)
    n = max(1, cfg.generation_batch_size // num_samples) if cfg.generation_batch_size else len(prompt_ids)
    with common.sampling_mode(model), models.gathered_parameters(model):
        chunks = []
        for i in range(0, len(prompt_ids), n):
            ids, mask = prompt_ids[i:i + n], prompt_mask[i:i + n]
            rows = torch.arange(len(ids), device=ids.device).repeat_interleave(num_samples)  # K adjacent
            cache = shared_prompt_cache(model, ids, mask, rows) if ids.shape[1] > 1 else None
            decode_loop = static_decode.decode if fixed_shape else decode
            chunks.append(decode_loop(model, ids[rows], mask[rows], cache, gen, scores, logprobs))
    if logprobs:
        return (common.pad_completions([ids for ids, _ in chunks], tokenizer.pad_token_id),
                common.pad_completions([logp for _, logp in chunks], 0.0))
    return common.pad_completions(chunks, tokenizer.pad_token_id)
