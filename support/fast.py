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
  draws, since one draw is still made for every row; on a GPU, where a step costs its kernel launches more than
  its rows, the same draws come from steps of fixed shapes captured once instead (support/static_decode.py);
- under DeepSpeed ZeRO-3 the weights are gathered once for a whole generate call, not once per token
  (`models.gathered_parameters`).
"""
import collections

import torch

import common
from agents import until_stop
from support import models, routing, static_decode

# Rows of (C, V) fp32 logits that token_logprobs takes at once: 2**24 floats (64 MiB) bound the
# temporary copies whatever the vocabulary; the embedded model's whole batch fits in one chunk.
LOGPROB_CHUNK_ELEMENTS = 2 ** 24


def shared_prompt_cache(model, prompt_ids, prompt_mask, rows):
    """The keys and values of each prompt's tokens but its last, computed once per prompt, then copied
    to every row that continues it: row i of the cache is prompt rows[i]'s. The last prompt token and
    what follows it then run row by row. Scoring a group's rows and sampling a prompt's K completions
    both share their prompt this way."""
    position_ids = common.position_ids_from_mask(prompt_mask)
    with routing.rows(model, batch_rows=rows):  # for routing.record / replay: row i is prompt rows[i]
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
    prompts = torch.cat([input_ids[:, :-c], attention_mask[:, :-c]], dim=1)
    _, group, counts = torch.unique_consecutive(prompts, dim=0, return_inverse=True, return_counts=True)
    # with gradients: checkpointed layers keep no cache, and ZeRO-3 reduces the gradient of a mixture-of-experts
    # block (a leaf of its gathering, models.zero3_moe_leaves) once per forward: one pass for both
    one_pass = torch.is_grad_enabled() and any(getattr(module, "gradient_checkpointing", False) or
                                               getattr(module, "_z3_leaf", False) for module in model.modules())
    if input_ids.shape[1] < c + 2 or one_pass:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=c + 1, use_cache=False)
        return out.logits[:, -(c + 1):-1, :]
    first = counts.cumsum(0) - counts  # the first row of each group
    cache = shared_prompt_cache(model, input_ids[first, :-c], attention_mask[first, :-c], group)
    out = model(input_ids=input_ids[:, -c - 1:-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, -c - 1:-1], cache=cache, logits_to_keep=c, use_cache=True)
    return out.logits


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, with_entropy=False,
                   top_k=0, top_p=1.0, kept_sizes=None):
    """common.token_logprobs, computed from `completion_logits` (a group's prompt once) a chunk of rows
    at a time (LOGPROB_CHUNK_ELEMENTS bounds each chunk). Returns (B, C) fp32 log-probs (and entropies);
    `kept_sizes` receives each chunk's kept-set sizes."""
    c = num_completion_tokens
    logits = completion_logits(model, input_ids, attention_mask, c)  # (B, C, V)
    targets = input_ids[:, -c:]
    rows = max(1, LOGPROB_CHUNK_ELEMENTS // (c * logits.shape[-1]))
    logps, entropies = [], []
    for start in range(0, len(logits), rows):
        chunk = logits[start:start + rows].float() / temperature  # (rows, C, V)
        chunk_targets = targets[start:start + rows, :, None]
        if top_k > 0 or top_p < 1.0:
            # the sampled token stays in: a rounding difference from generate() must not give log 0
            kept = common.sampling_mask(chunk.detach(), top_k, top_p).isfinite()
            kept.scatter_(-1, chunk_targets, True)
            chunk = chunk.masked_fill(~kept, float("-inf"))
            if kept_sizes is not None:
                kept_sizes.append(kept.sum(-1))
        lse = torch.logsumexp(chunk, dim=-1)
        logps.append(chunk.gather(-1, chunk_targets).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(chunk, -1)
                entropies.append(lse - (probs * chunk.masked_fill(probs == 0, 0)).sum(-1))
    logps = torch.cat(logps)
    return (logps, torch.cat(entropies)) if with_entropy else logps


@torch.no_grad()
def drawn_logprob(scores, token):
    """(B,) each row's drawn token's log-prob under the processed (B, V) scores it was drawn from: the behaviour
    policy mu of the draw, which `decode` and `CachedTurns` keep as they draw (async_sampling)."""
    return scores.gather(1, token[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)


def decode(model, input_ids, attention_mask, cache, gen, scores=None, logprobs=False):
    """The steps of transformers' generate (its `_sample`) for a GenerationConfig `gen` of common.generation_config:
    the last position's fp32 logits, EOS held back for gen.min_new_tokens, temperature, top-k, top-p
    (common.sampling_mask), one multinomial draw per row (greedy: argmax), until every row has emitted EOS or
    max_new_tokens. `cache` holds every prompt token but the last (None: the whole prompt runs first).
    A row that emitted EOS leaves the batch, its keys and values with it. Its draw is still made, from a
    placeholder distribution, and discarded: the random stream, and so every other row's draw, is generate's.
    Returns (B, C) completion ids, padded after EOS (logprobs: and each drawn token's (B, C) log-prob under the
    processed scores it was drawn from, 0 after EOS); `scores`, a list, receives (step, rows, processed scores)."""
    position_ids = common.position_ids_from_mask(attention_mask)
    tokens = torch.full((len(input_ids), gen.max_new_tokens), gen.pad_token_id, dtype=input_ids.dtype,
                        device=input_ids.device)
    drawn_logp = torch.zeros(tokens.shape, device=input_ids.device) if logprobs else None
    rows = torch.arange(len(input_ids), device=input_ids.device)  # the rows still going
    inputs, positions = (input_ids[:, -1:], position_ids[:, -1:]) if cache is not None else (input_ids, position_ids)
    for t in range(gen.max_new_tokens):
        with routing.rows(model, rows):  # for routing.record: the rows still going
            out = model(input_ids=inputs, attention_mask=attention_mask, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1)
        cache, logits = out.cache, out.logits[:, -1].float()
        if t < (gen.min_new_tokens or 0):
            logits[:, gen.eos_token_id] = float("-inf")
        if gen.do_sample:
            logits = common.sampling_mask(logits / gen.temperature, gen.top_k or 0, gen.top_p)
            probs = torch.softmax(logits, dim=-1)
            if len(rows) < len(tokens):  # a finished row draws from a placeholder (its pad token), discarded
                placeholder = torch.zeros(len(tokens), probs.shape[-1], device=probs.device)
                placeholder[:, gen.pad_token_id] = 1.0
                probs = placeholder.index_copy(0, rows, probs)
            token = torch.multinomial(probs, num_samples=1).squeeze(1)[rows]
        else:
            token = logits.argmax(dim=-1)
        if scores is not None:
            scores.append((t, rows, logits))
        if logprobs:  # the behaviour policy mu of what was drawn, at no extra pass (async_sampling)
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
    """common.generate, with each prompt run once for its samples (`shared_prompt_cache`), which then
    continue it from copies of its keys and values in `decode`: the same draws as generate's own
    num_return_sequences, without K passes over the prompt and without the rows that have ended. Under
    ZeRO-3 the weights are gathered once for the whole call. Returns completion ids (B * num_samples, C),
    each prompt's samples adjacent (`scores`: see `decode`, one list entry per step of each call); with logprobs,
    also each drawn token's log-prob under what it was drawn from (B * num_samples, C), equal to
    token_logprobs' scoring of the same completions (tests/test_fast.py) without its pass. fixed_shape (None: on
    CUDA, static_decode.chosen) decodes with static_decode.decode, in steps of fixed shapes, instead of `decode`."""
    fixed_shape = static_decode.chosen(model, prompt_ids) if fixed_shape is None else fixed_shape
    num_samples = 1 if greedy else num_samples
    gen = common.generation_config(tokenizer, cfg, greedy)  # one sequence per row: the rows are the K copies
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


class CachedTurns:
    """agents.play_episodes' sample_turn, equal to agents.sample_turn_plain (the same draws, the same tokens;
    tests/test_agents.py), with each episode's keys and values kept from one turn to the next: a turn feeds only
    what the row has not fed yet (its prompt at the first turn; then the last token it sampled and the environment's
    reply), right-padded into one block, and samples from there. A row whose turn has ended goes on running until
    every row's has, on a padding token its attention mask hides (a hole in the cache, which the positions skip),
    so the rows stay one batch across turns; a row whose episode has ended leaves the cache. With logprobs,
    `drawn[row]` keeps the log-prob of each token the row drew, in order, under the processed scores it was drawn
    from (the behaviour policy mu of its actions: `drawn_logprobs`)."""

    def __init__(self, model, tokenizer, cfg, stop_ids, greedy=False, logprobs=False):
        self.model, self.gen = model, common.generation_config(tokenizer, cfg, greedy)
        self.stop = torch.tensor([tokenizer.eos_token_id, *stop_ids])
        self.rows, self.cache, self.attention, self.positions, self.unfed = [], None, None, None, []
        self.drawn = collections.defaultdict(list) if logprobs else None

    @torch.no_grad()
    def __call__(self, rows, histories, appended, max_new_tokens):
        gen, model = self.gen, self.model
        device = next(model.parameters()).device
        if self.cache is not None:  # the episodes that go on keep their keys and values
            keep = torch.tensor([self.rows.index(r) for r in rows], device=device)
            self.cache.reorder_cache(keep)
            self.attention, self.positions = self.attention[keep], self.positions[keep]
            self.unfed = [self.unfed[j] for j in keep.tolist()]
        else:
            self.attention = torch.zeros(len(rows), 0, dtype=torch.long, device=device)
            self.positions = torch.zeros(len(rows), dtype=torch.long, device=device)
            self.unfed = [[] for _ in rows]
        self.rows = list(rows)
        blocks = [unfed + new for unfed, new in zip(self.unfed, appended)]
        lengths = torch.tensor([len(b) for b in blocks], device=device)
        width = int(lengths.max())
        block = torch.tensor([b + [gen.pad_token_id] * (width - len(b)) for b in blocks], device=device)
        block_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
        self.attention = torch.cat([self.attention, block_mask], dim=1)
        out = model(input_ids=block, attention_mask=self.attention, cache=self.cache, use_cache=True,
                    position_ids=self.positions[:, None] + torch.arange(width, device=device)[None, :])
        self.cache, self.positions = out.cache, self.positions + lengths
        logits = out.logits[torch.arange(len(rows), device=device), lengths - 1].float()  # each row's last token's
        tokens = torch.full((len(rows), max_new_tokens), gen.pad_token_id, dtype=torch.long, device=device)
        going = torch.ones(len(rows), dtype=torch.bool, device=device)  # the rows whose turn goes on
        drawn = torch.zeros(tokens.shape, device=device)  # with logprobs: each row's tokens', as they are drawn
        for t in range(max_new_tokens):
            token, logp = self._draw(logits, self.drawn is not None)
            tokens[going, t] = token[going]
            if logp is not None:
                drawn[:, t] = logp
            fed = going  # this step's token goes into the cache at the next forward (the stop token included)
            going = going & ~torch.isin(token, self.stop.to(device))
            if not going.any() or t + 1 == max_new_tokens:
                break
            self.attention = torch.cat([self.attention, fed.long()[:, None]], dim=1)
            out = model(input_ids=torch.where(fed, token, gen.pad_token_id)[:, None], attention_mask=self.attention,
                        position_ids=self.positions[:, None], cache=self.cache, use_cache=True)
            self.cache, logits = out.cache, out.logits[:, -1].float()
            self.positions = self.positions + fed.long()
        turns = [until_stop(row, self.stop.tolist()) for row in tokens[:, :t + 1].tolist()]
        self.unfed = [turn[-1:] if f else [] for turn, f in zip(turns, fed.tolist())]  # fed with the next block
        if self.drawn is not None:
            for row, turn, logp in zip(rows, turns, drawn.tolist()):
                self.drawn[row] += logp[:len(turn)]
        return turns

    def _draw(self, logits, with_logp=False):
        """One token per row, as transformers' generate draws it (greedy: argmax), and with_logp its log-prob under
        the processed scores it was drawn from (greedy: 0), else None."""
        gen = self.gen
        if not gen.do_sample:
            return logits.argmax(dim=-1), torch.zeros(len(logits), device=logits.device) if with_logp else None
        scores = common.sampling_mask(logits / gen.temperature, gen.top_k or 0, gen.top_p)
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        if not with_logp:
            return token, None
        return token, drawn_logprob(scores, token)

    def drawn_logprobs(self, mask):
        """(B, T) the rows' drawn log-probs at the actions of their episodes (mask: play_episodes' action mask, whose
        ones are each row's drawn tokens in order, the last turn cut to the token budget), 0 elsewhere."""
        logp = torch.zeros(mask.shape)
        kept = mask.sum(1).tolist()
        logp[mask.bool().cpu()] = torch.tensor([x for row, n in enumerate(kept) for x in self.drawn[row][:n]])
        return logp

