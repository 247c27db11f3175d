"""The group methods' prompt sampler: the step's prompts (tasks.PromptSampler, batch_size / G of them) and how many
completions each gets: G each (--budget uniform) or a knapsack allocation of the same batch_size completions
(--budget knapsack, exploration.knapsack_allocation) from each prompt's success rate (SuccessRates: its latest 16
answers across visits, once it has 8); with --sampler tree, the trees the groups are sampled as (lab/tree.py) and
what their baselines run over."""
import math
from dataclasses import dataclass

import torch

import exploration
from lab import priority, tasks, tree
from support.config import arg, check, check_rules, one_of


@dataclass
class ExplorationConfig:
    """The exploration flags of GRPO, RLOO and DAPO (docs/exploration.md), before lab/config.py's GroupConfig in their
    Config's bases: its checks run after GroupConfig's. batch_size / G prompts a step either way. --budget knapsack:
    G is the mean group size, each prompt's between --min_n and --max_n, and a success rate needs answers.
    --sampler tree (TreePO: the G completions are the leaves of a tree whose branches share their segments): G
    leaves, each fork before the completion's end."""
    SAMPLERS = ("independent", "vllm", "tree")  # lab/config.py's LabConfig's --sampler, and the trees
    budget: str = arg("uniform", "Completions per prompt: uniform (G each) | knapsack (Knapsack RL: by each prompt's "
                      "success rate over its latest answers, batch_size in all).")
    min_n: int = arg(None, "--budget knapsack: the fewest completions of a prompt (default 2).")
    max_n: int = arg(None, "--budget knapsack: the most completions of a prompt (default 4 G).")
    segment_len: int = arg(None, "--sampler tree: the tokens a branch decodes before it forks (default 1).")
    branching: int = arg(None, "--sampler tree: the children of a fork (default 2).")
    depth: int = arg(None, "--sampler tree: the forks from the prompt down (default 3): branching^depth = G leaves.")
    prompt_sampling: str = arg("uniform", "Which prompts a step draws: uniform (shuffled passes) | priority (Kimi "
                               "k1.5: with probability 1 - the prompt's success rate; lab/priority.py) | curriculum "
                               "(Kimi k1.5: easiest first, by --difficulty_column).")
    difficulty_column: str = arg(None, "--prompt_sampling curriculum: the dataset column of each prompt's "
                                 "difficulty, a number (lower is easier).")

    def __post_init__(self):
        super().__post_init__()
        G, knapsack, trees = self.num_generations, self.budget == "knapsack", self.sampler == "tree"
        check_rules(self, budget=one_of("uniform", "knapsack"),
                    prompt_sampling=one_of("uniform", "priority", "curriculum"))
        check((self.prompt_sampling == "curriculum") == bool(self.difficulty_column), "--prompt_sampling curriculum "
              "sorts the prompts by --difficulty_column: give both, or neither.")
        check(knapsack or (self.min_n, self.max_n) == (None, None), "--min_n and --max_n bound --budget knapsack's "
              "group sizes; --budget uniform gives every prompt --num_generations.")
        check(trees or (self.segment_len, self.branching, self.depth) == (None, None, None), "--segment_len, "
              "--branching and --depth shape --sampler tree's trees; the other samplers sample each completion alone.")
        check(not (knapsack and trees), "--sampler tree grows G leaves per prompt and --budget knapsack gives each "
              "prompt its own number: use one of them.")
        if knapsack:
            self.min_n = 2 if self.min_n is None else self.min_n
            self.max_n = 4 * G if self.max_n is None else self.max_n
            check(self.min_n >= 2, f"--min_n must be >= 2: a group of one has no baseline (got {self.min_n}).")
            check(self.min_n <= G <= self.max_n, f"--budget knapsack shares --batch_size ({self.batch_size}) among "
                  f"{self.batch_size // G} prompts: --num_generations ({G}), their mean, must lie in "
                  f"[--min_n, --max_n] = [{self.min_n}, {self.max_n}].")
            check(self.answer_column or self.dataset == "arithmetic", "--budget knapsack allocates by success "
                  "rate: --answer_column '' gives no correctness.")
        if trees:
            defaults = {"segment_len": 1, "branching": 2, "depth": 3}
            L, b, d = [defaults[k] if vars(self)[k] is None else vars(self)[k] for k in defaults]
            self.segment_len, self.branching, self.depth = L, b, d
            check(L >= 1 and b >= 2 and d >= 1, "--sampler tree needs --segment_len >= 1, --branching >= 2 and "
                  "--depth >= 1.")
            check(b ** d == G, f"--sampler tree: --branching {b} and --depth {d} grow {b ** d} leaves, not "
                  f"--num_generations ({G}): a tree that cannot fill the group.")
            check((d - 1) * L < self.max_new_tokens, f"--sampler tree: the last fork, after {(d - 1) * L} tokens, "
                  f"must come before --max_new_tokens ({self.max_new_tokens}).")
            check(self.keep_routing == "none", "--sampler tree does not record a mixture-of-experts sampler's "
                  "routing: give --keep_routing none.")


