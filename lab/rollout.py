"""The lab's sampled batch: support/helpers.py's Rollout, with what the lab's features keep of each row (the routing
of a mixture of experts, a sampler process's log-probs and rewards, an episode's masks, ReMax's greedy rollout),
carried through `select` and `cat` (DAPO's rounds of sampling joined) as the rows are."""
from dataclasses import dataclass, fields

import torch

from support.helpers import Rollout, first_rows, pad, prompt_width


@dataclass
class LabRollout(Rollout):
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
    greedy: "LabRollout" = None  # ReMax: the greedy completion of each prompt, decoded with the same weights
    # --environment / --tools: (B, T) 1 on every token of the episode, the environment's too (what attention sees;
    # None: mask), and each row's agents.Episode
    token_mask: torch.Tensor = None
    episodes: list = None

    @property
    def attention_mask(self):  # (B, P + T)
        return torch.cat([self.prompt_mask, self.mask if self.token_mask is None else self.token_mask], dim=1)

    @property
    def budget_used(self):  # (B,) the tokens of --max_new_tokens each row spent: an episode's environment tokens too
        return (self.mask if self.token_mask is None else self.token_mask).sum(1)

    def select(self, keep):
        """The rows where keep (a (B,) bool tensor) is True."""
        rows = keep.nonzero().flatten()
        routing = None if self.routing is None else tuple(x[rows] for x in self.routing)
        return LabRollout(**shared(Rollout.select(self, keep)), routing=routing, group_size=self.group_size,
                          sampler_logp=take(self.sampler_logp, rows), ref_logp=take(self.ref_logp, rows),
                          version=take(self.version, rows), token_mask=take(self.token_mask, rows),
                          episodes=None if self.episodes is None else [self.episodes[i] for i in rows.tolist()])

    @staticmethod
    def cat(rollouts, pad_token_id, limit=None):
        """Rollout.cat, the lab's fields joined as the rows are (the routing's prompt columns padded as the prompts,
        its completion columns as the completions)."""
        parts = first_rows(rollouts, limit)
        first, width = parts[0], prompt_width(parts)

        def joined(name, value):  # a (B, T) field padded as the completions, or None
            return None if getattr(first, name) is None else pad([getattr(r, name) for r in parts], value)

        def pad_routing(i):
            P = [r.prompt_ids.shape[1] for r in parts]
            return torch.cat([pad([r.routing[i][:, :p] for r, p in zip(parts, P)], -1, width, left=True),
                              pad([r.routing[i][:, p:] for r, p in zip(parts, P)], -1)], dim=1)
        return LabRollout(**shared(Rollout.cat(parts, pad_token_id)),
                          routing=None if first.routing is None else (pad_routing(0), pad_routing(1)),
                          group_size=first.group_size, sampler_logp=joined("sampler_logp", 0.0),
                          ref_logp=joined("ref_logp", 0.0), token_mask=joined("token_mask", 0),
                          version=None if first.version is None else torch.cat([r.version for r in parts]),
                          episodes=None if first.episodes is None else [e for r in parts for e in r.episodes])


def shared(rollout):
    """The fields of support's Rollout, by name."""
    return {f.name: getattr(rollout, f.name) for f in fields(Rollout)}


def take(x, rows):
    """These rows of a per-row tensor; None stays None."""
    return None if x is None else x[rows]
