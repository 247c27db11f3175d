"""Agents: multi-turn episodes, in which the model's tokens are actions and the environment's are context.

A single-turn rollout is a prompt and one completion. An episode goes on: the model writes until it ends its turn
(its end of sequence, or a tool call closing), the environment reads the turn, runs the tools it calls and answers,
its reply is appended as tokens, and the model writes again, until a turn calls no tool, --max_turns turns have
been played, or the completion region holds --max_new_tokens tokens (the episode's token budget). One row of the
rollout is one episode:

    prompt | <tool>34*5</tool> | <result>170</result> | <tool>12+170</tool> | <result>182</result> | 182<eos>
    mask:    1 1 1 1 1 1 1 1     0 0 0 0 0 0 0 0 0 0    1 1 1 1 1 1 1 1 1 1    0 0 0 0 0 0 0 0 0 0    1 1 1 1

The one idea agents add: only actions are trained. The environment's tokens are context the model conditions on,
not choices it made, so the action mask (1 on the model's tokens, 0 on the prompt's, the environment's and the
padding) is the mask every loss receives: ratios, clipping, KL, entropy, importance weights and every token
statistic run over the model's tokens alone, and no gradient reaches a token the environment wrote. Attention still
sees every token (`episode_masks`' token mask). The reward comes at the end of the episode, so every turn's
tokens share its credit: credit assignment over turns is credit assignment over tokens with holes in it.

The ids are kept exactly as sampled and as inserted, never re-tokenised from decoded text: a decode and encode
round trip can merge or split tokens, and the loss would then score tokens the model never sampled.

`play_episodes` is the definition: turn-synchronous over the batch, every live episode sampling its turn
together, each turn's history encoded again. `CachedTurns`, what the lab's loops sample turns with, keeps the keys
and values across turns instead (an observation is appended, not the history re-encoded) and is tested equal to
it, the same draws and the same tokens (tests/test_agents.py). How tools and environments are loaded and called,
in TRL's conventions: lab/environments.py. Pure functions and the loops: no accelerator inside.
"""
import collections
from dataclasses import dataclass, field

import torch

import common


