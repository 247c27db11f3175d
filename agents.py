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
together, each turn's history encoded again. support/fast.py's `CachedTurns` keeps the keys and values across
turns instead (an observation is appended, not the history re-encoded) and is tested equal to it, the same draws
and the same tokens (tests/test_agents.py). How tools and environments are loaded and called, in TRL's
conventions: lab/environments.py. Pure functions and the loop: no accelerator inside.
"""
from dataclasses import dataclass, field

import torch

import common


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
