"""Kimi k1.5 (Kimi Team, 2025, arXiv 2501.12599): the length reward over a prompt's samples, prioritised
prompt sampling by success rate, and curriculum sampling by difficulty. Pure functions, tensors in and out, that
the lab's loops call in one line each: `python lab/grpo.py --length_penalty 0.1`. Equations: docs/algorithms.md,
"Kimi k1.5".
"""
import math

import torch


def length_reward(lengths, correct, group_size):
    """Kimi k1.5's length reward (section 2.3.3) for (B,) completion lengths and (B,) correctness (1 right, 0 wrong),
    each prompt's group_size samples adjacent. Within a group, lam_i = 0.5 - (len_i - min_len) / (max_len - min_len):
    lam_i for a right answer, min(0, lam_i) for a wrong one, so the shortest right answer gains 0.5, the longest
    loses 0.5, and a wrong answer is never rewarded for being short. A group whose lengths are all equal gets 0.
    Lengths need not be integers. Returns (B,) floats, added to the task reward with a weight (--length_penalty)."""
    # BEGIN SOLUTION
    lengths = lengths.float().view(-1, group_size)  # (B / G, G)
    shortest = lengths.min(dim=1, keepdim=True).values
    longest = lengths.max(dim=1, keepdim=True).values
    spread = longest - shortest
    safe = torch.where(spread > 0, spread, 1.0)  # all lengths equal: no 0 / 0 (lam is 0 there); any spread > 0 kept
    lam = torch.where(spread > 0, 0.5 - (lengths - shortest) / safe, 0.0)
    right = correct.view(-1, group_size) > 0
    return torch.where(right, lam, lam.clamp(max=0.0)).view(-1)
    # END SOLUTION


def priority_weights(success_rates):
    """Prioritised sampling (section 2.3.4): prompt i is drawn with probability proportional to 1 - s_i, s_i its
    success rate, so the prompts the policy fails get more of the samples. (N,) rates in [0, 1] in, (N,)
    probabilities out (summing to 1); every prompt solved (all s_i = 1): uniform. A rate outside [0, 1] or NaN
    (a prompt never tried: give it a rate first) is refused with a ValueError."""
    bad = ~((success_rates >= 0) & (success_rates <= 1))  # NaN is neither
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"kimi.priority_weights: success rate {success_rates[i].item()} at prompt {i}; each must "
                         "be in [0, 1] (a prompt never tried has none: give it one, e.g. 0).")
    # BEGIN SOLUTION
    weights = 1.0 - success_rates.double()
    total = weights.sum()
    return weights / total if total > 0 else torch.full_like(weights, 1.0 / len(weights))
    # END SOLUTION


def curriculum_weights(difficulty, draw, num_draws, num_prompts):
    """Curriculum sampling (section 2.3.4): easy prompts first, harder ones as training advances. (N,) difficulties
    (lower is easier) in the shard's order, sorted stably (ties keep that order); draw t of num_draws takes its
    num_prompts prompts uniformly from a window of w = max(num_prompts, ceil(N / num_draws)) consecutive sorted
    prompts starting at floor(min(t, T - 1) (N - w) / (T - 1)), T = num_draws: the easiest w at the first draw, the
    hardest w from the last on. Returns (N,) probabilities, 1 / w inside the window, 0 outside.
    E.g. difficulties [3, 1, 2, 1], num_prompts 1, 2 draws: w = 2, draw 0 the two 1s, draw 1 the 2 and the 3."""
    order = torch.sort(difficulty.double(), stable=True).indices  # easiest first, ties in the shard's order
    n, last = len(order), max(num_draws - 1, 1)
    width = min(n, max(num_prompts, math.ceil(n / num_draws)))
    start = min(draw, last) * (n - width) // last
    weights = torch.zeros(n, dtype=torch.float64)
    weights[order[start:start + width]] = 1.0 / width
    return weights
