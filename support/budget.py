"""The group methods' prompt sampler: the step's prompts (tasks.PromptSampler, batch_size / G of them) and how many
completions each gets: G each (--budget uniform) or a knapsack allocation of the same batch_size completions
(--budget knapsack, exploration.knapsack_allocation) from each prompt's success rate at its last visit; with
--sampler tree, the trees the groups are sampled as (support/tree.py) and what their baselines run over."""
import math

import torch

import exploration
from support import tasks, tree


class BudgetSampler:
    """Draws prompts as tasks.PromptSampler (the same draws), remembers each prompt's success rate (`record`) and
    allocates the step's completions. Every process allocates its own --batch_size over its own prompts, from its
    own memory (each draws from its own shard): every process holds batch_size rows, as DDP's steps need."""

    def __init__(self, examples, cfg, rank=0, world_size=1):
        self.prompts = tasks.PromptSampler(examples, cfg.batch_size // cfg.num_generations, cfg.seed, rank,
                                           world_size)
        self.examples, self.cfg = self.prompts.examples, cfg
        self.rates = {}  # prompt -> fraction of right answers at its last visit
        self.sampling = None  # the trainer's sampler, counting what it decodes (sample_with)

    def state_dict(self):
        return {**self.prompts.state_dict(), "rates": self.rates}

    def load_state_dict(self, state):
        self.prompts.load_state_dict(state)
        self.rates = dict(state.get("rates", {}))

    def next(self):
        """(examples, num_samples) for trainer.generate, each group's rows adjacent: the prompts with G samples
        each, or (knapsack) each prompt n_i times with one sample each. Each drawn example is a copy, one object
        per group, which exploration.group_ids tells apart (a prompt drawn twice is two groups)."""
        cfg, batch = self.cfg, [dict(ex) for ex in self.prompts.next()]
        if cfg.budget == "uniform":
            return batch, cfg.num_generations
        sizes = exploration.knapsack_allocation([self.rates.get(ex["prompt"], math.nan) for ex in batch],
                                                cfg.batch_size, cfg.min_n, cfg.max_n)
        return [ex for ex, n in zip(batch, sizes) for _ in range(n)], 1

    def record(self, examples, correct):
        """Remember each group's fraction of right answers (correct: (B,) 0/1, rows as `examples`) for its
        prompt's next visit. Returns the groups: (B,) each row's group id (exploration.group_ids)."""
        groups, outcome = exploration.group_ids(examples, correct.device), {}  # group -> (prompt, answers' 0/1)
        for group, example, right in zip(groups.tolist(), examples, correct.tolist()):
            outcome.setdefault(group, (example["prompt"], []))[1].append(right)
        for prompt, rights in outcome.values():
            self.rates[prompt] = sum(rights) / len(rights)
        return groups

    def sample_with(self, independent):
        """The trainer's sampler (its `sample`): `independent` (fast.generate or common.generate), or with
        --sampler tree TreePO's, each counting the tokens it decodes (tree.Sampling)."""
        self.sampling = tree.Sampling(self.cfg, independent)
        return self.sampling

    def subgroups(self, rollout, groups):
        """What each row's baseline runs over: None (every group G adjacent rows: the algorithm's own function), its
        group ((B,) groups: --budget knapsack) or its ancestors in its group's tree ((B, depth): --sampler tree)."""
        cfg = self.cfg
        if cfg.sampler == "tree":
            return exploration.tree_ancestors(rollout.completion_ids, rollout.mask.sum(1), groups, cfg.segment_len,
                                              cfg.depth)
        return None if cfg.budget == "uniform" else groups

    def metrics(self, rewards, adv, groups):
        """The groups' metrics (exploration.group_metrics) and the tokens decoded per completion sampled."""
        return {**exploration.group_metrics(rewards, adv, groups), **self.sampling.metrics()}


def gathered(accelerator, ids):
    """Every process's group or ancestor ids (None stays None) in one tensor, made distinct across processes (rank r
    adds r * B to its ids; -1, no ancestor, stays)."""
    if ids is None:
        return None
    return accelerator.gather(torch.where(ids >= 0, ids + len(ids) * accelerator.process_index, -1))
