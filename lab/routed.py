"""support/fast.py's scoring and sampling as the lab's loops run them on a mixture-of-experts policy: each forward
tells an open routing record or replay (lab/routing.py) which rows of its block it computes.

A record or replay lays out the experts in the trainer's rows, and a forward that runs other rows than its block's
must say which (`routing.rows`): a group's shared prompt pass runs one row per prompt, which reorder_cache then
copies to the group's rows (`shared_prompt_cache`), and the decode loop runs only the rows still going (`decode`).
support/fast.py knows nothing of the routing, so these are its functions with the telling added, built from its
pieces: the same draws and the same log-probs (tests/test_routing.py), inside a context or outside (where telling
costs nothing). Inside a context `generate` decodes with the loop of growing shapes, whose columns a record counts,
never with support/static_decode.py's fixed shapes (outside, it is fast.generate's choice)."""
import torch

import common
from lab import routing
from support import fast, models


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, with_entropy=False,
                   top_k=0, top_p=1.0, kept_sizes=None):
    """fast.token_logprobs, from `completion_logits`."""
    c = num_completion_tokens
    logits = completion_logits(model, input_ids, attention_mask, c)  # (B, C, V)
    return fast.logprobs_from_logits(logits, input_ids[:, -c:], temperature, with_entropy, top_k, top_p, kept_sizes)


def completion_logits(model, input_ids, attention_mask, num_completion_tokens):
    """fast.completion_logits, its shared prompt pass told its rows (`shared_prompt_cache`)."""
    c = num_completion_tokens
    if not fast.shares_prompt(model, input_ids, c):  # one pass over the block's own rows: nothing to tell
        return fast.completion_logits(model, input_ids, attention_mask, c)
    position_ids = common.position_ids_from_mask(attention_mask)
    first, group = fast.prompt_groups(input_ids, attention_mask, c)
    cache = shared_prompt_cache(model, input_ids[first, :-c], attention_mask[first, :-c], group)
    out = model(input_ids=input_ids[:, -c - 1:-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, -c - 1:-1], cache=cache, logits_to_keep=c, use_cache=True)
    return out.logits


def shared_prompt_cache(model, prompt_ids, prompt_mask, rows):
    """fast.shared_prompt_cache, its prompt pass told that row i of the block is prompt rows[i]."""
    with routing.rows(model, batch_rows=rows):
        return fast.shared_prompt_cache(model, prompt_ids, prompt_mask, rows)


def decode(model, input_ids, attention_mask, cache, gen, scores=None, logprobs=False):
    """fast.decode, each step told the rows still going."""
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
        token, logits = fast.draw(out.logits[:, -1].float(), gen, t, rows, len(tokens))
        if scores is not None:
            scores.append((t, rows, logits))
        if logprobs:
            drawn_logp[rows, t] = fast.drawn_logprob(logits, token)
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
    """fast.generate, from `shared_prompt_cache` and `decode`. fixed_shape (None: on CUDA, outside any routing
    context) is fast.generate's, steps of fixed shapes that no context can count the columns of."""
    if fixed_shape is None:
        fixed_shape = prompt_ids.is_cuda and not routing.is_open(model)
    if fixed_shape:
        if routing.is_open(model):
            raise ValueError("a routing record counts the columns of a growing attention mask: sample with "
                             "routed.generate(fixed_shape=False) inside routing.record")
        return fast.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples, greedy, scores, logprobs,
                             fixed_shape=True)
    num_samples = 1 if greedy else num_samples
    gen = common.generation_config(tokenizer, cfg, greedy)
    n = max(1, cfg.generation_batch_size // num_samples) if cfg.generation_batch_size else len(prompt_ids)
    with common.sampling_mode(model), models.gathered_parameters(model):
        chunks = []
        for i in range(0, len(prompt_ids), n):
            ids, mask = prompt_ids[i:i + n], prompt_mask[i:i + n]
            rows = torch.arange(len(ids), device=ids.device).repeat_interleave(num_samples)  # K adjacent
            cache = shared_prompt_cache(model, ids, mask, rows) if ids.shape[1] > 1 else None
            chunks.append(decode(model, ids[rows], mask[rows], cache, gen, scores, logprobs))
    if logprobs:
        return (common.pad_completions([ids for ids, _ in chunks], tokenizer.pad_token_id),
                common.pad_completions([logp for _, logp in chunks], 0.0))
    return common.pad_completions(chunks, tokenizer.pad_token_id)
