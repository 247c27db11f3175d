"""Kimi k1.5's prioritised sampling (Kimi Team, 2025, section 2.3.4) as the group methods' prompt draw: each step's
prompts drawn from this process's shard with probability proportional to 1 - s_i (kimi.priority_weights), s_i the
prompt's success rate as budget.BudgetSampler keeps it for the knapsack. `--prompt_sampling priority`."""
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