class SuccessRates:
    """Each prompt's success rate as Knapsack RL estimates it: the fraction of right answers among its latest
    `window` answers (16), across visits, once it has `trusted` of them (8); before that NaN, a prompt the knapsack
    treats as unseen (the uniform share). One visit of a few samples is noisy: 2 answers read as all right or all
    wrong with probability >= 1/2 whatever p is, and the prompt would get --min_n again.

        rates = SuccessRates()
        rates.record("1+1=", [1, 0, 1, 1])   # after each visit: its answers, 0/1
        rates.rate("1+1=")                    # before the next: NaN (4 answers < 8), later their mean
    """

    def __init__(self, window=16, trusted=8):
        self.window, self.trusted = window, trusted
        self.answers = {}  # prompt -> its latest answers (0/1), oldest first, at most `window`

    def record(self, prompt, rights):
        self.answers[prompt] = (self.answers.get(prompt, []) + [float(r) for r in rights])[-self.window:]

    def rate(self, prompt):
        answers = self.answers.get(prompt, [])
        return sum(answers) / len(answers) if len(answers) >= self.trusted else math.nan

    def state_dict(self):
        return {"answers": self.answers}

    def load_state_dict(self, state):
        self.answers = {prompt: list(answers) for prompt, answers in state.get("answers", {}).items()}


class BudgetSampler:
    """Draws prompts as tasks.PromptSampler (the same draws), remembers each prompt's answers (`record`) and
    allocates the step's completions. Every process allocates its own --batch_size over its own prompts, from its
    own memory (each draws from its own shard): every process holds batch_size rows, as DDP's steps need."""

    def __init__(self, examples, cfg, rank=0, world_size=1):
        self.rates = SuccessRates()
        prompts, extra = {"priority": (priority.PrioritisedPrompts, {"rate": self.rates.rate}),  # Kimi k1.5: 1 - s_i
                          "curriculum": (priority.CurriculumPrompts, {"column": cfg.difficulty_column,  # easy first
                                                                      "num_draws": cfg.num_steps}),
                          }.get(cfg.prompt_sampling, (tasks.PromptSampler, {}))
        self.prompts = prompts(examples, cfg.batch_size // cfg.num_generations, cfg.seed, rank, world_size, **extra)
        self.examples, self.cfg = self.prompts.examples, cfg
        self.sampling = None  # the trainer's sampler, counting what it decodes (sample_with)

    def state_dict(self):
        return {**self.prompts.state_dict(), "success_rates": self.rates.state_dict()}

    def load_state_dict(self, state):
        self.prompts.load_state_dict(state)
        self.rates.load_state_dict(state.get("success_rates", {}))

    def next(self):
        """(examples, num_samples) for trainer.generate, each group's rows adjacent: the prompts with G samples
        each, or (knapsack) each prompt n_i times with one sample each. Each drawn example is a copy, one object
        per group, which exploration.group_ids tells apart (a prompt drawn twice is two groups)."""
        cfg, batch = self.cfg, [dict(ex) for ex in self.prompts.next()]
        if cfg.budget == "uniform":
            return batch, cfg.num_generations
        sizes = exploration.knapsack_allocation([self.rates.rate(ex["prompt"]) for ex in batch],
                                                cfg.batch_size, cfg.min_n, cfg.max_n)
        return [ex for ex, n in zip(batch, sizes) for _ in range(n)], 1

    def record(self, rollout, correct):
        """Remember each group's answers (correct: (B,) 0/1, the rollout's rows) in its prompt's success rate.
        Returns (groups, subgroups): (B,) each row's group id (exploration.group_ids), and what each row's baseline
        runs over (`subgroups`)."""
        examples = rollout.examples
        groups, outcome = exploration.group_ids(examples, correct.device), {}  # group -> (prompt, answers' 0/1)
        for group, example, right in zip(groups.tolist(), examples, correct.tolist()):
            outcome.setdefault(group, (example["prompt"], []))[1].append(right)
        for prompt, rights in outcome.values():
            self.rates.record(prompt, rights)
        return groups, self.subgroups(rollout, groups)

    def sample_with(self, independent):
        """The rollouts' sample function (engine.Trainer asks for it once): `independent` (decode.generate or
        common.generate), or with --sampler tree TreePO's, each counting the tokens it decodes (tree.Sampling)."""
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
