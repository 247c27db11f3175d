"""Exploration budgets: how many completions each prompt gets, and the group baselines that follow.

A group whose answers are all right or all wrong has A = 0 for every member: with a uniform budget the easy and
the hard prompts spend their samples on no gradient. Knapsack RL (Li et al., 2025, arXiv 2509.25849) gives each
prompt its own number of samples n_i, chosen by a knapsack over the value of n samples at success rate p; the
groups then differ in size, and GRPO's standardising, RLOO's leave-one-out and DAPO's filter run per group id.
TreePO (Li et al., 2025, arXiv 2508.17445) samples a group as a tree of shared segments; a leaf's advantage
averages its group-relative advantage over the sub-groups of its ancestors.

A module of its own, beside common.py: this is math of the three group methods (GRPO, RLOO, DAPO), not of all
five, and it is an option the loops call in one line each. Pure functions: tensors or lists in, tensors or
lists out, no model and no accelerator. Equations: docs/algorithms.md, "Exploration budgets".
"""
import math

import torch


# ----------------------------------------------------------------------------------------
# Knapsack RL: the budget's allocation
# ----------------------------------------------------------------------------------------
def knapsack_value(n, p):
    """V(n, p) = (1 - p^n - (1 - p)^n) * p (1 - p)^2: the chance that n samples at success rate p hold both a right
    and a wrong answer (a non-zero gradient), times the information of that gradient (Knapsack RL, eq. 6)."""
    return (1 - p ** n - (1 - p) ** n) * p * (1 - p) ** 2


