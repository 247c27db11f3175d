"""The batch a training step works on: the sampled rollout (`Rollout`, one row per completion), and the rows of each
forward/backward pass of its update (`micro_batches`; the lab's engine keeps more of each: lab/engine.MicroBatch)."""
from dataclasses import dataclass

import torch



@dataclass
class Rollout:
    """A sampled batch, one row per completion: its example, the prompt (left-padded) and the completion
    (padded after its first EOS), as ids and as text."""
    examples: list
    prompt_ids: torch.Tensor      # (B, P)
    prompt_mask: torch.Tensor     # (B, P), 0 on the left padding
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor            # (B, T), 1 up to and including the first EOS (common.completion_mask); an
    completions: list             # episode's: its action mask, 1 on the model's tokens only (agents.py)
    # a mixture-of-experts policy's routing (lab/routing.py), (B, P + T, L, k) in the layout of input_ids:
    routing: tuple = None               # the sampler's experts and the token ids it saw
    old_routing: tuple = None           # those of the trainer's pi_old pass
    live_routing: torch.Tensor = None   # the trainer's routers' own choice, in its first pass over each row
    group_size: int = 1                 # samples per prompt, adjacent rows (the rollout viewer shows whole groups)
    # --async_rollouts: the sampler process's (B, T) log-probs, the (B,) version of the weights that sampled each row
    # (the optimizer steps done then), the reference's (B, T) log-probs it scored (with a KL term) and its seconds
    # per phase (lab/async_sampling.py)
    sampler_logp: torch.Tensor = None
    ref_logp: torch.Tensor = None
    version: torch.Tensor = None
    sampler_times: dict = None
    rewards: tuple = None  # and the rewards it computed: (rewards, correct, stats, error) of tasks.reward_scorer
    greedy: "Rollout" = None  # ReMax: the greedy completion of each prompt, decoded with the same weights
    # --environment / --tools: (B, T) 1 on every token of the episode, the environment's too (what attention sees;
    # None: mask), and each row's agents.Episode
    token_mask: torch.Tensor = None
    episodes: list = None

    def __len__(self):
        return len(self.examples)

    @property
    def input_ids(self):  # (B, P + T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self):  # (B, P + T)
        return torch.cat([self.prompt_mask, self.mask if self.token_mask is None else self.token_mask], dim=1)

    @property
    def budget_used(self):  # (B,) the tokens of --max_new_tokens each row spent: an episode's environment tokens too
        return (self.mask if self.token_mask is None else self.token_mask).sum(1)

    @property
    def prompts(self):
        return [ex["prompt"] for ex in self.examples]

    def select(self, keep):
        """The rows where keep (a (B,) bool tensor) is True."""
        rows = keep.nonzero().flatten()
        return Rollout([self.examples[i] for i in rows.tolist()], self.prompt_ids[rows], self.prompt_mask[rows],
                       self.completion_ids[rows], self.mask[rows], [self.completions[i] for i in rows.tolist()],
                       None if self.routing is None else tuple(x[rows] for x in self.routing),
                       group_size=self.group_size, sampler_logp=take(self.sampler_logp, rows),
                       ref_logp=take(self.ref_logp, rows), version=take(self.version, rows),
                       token_mask=take(self.token_mask, rows),
                       episodes=None if self.episodes is None else [self.episodes[i] for i in rows.tolist()])

    @staticmethod
    def cat(rollouts, pad_token_id, limit=None):
        """The first `limit` rows (default: all) of several rollouts in one, padded as if sampled together:
        prompts on the left to the longest prompt, completions on the right to the widest completion."""
        parts, remaining = [], sum(map(len, rollouts)) if limit is None else limit
        for r in rollouts:
            if remaining > 0 and len(r) > 0:
                parts.append(r.select(torch.arange(len(r), device=r.mask.device) < remaining))
                remaining -= len(parts[-1])
        prompt_width = max(int(r.prompt_mask.sum(1).max()) for r in parts)  # the padding no row needs goes

        def pad(tensors, value, width=None, left=False):  # along dim 1, to `width` (default: the widest)
            width = width or max(t.shape[1] for t in tensors)
            out = []
            for t in tensors:
                t = t[:, -width:] if left else t
                out.append(t.new_full((len(t), width, *t.shape[2:]), value))
                (out[-1][:, width - t.shape[1]:] if left else out[-1][:, :t.shape[1]]).copy_(t)
            return torch.cat(out)

        def pad_routing(i):  # its prompt columns as the prompts', its completion columns as the completions'
            P = [r.prompt_ids.shape[1] for r in parts]
            return torch.cat([pad([r.routing[i][:, :p] for r, p in zip(parts, P)], -1, prompt_width, left=True),
                              pad([r.routing[i][:, p:] for r, p in zip(parts, P)], -1)], dim=1)
        return Rollout([ex for r in parts for ex in r.examples],
                       pad([r.prompt_ids for r in parts], pad_token_id, prompt_width, left=True),
                       pad([r.prompt_mask for r in parts], 0, prompt_width, left=True),
                       pad([r.completion_ids for r in parts], pad_token_id),
                       pad([r.mask for r in parts], 0), [c for r in parts for c in r.completions],
                       None if parts[0].routing is None else (pad_routing(0), pad_routing(1)),
                       group_size=parts[0].group_size, sampler_logp=None if parts[0].sampler_logp is None else
                       pad([r.sampler_logp for r in parts], 0.0), ref_logp=None if parts[0].ref_logp is None else
                       pad([r.ref_logp for r in parts], 0.0), version=None if parts[0].version is None else
                       torch.cat([r.version for r in parts]),
                       token_mask=None if parts[0].token_mask is None else pad([r.token_mask for r in parts], 0),
                       episodes=None if parts[0].episodes is None else [e for r in parts for e in r.episodes])


def take(x, rows):
    """These rows of a per-row tensor; None stays None."""
    return None if x is None else x[rows]


def micro_batches(batch_size, micro_batch_size):
    """Slices of consecutive rows that cover range(batch_size), micro_batch_size rows each (the last may be
    smaller); 0 gives one slice, the whole batch."""
    size = micro_batch_size or batch_size
    return [slice(start, min(start + size, batch_size)) for start in range(0, batch_size, size)]