@torch.no_grad()
def drawn_logprob(scores, token):
    """(B,) each row's drawn token's log-prob under the processed (B, V) scores it was drawn from: the behaviour
    policy mu of the draw."""
    return scores.gather(1, token[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)


@dataclass
class Episode:
    """One episode's record, for the reward functions and the logs: the environment's handle (`env.instance`: the
    user's environment object), its turns ({"role": "assistant" or "tool", "text"}), its tool calls ({"name",
    "arguments", "result", "error"}) and whether it was cut (--max_turns or the token budget) before it ended."""
    env: object
    turns: list = field(default_factory=list)
    tool_calls: list = field(default_factory=list)
    truncated: bool = False

    @property
    def num_turns(self):  # the model's turns
        return sum(turn["role"] == "assistant" for turn in self.turns)

    @property
    def tool_errors(self):
        return sum(call["error"] for call in self.tool_calls)


def episode_masks(segment_lengths, segment_is_action, width):
    """The (B, width) action mask and token mask of episodes laid out as segments, each row's one after the other
    from position 0: segment_lengths (B, S) token counts (0: no segment), segment_is_action (B, S) bool (True: the
    model's tokens, False: the environment's). The action mask is 1 on the positions of action segments, the token
    mask 1 on the positions of every segment; both are 0 on the padding after the last.

        lengths [[3, 4, 2]], is_action [[True, False, True]], width 10
        action mask [[1, 1, 1, 0, 0, 0, 0, 1, 1, 0]],  token mask [[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]]"""
    # BEGIN SOLUTION
    ends = segment_lengths.cumsum(dim=1)  # (B, S): the position after each segment
    positions = torch.arange(width, device=segment_lengths.device)  # (width,)
    segment = (positions[None, :, None] >= ends[:, None, :]).sum(-1)  # (B, width): the segment each position is in
    token_mask = segment < segment_lengths.shape[1]
    is_action = segment_is_action.gather(1, segment.clamp(max=segment_lengths.shape[1] - 1))
    return (token_mask & is_action).long(), token_mask.long()
    # END SOLUTION


def play_episodes(sample_turn, spec, tokenizer, examples, max_new_tokens, max_turns):
    """Play one episode of each example; return (prompt_ids, prompt_mask, completion_ids, mask, token_mask,
    episodes): the (B, P) prompts as the policy read them (left-padded; with what the environment's reset said), the
    (B, T) ids of each completion region (turns and observations, padded on the right), its action mask and token
    mask (`episode_masks`), and the rows' `Episode`s.

    sample_turn(rows, histories, appended, max_new_tokens) samples one turn of the episodes `rows` (indices into the
    batch, increasing): histories[j] is row j's token ids so far (prompt and episode), appended[j] those added since
    its last turn (its prompt at the first); it returns each row's new token ids, up to and including the first EOS
    or turn-ending token (`spec.stop_ids`), else max_new_tokens of them. One call samples every row together, one
    draw per row and step, as one generate call (`sample_turn_plain`). `spec`: lab/environments.py's."""
    B, eos = len(examples), tokenizer.eos_token_id
    episodes = [Episode(env, truncated=env.cut) for env in map(spec.episode, examples)]  # cut: reset's observation
    prompt = tokenizer([spec.prompt_text(ex, e.env) for ex, e in zip(examples, episodes)], return_tensors="pt",
                       padding=True, add_special_tokens=False)
    prompt_ids, prompt_mask = prompt["input_ids"], prompt["attention_mask"]
    segments = [[] for _ in range(B)]  # each row's (token ids, is_action), in order
    histories = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    appended, used, live = [list(h) for h in histories], [0] * B, list(range(B))
    for turn in range(max_turns):
        budgets = [max_new_tokens - used[i] for i in live]
        sampled = sample_turn(live, [histories[i] for i in live], [appended[i] for i in live], max(budgets))
        still_live = []
        for i, ids, budget in zip(live, sampled, budgets):
            ids, episode = ids[:budget], episodes[i]
            segments[i].append((ids, True))
            histories[i] += ids
            used[i] += len(ids)
            ended = bool(ids) and (ids[-1] == eos or ids[-1] in spec.stop_ids)
            text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
            episode.turns.append({"role": "assistant", "text": text})
            calls = spec.parse(text) if ended else []
            if not ended:  # the token budget ran out inside the turn
                episode.truncated = True
            if not calls:
                continue
            results = [episode.env.call(call) for call in calls]
            for call, result in zip(calls, results):
                episode.tool_calls.append({"name": call.name, "arguments": call.arguments, "result": result.text,
                                           "error": result.error})
                episode.truncated |= result.cut  # a reply cut to the characters an observation may add
            observation = spec.observation_ids(results)
            if turn + 1 == max_turns or used[i] + len(observation) >= max_new_tokens:
                episode.truncated = True  # it asked for a reply it has no turn, or no room, left to read
                continue
            episode.turns.append({"role": "tool", "text": "\n".join(result.text for result in results)})
            segments[i].append((observation, False))
            histories[i] += observation
            appended[i] = observation
            used[i] += len(observation)
            still_live.append(i)
        live = still_live
        if not live:
            break
    return prompt_ids, prompt_mask, *episode_tensors(segments, tokenizer.pad_token_id), episodes


def episode_tensors(segments, pad_token_id):
    """(completion_ids, mask, token_mask), each (B, T), of the rows' segments (lists of (token ids, is_action))."""
    lengths = [[len(ids) for ids, _ in row] for row in segments]
    S, T = max(map(len, lengths)), max(1, max(map(sum, lengths)))
    completion_ids = torch.full((len(segments), T), pad_token_id, dtype=torch.long)
    for i, row in enumerate(segments):
        flat = [t for ids, _ in row for t in ids]
        completion_ids[i, :len(flat)] = torch.tensor(flat, dtype=torch.long)
    segment_lengths = torch.tensor([row + [0] * (S - len(row)) for row in lengths], dtype=torch.long)
    is_action = torch.tensor([[a for _, a in row] + [False] * (S - len(row)) for row in segments], dtype=torch.bool)
    mask, token_mask = episode_masks(segment_lengths, is_action, T)
    return completion_ids, mask, token_mask


def sample_turn_plain(model, tokenizer, cfg, stop_ids, greedy=False):
    """The definition of a turn's sampling (play_episodes' sample_turn): every row's whole history, left-padded,
    through one transformers generate call that stops a row at EOS or a turn-ending token: the sampler of
    common.generate (exactly --temperature, --top_k, --top_p), the history encoded again at every turn."""
    def sample_turn(rows, histories, appended, max_new_tokens):
        width = max(map(len, histories))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(h)) + h for h in histories])
        attention_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(h) for h in histories])[:, None])
        device = next(model.parameters()).device
        gen = common.generation_config(tokenizer, cfg, greedy)
        gen.max_new_tokens, gen.eos_token_id = max_new_tokens, [tokenizer.eos_token_id, *stop_ids]
        with common.sampling_mode(model):
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.long().to(device),
                                 generation_config=gen)[:, width:]
        return [until_stop(row, gen.eos_token_id) for row in out.tolist()]
    return sample_turn


def until_stop(ids, stop_ids):
    """The ids up to and including the first of stop_ids (all of them when none occurs)."""
    for t, token in enumerate(ids):
        if token in stop_ids:
            return ids[:t + 1]
    return ids


class CachedTurns:
    """play_episodes' sample_turn, equal to sample_turn_plain (the same draws, the same tokens;
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