def knapsack_allocation(success_rates, budget, min_n, max_n, default_n=None, fallback=True):
    """The number of completions of each prompt: a list of ints in [min_n, max_n] that sums to `budget`.

    success_rates: each prompt's success rate (lab/budget.py's SuccessRates), NaN for a prompt not trusted yet.
    An unseen prompt gets default_n (default: the uniform budget // len(success_rates), within [min_n, max_n]);
    an all-right (p = 1) or all-wrong (p = 0) one gets min_n: V = 0 at any n. fallback (Knapsack RL's rule, before
    the knapsack runs): a prompt with 0 < p < 1 can use min_n + floor(ln 0.1 / ln max(p, 1 - p)) samples (within
    max_n; 90% that a group of that many holds both answers); the budget beyond what the useful prompts can use goes
    to the all-wrong prompts first, one sample to each in turn up to max_n. The useful prompts share what is left
    by dynamic programming, maximising sum_i V(n_i, p_i) over (prompt, budget used); the budget V has no use for
    (every such prompt at max_n, or a gain that rounds to 0) goes in the same way to the all-wrong prompts, then to
    the unseen, the all-right and the others. fallback=False: no fallback, the knapsack first.
    """
    P = len(success_rates)
    if not P * min_n <= budget <= P * max_n:
        raise ValueError(f"a budget of {budget} cannot give {P} prompts each between {min_n} and {max_n} samples")
    default_n = min(max(budget // P if default_n is None else default_n, min_n), max_n)
    unseen = [math.isnan(p) for p in success_rates]
    useful = [i for i, p in enumerate(success_rates) if 0 < p < 1]  # NaN compares False: not useful
    wrong = [i for i in range(P) if success_rates[i] == 0]
    n = [default_n if unseen[i] else min_n for i in range(P)]
    left = budget - sum(n)
    if left < 0:  # the unseen defaults do not fit: they get min_n too, and the turns below share the rest
        n, left = [min_n] * P, budget - P * min_n
    else:
        if fallback:  # what the useful prompts cannot use, beyond their min_n, goes to the all-wrong prompts first
            usable = sum(min(max_n, min_n + int(math.log(0.1) / math.log(max(success_rates[i], 1 - success_rates[i]))))
                         - min_n for i in useful)
            excess = max(left - usable, 0)
            left = left - excess + _deal(n, wrong, excess, max_n)  # what they cannot take stays for the knapsack
        left += len(useful) * min_n  # the useful prompts' min_n goes back into the knapsack
        chosen = _knapsack([success_rates[i] for i in useful], left, min_n, max_n)
        for i, k in zip(useful, chosen):
            n[i] = k
        left -= sum(chosen)
    # the budget the knapsack did not use: to each prompt of a tier in turn, up to max_n, before the next tier
    for tier in (wrong, [i for i in range(P) if unseen[i]], [i for i in range(P) if success_rates[i] == 1], useful):
        left = _deal(n, tier, left, max_n)
    return n


def _deal(n, tier, left, max_n):
    """Give `left` samples one at a time to each prompt of `tier` in turn (n[i] += 1), up to max_n; what is left."""
    while left > 0 and any(n[i] < max_n for i in tier):
        for i in tier:
            if left > 0 and n[i] < max_n:
                n[i], left = n[i] + 1, left - 1
    return left


def _knapsack(rates, capacity, min_n, max_n):
    """argmax over n_i in [min_n, max_n], sum_i n_i <= capacity, of sum_i V(n_i, p_i): a list of ints.
    best[c] = the largest value of the prompts so far with c samples used; a tie keeps the smaller n."""
    if not rates:
        return []
    NEG = -math.inf
    best = torch.full((capacity + 1,), NEG, dtype=torch.float64)
    best[0] = 0.0
    choices = []  # per prompt: (capacity + 1,) the n that reaches best[c]
    for p in rates:
        new = torch.full_like(best, NEG)
        pick = torch.zeros(capacity + 1, dtype=torch.long)
        for k in range(min_n, min(max_n, capacity) + 1):
            candidate = torch.full_like(best, NEG)
            candidate[k:] = best[:capacity + 1 - k] + knapsack_value(k, p)
            better = candidate > new
            new, pick = torch.where(better, candidate, new), torch.where(better, k, pick)
        best = new
        choices.append(pick)
    c = int(torch.argmax(best))  # the first maximum: the fewest samples at the best value
    out = []
    for pick in reversed(choices):
        out.append(int(pick[c]))
        c -= out[-1]
    return out[::-1]


# ----------------------------------------------------------------------------------------
# Groups of different sizes: each row's group by id
# ----------------------------------------------------------------------------------------
def group_ids(examples, device=None):
    """(B,) long: each row's group, 0, 1, ... in order, for rows whose group's members are adjacent and share
    one example object (lab/budget.py copies each drawn example, so a prompt drawn twice is two groups)."""
    ids = [0]
    for previous, example in zip(examples, examples[1:]):
        ids.append(ids[-1] + (example is not previous))
    return torch.tensor(ids[:len(examples)], device=device)


def _per_group(values, group_ids):
    """(sum, count, inverse): the sum and the size of each group, and each row's index into them."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num = int(inverse.max()) + 1
    total = torch.zeros(num, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    count = torch.zeros(num, dtype=values.dtype, device=values.device).index_add_(0, inverse, torch.ones_like(values))
    return total, count, inverse


def all_equal(values, group_ids):
    """(num_groups,) bool: True for a group whose values are all equal (a group of one included)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num = int(inverse.max()) + 1
    start = torch.zeros(num, dtype=values.dtype, device=values.device)
    high = (start - math.inf).scatter_reduce(0, inverse, values, "amax")
    low = (start + math.inf).scatter_reduce(0, inverse, values, "amin")
    return high == low


def grpo_advantages_by_group(rewards, group_ids, scale_rewards="group", eps=1e-6):
    """GRPO's A_i = (r_i - mean(r_g)) / (std(r_g) + eps) with g the group of row i, for groups of any size.

    std is Bessel's (ddof = 1) as in grpo_advantages; a group whose rewards are all equal, or a group of one
    (no baseline), gets exactly 0. scale_rewards: 'group' | 'batch' (the std of all rows) | 'none'. group_ids
    (B, D), each row's ancestors in a tree: TreePO's advantage (tree_advantages). Returns (B,).
    """
    if group_ids.dim() == 2:  # each row's ancestors in its tree (--sampler tree)
        return tree_advantages(rewards, group_ids, scale_rewards, eps)
    total, count, inverse = _per_group(rewards, group_ids)
    adv = rewards - (total / count)[inverse]
    adv[all_equal(rewards, group_ids)[inverse]] = 0.0  # the mean of equal floats may round
    if scale_rewards == "group":
        squares, _, _ = _per_group(adv ** 2, group_ids)
        adv = adv / ((squares / (count - 1).clamp(min=1)).sqrt()[inverse] + eps)
    elif scale_rewards == "batch":
        adv = adv / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return adv


def rloo_advantages_by_group(rewards, group_ids):
    """RLOO's A_i = r_i - mean_{j != i in g} r_j, for groups of any size; a group of one (no other sample to
    be its baseline) gets 0; (B, D) ancestors: the mean over them, as tree_advantages. Returns (B,)."""
    if group_ids.dim() == 2:
        return tree_advantages(rewards, group_ids, baseline=rloo_advantages_by_group)
    total, count, inverse = _per_group(rewards, group_ids)
    others = (count - 1)[inverse]
    return torch.where(others > 0, rewards - (total[inverse] - rewards) / others.clamp(min=1), 0.0)


def group_metrics(rewards, adv, group_ids):
    """What a batch's groups hold: the fraction of groups whose rewards are all equal (A = 0, no gradient), the
    rows with a non-zero advantage (effective samples), and the groups' sizes (the allocation)."""
    _, count, _ = _per_group(rewards, group_ids)
    return {"train/frac_zero_std_groups": all_equal(rewards, group_ids).float().mean(),
            "train/effective_samples": (adv != 0).sum().float(),
            "train/group_size_min": count.min(), "train/group_size_max": count.max(),
            "train/group_size_std": count.std() if len(count) > 1 else count.new_zeros(())}


# ----------------------------------------------------------------------------------------
# TreePO: advantages on a tree of shared segments
# ----------------------------------------------------------------------------------------
def tree_advantages(rewards, ancestors, scale_rewards="none", eps=1e-6, baseline=None):
    """TreePO's segment-level advantage of each leaf (each completion) of a sampled tree.

    rewards: (L,) the leaves' rewards; ancestors: (L, D) long, the ids of each leaf's ancestor nodes from the
    root (column 0, the prompt) down, -1 where a leaf has none at that depth (it ended early). Each ancestor a
    defines a sub-group S(a), the leaves below it; the leaf's advantage is the mean over its ancestors of
    (r_i - mean_{S(a)} r) / (std_{S(a)} r + eps) ('group') or of r_i - mean_{S(a)} r ('none'); 'batch' divides
    the latter by the std of all rewards. `baseline` (rewards, ids) -> (n,) replaces the sub-group's advantage
    (RLOO's leave-one-out). With depth 1 (every leaf a child of the root) it is the group's advantage. Returns (L,).
    """
    if baseline is None:
        scale = "none" if scale_rewards == "batch" else scale_rewards
        baseline = lambda r, ids: grpo_advantages_by_group(r, ids, scale, eps)  # noqa: E731
    total, count = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for d in range(ancestors.shape[1]):
        rows = ancestors[:, d] >= 0
        if rows.any():
            total[rows] += baseline(rewards[rows], ancestors[rows, d])
            count[rows] += 1
    adv = total / count.clamp(min=1)
    return adv / (rewards.std() + eps) if scale_rewards == "batch" else adv


def tree_ancestors(completion_ids, lengths, group_ids, segment_len, depth):
    """(B, depth) each leaf's ancestors in its tree, read back from the leaves: column 0 its group (the root),
    column d the node after d segments, the leaves of its group whose first d * segment_len tokens are its own and
    that were still going there (longer than that). Two branches that sampled the same segment are one node: they
    are the same state. A node that does not split (one leaf, or the same leaves as its parent) is no sub-group of
    its own: -1, as where a leaf had ended."""
    columns = [group_ids]
    for d in range(1, depth):
        cut = d * segment_len
        key = torch.cat([group_ids[:, None], completion_ids[:, :cut]], dim=1)
        _, node = torch.unique(key, dim=0, return_inverse=True)
        columns.append(torch.where(lengths > cut, node, -1))
    ancestors = torch.stack(columns, dim=1)
    sizes = torch.stack([torch.bincount(c.clamp(min=0), weights=(c >= 0).float())[c.clamp(min=0)] * (c >= 0)
                         for c in columns], dim=1)  # (B, depth): the leaves below each ancestor
    splits = torch.ones_like(ancestors, dtype=torch.bool)
    splits[:, 1:] = (sizes[:, 1:] >= 2) & (sizes[:, 1:] < sizes[:, :-1])
    return torch.where(splits, ancestors, -1)
