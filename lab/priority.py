"""Kimi k1.5's sampling strategies (Kimi Team, 2025, section 2.3.4) as the group methods' prompt draw. Prioritised
(`--prompt_sampling priority`): each step's prompts drawn from this process's shard with probability proportional
to 1 - s_i (kimi.priority_weights), s_i the prompt's success rate as budget.BudgetSampler keeps it for the knapsack.
Curriculum (`--prompt_sampling curriculum --difficulty_column COL`): from a window of the shard sorted by difficulty
that moves from the easiest prompts to the hardest over the run (kimi.curriculum_weights)."""
import math

import torch

import kimi


class PrioritisedPrompts:
    """Draws as tasks.PromptSampler does (batch_size examples of the rank's shard a step), without replacement
    within a step, by weight 1 - s_i instead of shuffled epochs. `rate(prompt)`: the success rate, NaN for a prompt
    without one yet, which counts as s = 0 (the most wanted: it has not been tried). A prompt always solved (s = 1)
    gets a weight of 1e-12: drawn only when fewer than batch_size prompts have any other weight."""

    def __init__(self, examples, batch_size, seed, rank=0, world_size=1, rate=None):
        self.examples, self.batch_size, self.rate = examples[rank::world_size], batch_size, rate
        self.generator = torch.Generator().manual_seed(seed * 7919 + rank)

    def state_dict(self):
        return {"priority_generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state):
        self.generator.set_state(torch.tensor(state["priority_generator"], dtype=torch.uint8))

    def weights(self):
        """(N,) the probability of each example of the shard under prioritised sampling."""
        rates = torch.tensor([self.rate(ex["prompt"]) for ex in self.examples], dtype=torch.float64)
        return kimi.priority_weights(rates.nan_to_num(0.0))

    def next(self):
        weights = self.weights().clamp(min=1e-12)
        index = torch.multinomial(weights, self.batch_size, replacement=False, generator=self.generator)
        return [self.examples[i] for i in index.tolist()]

    def sample_with(self, independent):
        return independent


def difficulty(example, column):
    """The example's difficulty: its dataset row's `column` (an arithmetic example is its own row)."""
    return example.get("row", example).get(column)


def check_difficulty(cfg, examples):
    """--prompt_sampling curriculum: every train example's --difficulty_column holds a number, else one error line."""
    if getattr(cfg, "prompt_sampling", None) != "curriculum":
        return
    for number, example in enumerate(examples, 1):
        row, value = example.get("row", example), difficulty(example, cfg.difficulty_column)
        if cfg.difficulty_column not in row:
            raise SystemExit(f"error: --dataset {cfg.dataset!r} has no column --difficulty_column "
                             f"{cfg.difficulty_column!r}; its columns are {sorted(row)}.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise SystemExit(f"error: --dataset {cfg.dataset!r} train row {number}: --difficulty_column "
                             f"{cfg.difficulty_column!r} holds {value!r:.100}, not a number (lower is easier); "
                             "give the column of each prompt's difficulty.")


class CurriculumPrompts(PrioritisedPrompts):
    """Draws batch_size examples of the rank's shard a step, without replacement, uniformly from the window that
    kimi.curriculum_weights gives draw t of num_draws (--num_steps): the shard shuffled once by the seed, then
    sorted stably by `column`'s difficulty, so tied prompts are in a random order."""

    def __init__(self, examples, batch_size, seed, rank=0, world_size=1, column=None, num_draws=1):
        super().__init__(examples, batch_size, seed, rank, world_size)
        self.examples = [self.examples[i] for i in torch.randperm(len(self.examples), generator=self.generator)]
        self.difficulty = torch.tensor([difficulty(ex, column) for ex in self.examples], dtype=torch.float64)
        self.draw, self.num_draws = 0, num_draws

    def state_dict(self):
        return {**super().state_dict(), "curriculum_draw": self.draw}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.draw = state["curriculum_draw"]

    def weights(self):
        return kimi.curriculum_weights(self.difficulty, self.draw, self.num_draws, self.batch_size)

    def next(self):
        batch = super().next()
        self.draw += 1
        return batch
