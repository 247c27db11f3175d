"""The grader's inputs: for every exercise, the cases its function is called on, drawn from a seed
(classroom/grade.py draws a new one for each run). The grade compares what the student's function returns
on each case (type, shape, dtype, values, and the gradients a case names) with what the reference returns.

The cases are built to tell apart the wrong answers a student plausibly writes (classroom/wrong_answers.py):
several rows of different lengths, one that fills the width and one of a single token; padding that holds
NaN, inf or +-1e6; more padding columns than any row needs; an EOS in the last column; groups whose rewards
are all equal in float32; ratios on both sides of the clip and past it in the padding; ties; the error an
unknown mode raises. A gradient is checked where the docstring makes it part of the answer: the loss's
through logp (or the values), and a detach (the advantage, the return, a weight) as a zero gradient.
"""
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from teacher_tests.batches import F64, GARBAGE, lengths, prefix_mask

F32 = torch.float32


@dataclass
class Case:
    label: str
    args: list
    kwargs: dict = field(default_factory=dict)
    grad: tuple = ()  # the inputs whose gradients are checked: an index of args or a keyword


def generator(seed, salt):
    return torch.Generator().manual_seed(seed * 7919 + salt)


def padded(x, mask, fill):
    """x where mask is 1, fill elsewhere (a fill of None: random values)."""
    if fill is None:
        fill_values = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3)) * 3
    else:
        fill_values = torch.full_like(x, fill)
    return torch.where(mask.bool(), x, fill_values)


def widened(x, extra, fill=0):
    """x with `extra` more columns of `fill` on the right (padding no row reaches)."""
    return torch.cat([x, torch.full((x.shape[0], extra), fill, dtype=x.dtype)], dim=1)


def fill_name(fill):
    return "random values" if fill is None else repr(fill)


# ---------------------------------------------------------------------------------------------- common.py

def kl_estimator(seed):
    g = generator(seed, 1)
    logp = -torch.rand(4, 6, dtype=F64, generator=g) * 4
    ref = logp + torch.randn(4, 6, dtype=F64, generator=g) * 1.5
    logp32 = -torch.rand(8, dtype=F32, generator=g) * 3
    ref32 = logp32 + torch.linspace(-8, 8, 8, dtype=F32)
    return [Case("a (4, 6) batch", [logp, ref], grad=(0, 1)),
            Case("float32 log-ratios from -8 to 8", [logp32, ref32], grad=(0, 1)),
            Case("equal log-probs", [logp[0], logp[0].clone()], grad=(0, 1))]


def kl_penalty(seed):
    g = generator(seed, 2)
    logp = -torch.rand(3, 5, dtype=F64, generator=g) * 3
    ref = logp + torch.randn(3, 5, dtype=F64, generator=g)
    cases = [Case(estimator, [logp, ref], {"estimator": estimator}, grad=(0,)) for estimator in ("k1", "k2", "k3")]
    cases.append(Case("the default estimator", [logp, ref], grad=(0,)))
    cases.append(Case("float32, the default estimator", [logp.float(), ref.float()], grad=(0,)))
    return cases


def random_batch(g, B=5, T=7, dtype=F64):
    n = lengths(B, T, g)
    return torch.randn(B, T, dtype=dtype, generator=g), prefix_mask(n, T), n


def masked_reduction(seed, salt, empty_rows):
    g = generator(seed, salt)
    x, mask, _ = random_batch(g)
    cases = [Case(f"padding {fill_name(fill)}, dim {dim}", [padded(x, mask, fill), mask], {"dim": dim})
             for fill in GARBAGE for dim in (None, 0, 1)]
    cases.append(Case("padding random values, with gradient", [padded(x, mask, None), mask, 1], grad=(0,)))
    cases.append(Case("a bool mask, dim -1", [padded(x, mask, float("nan")), mask.bool(), -1]))
    cases.append(Case("a float mask, three padding columns", [widened(padded(x, mask, 1e6), 3, 1e6),
                                                             widened(mask, 3).double()]))
    cases.append(Case("float32", [padded(x.float(), mask, float("nan")), mask, 1]))
    cases.append(Case("one row", [padded(x, mask, float("nan"))[0], mask[0]]))
    if empty_rows:
        empty = mask.clone()
        empty[1:3] = 0
        one = torch.zeros_like(mask)
        one[2, 4] = 1
        cases += [Case("two empty rows, dim 1", [padded(x, empty, float("nan")), empty, 1]),
                  Case("no valid token", [padded(x, mask, 7.0), torch.zeros_like(mask)]),
                  Case("one valid token", [padded(x, one, float("nan")), one])]
    return cases


def masked_whiten(seed):
    g = generator(seed, 3)
    x, mask, _ = random_batch(g)
    x = 3.0 * x + 2.0
    cases = [Case(f"padding {fill_name(fill)}, shift_mean {shift}", [padded(x, mask, fill), mask],
                  {"shift_mean": shift}) for fill in GARBAGE for shift in (True, False)]
    two = torch.zeros_like(mask)
    two[1, 0] = two[3, 2] = 1
    one = torch.zeros_like(mask)
    one[4, 1] = 1
    cases += [Case("two valid tokens", [padded(x, two, float("nan")), two]),
              Case("one valid token", [padded(x, one, float("nan")), one]),
              Case("a constant", [padded(torch.full_like(x, 2.5), mask, float("nan")), mask]),
              Case("eps 0.5, three padding columns", [widened(padded(x, mask, -1e6), 3, float("nan")),
                                                      widened(mask, 3)], {"eps": 0.5}),
              Case("float32", [padded(x.float(), mask, float("inf")), mask], {"shift_mean": False})]
    return cases


def completion_mask(seed):
    g = generator(seed, 4)
    cases = []
    for eos, T in ((3, 6), (0, 5), (7, 1)):
        ids = torch.randint(0, 8, (12, T), generator=g)
        if T > 1:
            ids[0] = torch.randint(0, 8, (T,), generator=g)
            ids[0][ids[0] == eos] = eos + 1
            ids[0, -1] = eos  # the EOS in the last column
            ids[1] = ids[0]
            ids[1, -1] = eos + 1  # no EOS: cut at the limit
            ids[2] = eos  # EOS first, and again later
            ids[3, 0] = eos
        ids = ids[torch.randperm(12, generator=g)]
        cases.append(Case(f"(12, {T}) ids, EOS {eos}", [ids, eos]))
    cases.append(Case("one row without an EOS", [torch.tensor([[1, 2, 4, 5]]), 3]))
    return cases


def aggregate_loss(seed):
    g = generator(seed, 5)
    x, mask, _ = random_batch(g)
    modes = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    cases = [Case(f"{mode}, padding {fill_name(fill)}", [padded(x, mask, fill), mask, mode])
             for mode in modes for fill in GARBAGE]
    short = widened(padded(x, mask, float("nan")), 3, float("nan")), widened(mask, 3)  # every row shorter
    for mode in modes:
        cases.append(Case(f"{mode}, three padding columns", [*short, mode]))
        cases.append(Case(f"{mode}, max_len 9, with gradient", [padded(x, mask, None), mask, mode, 9], grad=(0,)))
    one = torch.zeros_like(mask)
    one[4, 0] = 1
    cases += [Case("token-mean of one valid token", [padded(x, one, float("nan")), one, "token-mean"]),
              Case("seq-mean-token-sum-norm, max_len 5", [padded(x, mask, 0.0), mask, "seq-mean-token-sum-norm"],
                   {"max_len": 5}),
              Case("an unknown mode", [x, mask, "token-sum"]),
              # a micro-batch's Aggregation (mode, max_len, weight), as the loops pass it
              Case("a micro-batch's seq-mean-token-sum-norm, max_len 9, weight 0.25",
                   [padded(x, mask, float("nan")), mask, ("seq-mean-token-sum-norm", 9, 0.25)], grad=(0,)),
              Case("a micro-batch's token-mean, weight 0.6", [padded(x, mask, None), mask, ("token-mean", None, 0.6)],
                   grad=(0,))]
    return cases


def reward_to_go(seed):
    g = generator(seed, 7)
    x, mask, _ = random_batch(g)
    cases = [Case(f"padding {fill_name(fill)}", [padded(x, mask, fill), mask]) for fill in GARBAGE]
    cases += [Case("three padding columns", [widened(padded(x, mask, float("nan")), 3, 2.0), widened(mask, 3)]),
              Case("with gradient", [padded(x, mask, None), mask], grad=(0,)),
              Case("one row", [x[:1], torch.ones(1, 7, dtype=torch.long)]),
              Case("float32", [padded(x.float(), mask, float("nan")), mask])]
    return cases


# ---------------------------------------------------------------------------------------------- lab/corrections.py

def truncated_is_weight(seed):
    g = generator(seed, 10)
    logp = -torch.rand(4, 6, dtype=F64, generator=g) * 3
    rollout = logp + torch.randn(4, 6, dtype=F64, generator=g)
    return [Case(f"cap {cap}", [logp, rollout, cap], grad=(0, 1)) for cap in (1.0, 2.0, 10.0)] + \
        [Case("float32, cap 2", [logp.float(), rollout.float(), 2.0], grad=(0,))]


def geometric_sequence_mask(seed):
    """Rows with a known mean log-ratio log(pi_old / pi_theta): 2 delta, delta / 2 and their negatives, of
    every length, with advantages of both signs, small and zero."""
    g, delta, T = generator(seed, 8), 0.1, 6
    drift = torch.tensor([2, 0.5, -2, -0.5] * 6, dtype=F64) * delta
    adv = torch.tensor([-1.0] * 4 + [-0.01] * 4 + [0.0] * 4 + [0.5] * 4 + [1.0] * 8, dtype=F64)
    n = torch.randint(1, T + 1, (24,), generator=g)
    n[0], n[2] = 6, 6
    mask = prefix_mask(n, T)
    logp = torch.randn(24, T, dtype=F64, generator=g)
    wiggle = torch.randn(24, T, dtype=F64, generator=g) * mask  # zero mean over each row's valid tokens
    wiggle = wiggle - (wiggle.sum(1, keepdim=True) / n[:, None]) * mask
    old = logp + drift[:, None] + wiggle
    cases = [Case(f"padding {fill_name(fill)}", [padded(logp, mask, fill), padded(old, mask, -fill), adv, mask,
                                                  delta]) for fill in GARBAGE]
    cases.append(Case("with gradient", [logp, old, adv, mask, delta], grad=(0, 1)))
    exact = prefix_mask(torch.tensor([1, 2, 4]), 4)  # a drift of exactly delta (0.125 in binary) is kept
    zeros = torch.zeros(3, 4, dtype=F64)
    cases.append(Case("a drift of exactly delta", [zeros, padded(zeros + 0.125, exact, 9.0),
                                                    -torch.ones(3, dtype=F64), exact, 0.125]))
    cases.append(Case("float32", [logp.float(), old.float(), adv.float(), mask, delta]))
    return cases


# ---------------------------------------------------------------------------------------------- lab/losses.py

def ratio_weighted_kl(seed):
    g = generator(seed, 11)
    logp = -torch.rand(3, 5, dtype=F64, generator=g) * 3
    ref = logp + torch.randn(3, 5, dtype=F64, generator=g)
    old = logp + torch.randn(3, 5, dtype=F64, generator=g) * 0.5
    cases = []
    for estimator in ("k1", "k2", "k3"):
        cases.append(Case(f"{estimator} weighted by the ratio", [logp, ref, old], {"estimator": estimator}, grad=(0,)))
        cases.append(Case(f"{estimator}, on-policy (old_logp = logp's value)", [logp, ref, logp.clone()],
                          {"estimator": estimator}, grad=(0,)))
    cases.append(Case("the default estimator", [logp, ref, old], grad=(0,)))
    for far in (5.0, 25.0, 40.0):  # float32: the ratio-weighted k3 must keep its gradient far from the reference
        logp32 = torch.tensor([-1.0, -2.0]) - torch.rand(2, generator=g)
        cases.append(Case(f"float32 k3 weighted by the ratio, log(ref / pi) = {far:g}",
                          [logp32, logp32 + far, logp32.clone()], {"estimator": "k3"}, grad=(0,)))
    return cases


# ---------------------------------------------------------------------------------------------- remax, rloo

def remax_advantages(seed):
    g = generator(seed, 90)
    r, greedy = torch.randn(6, dtype=F64, generator=g), torch.randn(6, dtype=F64, generator=g)
    return [Case("(6,) rewards", [r, greedy]), Case("float32", [r.float(), greedy.float()]),
            Case("binary rewards", [(r > 0).double(), (greedy > 0).double()])]


B, T = 5, 6


def rollout(seed, salt):
    """log-probs whose ratios fall on both sides of a 0.2 clip, advantages of both signs."""
    g = generator(seed, salt)
    n = lengths(B, T, g)
    mask = prefix_mask(n, T)
    old_logp = -torch.rand(B, T, dtype=F64, generator=g) * 3
    logp = old_logp + torch.randn(B, T, dtype=F64, generator=g) * 0.6
    ref_logp = old_logp + torch.randn(B, T, dtype=F64, generator=g) * 0.3
    adv = torch.randn(B, dtype=F64, generator=g)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1
    logp[0, 0], logp[1, 0] = old_logp[0, 0] + 0.5, old_logp[1, 0] - 0.5  # clipped above (A > 0) and below (A < 0)
    logp[0, 1], logp[1, 1] = old_logp[0, 1] - 0.5, old_logp[1, 1] + 0.5  # past the clip, but not clipped
    return logp, old_logp, ref_logp, adv, mask


def spoil(mask, fill, *tensors):
    """Padding of every tensor set to `fill` (logp to fill + 5: a ratio far past any clip when finite)."""
    return [padded(t, mask, None if fill is None else fill + 5.0 * (i == 0)) for i, t in enumerate(tensors)]


def remax_loss(seed):
    logp, _, ref_logp, adv, mask = rollout(seed, 17)
    kl = logp - ref_logp
    cases = []
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        for fill in GARBAGE[::2]:
            spoilt_logp, spoilt_kl = spoil(mask, fill, logp, kl)
            cases.append(Case(f"{mode}, padding {fill_name(fill)}", [spoilt_logp, adv, spoilt_kl, mask, 0.3, mode]))
        cases.append(Case(f"{mode}, with gradient", [logp, adv, kl, mask, 0.3, mode], grad=(0, 1, 2)))
    cases.append(Case("seq-mean-token-sum-norm, max_len 8, three padding columns",
                      [widened(logp, 3), adv, widened(kl, 3, float("nan")), widened(mask, 3), 0.5,
                       ("seq-mean-token-sum-norm", 8)], grad=(0,)))
    cases.append(Case("a micro-batch's aggregation: token-mean, weight 0.25",
                      [logp, adv, kl, mask, 0.3, ("token-mean", None, 0.25)], grad=(0,)))
    return cases


def rloo_advantages(seed):
    g = generator(seed, 21)
    cases = [Case(f"groups of {K}", [torch.randn(4 * K, dtype=F64, generator=g), K]) for K in (2, 3, 5)]
    cases.append(Case("float32, an all-equal group", [torch.cat([torch.full((4,), 0.7), torch.rand(8, generator=g)]),
                                                      4]))
    return cases


def rloo_loss(seed):
    logp, _, _, adv, mask = rollout(seed, 18)
    cases = [Case(f"padding {fill_name(fill)}", [padded(logp, mask, fill), adv, mask]) for fill in GARBAGE]
    cases += [Case("with gradient", [padded(logp, mask, None), adv, mask], grad=(0, 1)),
              Case("a micro-batch's aggregation, weight 0.5", [logp, adv, mask, ("seq-mean-token-sum", None, 0.5)],
                   grad=(0,)),
              Case("three padding columns", [widened(logp, 3, float("nan")), adv, widened(mask, 3)], grad=())]
    return cases


# ---------------------------------------------------------------------------------------------- grpo, dapo

def grpo_advantages(seed):
    g, G = generator(seed, 31), 4
    rewards = torch.randn(5 * G, dtype=F64, generator=g)
    rewards[G:2 * G] = 0.7  # an all-equal group
    rewards[2 * G:3 * G] = 0.3 + torch.arange(G) * 1e-9  # a tiny std: eps matters
    rewards32 = torch.cat([torch.rand(7, generator=g), torch.full((7,), 0.7), torch.rand(14, generator=g)])
    cases = []
    for scale in ("group", "batch", "none"):
        cases.append(Case(f"scale_rewards {scale}", [rewards, G, scale]))
        cases.append(Case(f"scale_rewards {scale}, float32 groups of 7 with an all-equal one", [rewards32, 7, scale]))
    cases += [Case("the default scale, eps 1e-4", [rewards[G:], 2], {"eps": 1e-4}),
              Case("binary rewards, groups of 8", [(torch.rand(24, generator=g) < 0.5).float(), 8]),
              Case("an unknown scale_rewards", [rewards, G, "groups"])]
    return cases


# A common.Aggregation (mode, max_len, weight) or Clip (low, high, level) travels to the student's process as the
# plain tuple of its fields, which the losses take as well.
def loss_cases(seed, salt, loss, configs, grid, defaults=None):
    """Cases of a clipped loss: `configs` (label, kwargs, over the keyword arguments `defaults`) on a rollout with
    NaN and inf padding and with random padding and a gradient; `grid`, cases of hand values. loss(logp, old_logp,
    ref_logp, adv, token_adv, mask) -> the arguments (token_adv: (B, T) advantages, PPO's)."""
    logp, old_logp, ref_logp, adv, mask = rollout(seed, salt)
    weight = torch.rand(B, T, dtype=F64, generator=generator(seed, salt + 1)) * 2
    token_adv = adv[:, None] * torch.rand(B, T, dtype=F64, generator=generator(seed, salt + 2))
    cases = []
    for label, kwargs in configs:
        for fill in (float("nan"), float("inf"), None):
            spoilt = spoil(mask, fill, logp, old_logp, ref_logp, token_adv)
            args = loss(*spoilt[:3], adv, spoilt[3], mask)
            kw = {**(defaults or {}), **kwargs}
            if kw.get("pg_weight") == "weight":
                kw["pg_weight"] = spoil(mask, fill, weight)[0]
            cases.append(Case(f"{label}, padding {fill_name(fill)}", args, kw, grad=(0,) if fill is None else ()))
    return cases + grid


# Hand values: advantages -0.5, 0, 0.5 by ratios 0.5, 1, 4 with epsilon 0.2: clipped below only A = -0.5 at 0.5,
# above only A = 0.5 at 4.
GRID_ADV = torch.tensor([-0.5, 0.0, 0.5], dtype=F64)
GRID_LOG_RATIO = torch.log(torch.tensor([0.5, 1.0, 4.0], dtype=F64)).expand(3, 3).clone()


def clipped_surrogate(seed):
    g = generator(seed, 9)
    ratio = torch.exp(torch.randn(B, T, dtype=F64, generator=g) * 0.5)
    adv = torch.randn(B, 1, dtype=F64, generator=g)
    adv[0], adv[1] = 0.7, -0.7
    token_adv = torch.randn(B, T, dtype=F64, generator=g)
    grid = torch.exp(GRID_LOG_RATIO).expand(3, 3).clone()
    return [Case("hand values: the clip grid, clip 0.2 / 0.28", [grid, GRID_ADV[:, None].clone(), (0.2, 0.28)],
                 grad=(0, 1)),
            Case("(B, T) ratios, (B, 1) advantages, clip 0.2", [ratio, adv, (0.2, 0.2)], grad=(0, 1)),
            Case("per-token advantages, clip 0.1 / 0.3 at token level", [ratio, token_adv, (0.1, 0.3, "token")],
                 grad=(0, 1)),
            Case("clip 0", [ratio, token_adv, (0.0, 0.0)], grad=(0, 1)),
            Case("float32, a ratio on each bound", [torch.tensor([[0.8, 1.28, 1.0, 0.5, 3.0]]),
                                                    torch.tensor([[1.0], [-1.0]]), (0.2, 0.28)], grad=(0,))]


def clip_stats(seed):
    logp, old_logp, _, adv, mask = rollout(seed, 10)
    token_adv = adv[:, None] * torch.rand(B, T, dtype=F64, generator=generator(seed, 8))
    cases = []
    for fill in GARBAGE[::2]:
        log_ratio = padded(logp - old_logp, mask, fill)
        ratio = padded(torch.exp(logp - old_logp), mask, fill)
        cases.append(Case(f"padding {fill_name(fill)}", [ratio, log_ratio, adv[:, None], mask, (0.2, 0.2)]))
        cases.append(Case(f"per-token advantages, clip 0.2 / 0.28, padding {fill_name(fill)}",
                          [ratio, log_ratio, padded(token_adv, mask, fill), mask, (0.2, 0.28)]))
    sequence = torch.exp(masked_mean_rows(logp - old_logp, mask))[:, None].expand(B, T).clone()
    cases.append(Case("GSPO: the sequence's ratio, the tokens' log-ratios",
                      [sequence, logp - old_logp, adv[:, None], mask, (3e-4, 4e-4, "sequence")]))
    grid = torch.exp(GRID_LOG_RATIO).expand(3, 3).clone()
    cases.append(Case("hand values: the clip grid", [grid, torch.log(grid), GRID_ADV[:, None].clone(),
                                                     torch.ones(3, 3, dtype=torch.long), (0.2, 0.28)]))
    between = torch.tensor([[1.25, 1.1, 1.3], [0.78, 0.85, 1.25]], dtype=F64)  # between the two clips, and past
    sides = torch.tensor([[0.5], [-0.5]], dtype=F64)
    cases.append(Case("ratios between the two clips, clip 0.2 / 0.28",
                      [between, torch.log(between), sides, torch.ones(2, 3, dtype=torch.long), (0.2, 0.28)]))
    edges = torch.tensor([[0.75, 1.25, 1.0], [0.75, 1.25, 1.0]], dtype=F64)  # exactly 1 -+ 0.25: not clipped
    cases.append(Case("ratios exactly on the clip's edges, clip 0.25",
                      [edges, torch.log(edges), sides, torch.ones(2, 3, dtype=torch.long), (0.25, 0.25)]))
    cases.append(Case("no valid token", [grid, torch.log(grid), GRID_ADV[:, None].clone(),
                                         torch.zeros(3, 3, dtype=torch.long), (0.2, 0.2)]))
    return cases


def masked_mean_rows(x, mask):
    return torch.where(mask.bool(), x, 0.0).sum(1) / mask.sum(1).clamp(min=1)


def grpo_loss(seed):
    norm8 = ("seq-mean-token-sum-norm", 8)  # as the loop passes it, with --max_new_tokens 8
    gspo = (0.2, 0.2, "sequence")
    configs = [("token-mean", {"loss_agg": "token-mean"}),
               ("the defaults", {}),
               ("seq-mean-token-sum-norm, max_len 8", {"loss_agg": norm8}),
               ("seq-mean-token-sum-norm", {"loss_agg": "seq-mean-token-sum-norm"}),
               ("a micro-batch: seq-mean-token-mean, weight 0.5",
                {"loss_agg": ("seq-mean-token-mean", None, 0.5)}),
               ("k2", {"kl_estimator": "k2"}),
               ("k2, token-mean", {"kl_estimator": "k2", "loss_agg": "token-mean"}),
               ("k1", {"kl_estimator": "k1"}),
               ("epsilon_high 0.28", {"clip": (0.2, 0.28), "loss_agg": "token-mean"}),
               ("GSPO", {"clip": gspo}),
               ("GSPO, seq-mean-token-sum-norm, max_len 8", {"clip": gspo, "loss_agg": norm8}),
               ("GSPO, a micro-batch's seq-mean-token-sum-norm, weight 0.5",
                {"clip": gspo, "loss_agg": ("seq-mean-token-sum-norm", 8, 0.5)}),
               ("GSPO, k1, token-mean", {"clip": gspo, "kl_estimator": "k1", "loss_agg": "token-mean"})]
    ones = torch.ones(3, 3, dtype=torch.long)
    grid = [Case("hand values: the clip grid", [GRID_LOG_RATIO, torch.zeros(3, 3, dtype=F64), None, GRID_ADV, ones,
                                                (0.2, 0.2), 0.0, "token-mean"], grad=(0,)),
            Case("on-policy, epsilon 0", [torch.zeros(3, 3, dtype=F64), torch.zeros(3, 3, dtype=F64), None, GRID_ADV,
                                          ones, (0.0, 0.0), 0.0, "token-mean"], grad=(0,))]
    cases = loss_cases(seed, 11, lambda logp, old, ref, adv, token_adv, mask: [logp, old, ref, adv, mask],
                       configs, grid, defaults={"clip": (0.2, 0.2), "beta": 0.05})
    logp, old_logp, _, adv, mask = rollout(seed, 12)
    cases.append(Case("no reference (beta 0)", [logp, old_logp, None, adv, mask, (0.2, 0.2), 0.0], grad=(0,)))
    cases.append(Case("a Clip's fields as a plain tuple", [logp, old_logp, None, adv, mask, (0.1, 0.3), 0.0],
                      grad=(0,)))
    return cases


def dynamic_sampling_filter(seed):
    g, G = generator(seed, 41), 5
    kind = torch.randint(0, 3, (12,), generator=g)  # 0: all wrong, 1: all right, 2: mixed
    kind[:3] = torch.tensor([0, 1, 2])
    groups = []
    for k in kind.tolist():
        if k < 2:
            groups.append(torch.full((G,), float(k)))
        else:
            row = (torch.rand(G, generator=g) < 0.5).float()
            row[int(torch.randint(0, G, (1,), generator=g))] = 1 - row[0] if row.min() == row.max() else row[0]
            groups.append(row)
    correct = torch.cat(groups)
    return [Case("12 groups of 5", [correct, G]), Case("bool, groups of 3", [correct[:15].bool(), 3]),
            Case("groups of 2", [correct[:12], 2])]


def overlong_penalty(seed):
    g = generator(seed, 51)
    max_len = int(torch.randint(8, 20, (1,), generator=g))
    cache_len = int(torch.randint(1, max_len - 2, (1,), generator=g))
    L = torch.arange(1, max_len + 4)
    return [Case(f"max_len {max_len}, cache_len {cache_len}", [L, max_len, cache_len]),
            Case("cache_len 0", [L, max_len, 0]),
            Case("cache_len max_len", [L, max_len, max_len]),
            Case("random lengths, float", [torch.randint(1, 40, (9,), generator=g).double(), 30, 7])]


def dapo_loss(seed):
    configs = [("epsilons 0.2 and 0.28", {}), ("epsilons 0.1 and 0.3", {"clip": (0.1, 0.3)}),
               ("a micro-batch's token-mean, weight 0.5", {"loss_agg": ("token-mean", None, 0.5)})]
    ones = torch.ones(3, 3, dtype=torch.long)
    grid = [Case("hand values: the clip grid", [GRID_LOG_RATIO, torch.zeros(3, 3, dtype=F64), GRID_ADV, ones,
                                                (0.2, 0.28)], grad=(0,)),
            Case("equal epsilons", [GRID_LOG_RATIO, torch.zeros(3, 3, dtype=F64), GRID_ADV, ones, (0.2, 0.2)],
                 grad=(0,)),
            Case("on-policy, epsilons 0", [torch.zeros(3, 3, dtype=F64), torch.zeros(3, 3, dtype=F64), GRID_ADV, ones,
                                           (0.0, 0.0)], grad=(0,)),
            Case("ratios between the two clips", [torch.log(torch.tensor([[1.25], [0.78], [1.1]], dtype=F64)),
                                                  torch.zeros(3, 1, dtype=F64), torch.tensor([0.5, -0.5, 0.5],
                                                                                             dtype=F64),
                                                  torch.ones(3, 1, dtype=torch.long), (0.2, 0.28)], grad=(0,))]
    return loss_cases(seed, 13, lambda logp, old, ref, adv, token_adv, mask: [logp, old, adv, mask],
                      configs, grid, defaults={"clip": (0.2, 0.28)})


# ---------------------------------------------------------------------------------------------- ppo

def gae(seed):
    g = generator(seed, 61)
    n = lengths(B, 7, g)
    mask = prefix_mask(n, 7)
    rewards, values = torch.randn(B, 7, dtype=F64, generator=g), torch.randn(B, 7, dtype=F64, generator=g)
    lam = torch.rand(B, dtype=F64, generator=g)
    cases = [Case(f"padding {fill_name(fill)}", [padded(rewards, mask, fill), padded(values, mask, fill), mask, 0.9,
                                                 0.8]) for fill in GARBAGE]
    cases += [Case("one lambda per row, padding nan", [padded(rewards, mask, float("nan")),
                                                       padded(values, mask, float("nan")), mask, 0.95, lam]),
              Case("gamma 1, lambda 1", [rewards, values, mask, 1.0, 1.0]),
              Case("lambda 0", [rewards, values, mask, 0.9, 0.0]),
              Case("three padding columns", [widened(rewards, 3, 5.0), widened(values, 3, 5.0), widened(mask, 3),
                                             0.99, 0.95]),
              Case("float32", [rewards.float(), values.float(), mask, 0.9, 0.7]),
              Case("one token", [rewards[:, :1], values[:, :1], mask[:, :1], 0.9, 0.8])]
    actions = mask * (torch.rand(B, 7, generator=g) < 0.6).long()  # an episode's: the environment's tokens between
    actions[:, 0] = 1
    cases.append(Case("an episode's actions, the environment's tokens between (nan)",
                      [padded(rewards, actions, float("nan")), padded(values, actions, float("nan")), actions, 0.9,
                       0.8]))
    return cases


def decoupled_gae(seed):
    g = generator(seed, 71)
    n = lengths(4, 6, g)
    mask = prefix_mask(n, 6)
    rewards = padded(torch.randn(4, 6, dtype=F64, generator=g), mask, float("nan"))
    values = padded(torch.randn(4, 6, dtype=F64, generator=g), mask, float("nan"))
    return [Case(f"lambdas {a} and {c}", [rewards, values, mask, 0.95, a, c])
            for a, c in ((0.6, 1.0), (1.0, 0.3), (0.0, 0.9))]


def reinforce_pp_advantages(seed):
    g = generator(seed, 95)
    n = lengths(6, 7, g)
    mask = prefix_mask(n, 7)
    kl = torch.randn(6, 7, dtype=F64, generator=g)
    rewards = (torch.rand(6, generator=g) < 0.5).double()
    cases = [Case(f"padding {fill_name(fill)}", [rewards, padded(kl, mask, fill), mask, 0.1]) for fill in (0.0, None)]
    cases += [Case("padding NaN, beta 0.5", [rewards, padded(kl, mask, float("nan")), mask, 0.5]),
              Case("groups of 3 (the baseline variant)", [rewards, padded(kl, mask, None), mask, 0.1, 3]),
              Case("groups of 2, more padding columns", [rewards, widened(kl, 2, 7.0), widened(mask, 2), 0.2, 2]),
              Case("float32, beta 0", [rewards.float(), kl.float(), mask, 0.0])]
    return cases


def length_reward(seed):
    g = generator(seed, 97)
    lengths_ = torch.randint(1, 30, (12,), generator=g)
    lengths_[4:8] = 9  # a group of equal lengths
    correct = (torch.rand(12, generator=g) < 0.5).long()
    return [Case("groups of 4, one all equal", [lengths_, correct, 4]),
            Case("groups of 6, all right", [lengths_, torch.ones(12), 6]),
            Case("groups of 3, float lengths", [lengths_.double(), correct.double(), 3])]


def priority_weights(seed):
    g = generator(seed, 99)
    rates = torch.rand(9, generator=g)
    some_solved = rates.clone()
    some_solved[::3] = 1.0
    return [Case("random rates, float32", [rates]), Case("a third solved", [some_solved.double()]),
            Case("every prompt solved", [torch.ones(5)]), Case("none solved yet", [torch.zeros(4)])]


def length_adaptive_lam(seed):
    g = generator(seed, 81)
    alpha = float(torch.rand(1, generator=g)) * 0.2 + 0.02
    return [Case(f"alpha {alpha:.3f}", [torch.randint(1, 200, (50,), generator=g), alpha]),
            Case("alpha 0.125, lengths 1 to 16", [torch.arange(1, 17), 0.125])]


def ppo_policy_loss(seed):
    configs = [("epsilon 0.2", {}), ("clip-higher 0.2 / 0.28", {"clip": (0.2, 0.28)}),
               ("a micro-batch's token-mean, weight 0.5", {"loss_agg": ("token-mean", None, 0.5)})]
    ones = torch.ones(3, 3, dtype=torch.long)
    grid_adv = GRID_ADV[:, None].expand(3, 3).clone()
    grid = [Case("hand values: the clip grid", [GRID_LOG_RATIO, torch.zeros(3, 3, dtype=F64), grid_adv, ones],
                 {"clip": (0.2, 0.2)}, grad=(0,)),
            Case("on-policy, epsilon 0", [torch.zeros(3, 3, dtype=F64), torch.zeros(3, 3, dtype=F64), grid_adv, ones],
                 {"clip": (0.0, 0.0)}, grad=(0,))]
    return loss_cases(seed, 14, lambda logp, old, ref, adv, token_adv, mask: [logp, old, token_adv, mask],
                      configs, grid, defaults={"clip": (0.2, 0.2)})


def ppo_value_loss(seed):
    g = generator(seed, 16)
    n = lengths(B, T, g)
    mask = prefix_mask(n, T)
    old = torch.randn(B, T, dtype=F64, generator=g)
    values = old + torch.randn(B, T, dtype=F64, generator=g) * 0.5
    values[0, :2] = old[0, :2]  # ties: the clipped and the unclipped terms are equal
    returns = torch.randn(B, T, dtype=F64, generator=g)
    cases = [Case(f"padding {fill_name(fill)}", [*spoil(mask, fill, values, old, returns), mask, 0.2],
                  grad=(0,) if fill is None else ()) for fill in (*GARBAGE, None)]
    cases.append(Case("epsilon_value 0.05", [values, old, returns, mask, 0.05], grad=(0,)))
    return cases



# ---------------------------------------------------------------------------------------------- vapo.py

def positive_example_nll(seed):
    logp, _, _, _, mask = rollout(seed, 101)
    correct = (torch.rand(B, generator=generator(seed, 102)) < 0.5).to(F64)
    correct[0], correct[1] = 1.0, 0.0  # a correct and a wrong sample at least
    tokens = int((mask * correct[:, None]).sum())
    cases = [Case(f"padding {fill_name(fill)}", [padded(logp, mask, fill), mask, correct], grad=(0,))
             for fill in (*GARBAGE, None)]
    cases += [Case("a micro-batch of 3 rows, N of the whole given (int)", [logp[:3], mask[:3], correct[:3]],
                   {"num_tokens": tokens}, grad=(0,)),
              Case("a micro-batch of 2 rows, N as a float tensor", [logp[3:], mask[3:], correct[3:]],
                   {"num_tokens": torch.tensor(float(tokens))}, grad=(0,)),
              Case("no correct sample", [logp, mask, torch.zeros(B, dtype=F64)], grad=(0,)),
              Case("every sample correct, float32", [logp.float(), mask, torch.ones(B)], grad=(0,))]
    return cases

# ---------------------------------------------------------------------------------------------- objectives.py

def objective_cases(seed, salt, configs, hand_kwargs):
    """A clipped objective's cases: loss_cases on (logp, old_logp, adv, mask), each config's clip or gate in its
    keyword arguments, and the hand-value grid (ratios 0.5, 1, 4 by advantages -0.5, 0, 0.5)."""
    ones = torch.ones(3, 3, dtype=torch.long)
    grid = [Case("hand values: the clip grid", [GRID_LOG_RATIO, torch.zeros(3, 3, dtype=F64), GRID_ADV.clone(), ones],
                 hand_kwargs, grad=(0,)),
            Case("on-policy", [torch.zeros(3, 3, dtype=F64), torch.zeros(3, 3, dtype=F64), GRID_ADV.clone(), ones],
                 hand_kwargs, grad=(0,))]
    logp, old_logp, _, adv, mask = rollout(seed, salt)
    weight = padded(torch.rand(B, T, dtype=F64, generator=generator(seed, salt + 3)) * 2, mask, float("nan"))
    grid.append(Case("pg_weight NaN in the padding, with gradient", [logp, old_logp, adv, mask],
                     {**hand_kwargs, "pg_weight": weight}, grad=(0,)))
    return loss_cases(seed, salt, lambda logp, old, ref, adv, token_adv, mask: [logp, old, adv, mask], configs, grid)


def cispo_loss(seed):
    configs = [("clip 0.2 / 0.28", {"clip": (0.2, 0.28)}), ("TRL's cap 5, no lower bound", {"clip": (1.0, 4.0)}),
               ("seq-mean-token-mean, pg_weight", {"clip": (0.2, 0.2), "loss_agg": "seq-mean-token-mean",
                                                   "pg_weight": "weight"}),
               ("a micro-batch: token-mean, weight 0.25", {"clip": (0.1, 0.3), "loss_agg": ("token-mean", None, 0.25)})]
    return objective_cases(seed, 111, configs, {"clip": (0.2, 0.2)})


def sapo_loss(seed):
    configs = [("the defaults", {}),
               ("tau 2 / 3, token-mean", {"tau_pos": 2.0, "tau_neg": 3.0, "loss_agg": "token-mean"}),
               ("pg_weight", {"pg_weight": "weight"}),
               ("a micro-batch: weight 0.5", {"tau_neg": 0.5, "loss_agg": ("seq-mean-token-mean", None, 0.5)})]
    return objective_cases(seed, 115, configs, {"tau_pos": 1.0, "tau_neg": 4.0})


def gmpo_loss(seed):
    configs = [("the defaults", {}), ("clip 0.2 / 0.3", {"clip": (0.2, 0.3)}), ("pg_weight", {"pg_weight": "weight"}),
               ("token-mean given, weight 0.5: still per sequence", {"loss_agg": ("token-mean", None, 0.5)})]
    return objective_cases(seed, 119, configs, {"clip": (0.4, 0.4)})


# ---------------------------------------------------------------------------------------------- opd.py

def opd_advantages(seed):
    logp, _, teacher_logp, adv, mask = rollout(seed, 123)
    cases = [Case(f"padding {fill_name(fill)}", [*spoil(mask, fill, logp, teacher_logp), adv], grad=(0,))
             for fill in (float("nan"), None)]
    cases += [Case("lambda 0.5, w 2", [logp, teacher_logp, adv, 0.5, 2.0], grad=(0, 1, 2)),
              Case("w 1 only (no KL)", [logp, teacher_logp, adv], {"kl_coef": 0.0, "reward_weight": 1.0}),
              Case("float32", [logp.float(), teacher_logp.float(), adv.float(), 2.0])]
    return cases


def opd_loss(seed):
    logp, _, teacher_logp, adv, mask = rollout(seed, 127)
    token_adv = -(logp - teacher_logp) + adv[:, None]
    full_kl = (logp - teacher_logp) ** 2
    cases = [Case(f"padding {fill_name(fill)}", [*spoil(mask, fill, logp, token_adv), mask], grad=(0,) if fill is None
                  else ()) for fill in (float("nan"), float("inf"), None)]
    cases += [Case("the lesson's aggregation, with gradient", [logp, token_adv, mask, "seq-mean-token-sum"],
                   grad=(0, 1)),
              Case("full_kl, lambda 0.5, padding NaN", [padded(logp, mask, 1.0), padded(token_adv, mask, float("nan")),
                                                        mask, "token-mean", padded(full_kl, mask, float("nan")), 0.5],
                   grad=(0, 4)),
              Case("a micro-batch: seq-mean-token-sum, weight 0.25", [logp, token_adv, mask,
                                                                      ("seq-mean-token-sum", None, 0.25)], grad=(0,))]
    return cases


def full_reverse_kl(seed):
    g = generator(seed, 131)
    student = torch.randn(3, 4, 6, dtype=F64, generator=g).log_softmax(-1)
    teacher = torch.randn(3, 4, 6, dtype=F64, generator=g).log_softmax(-1)
    peaked = torch.tensor([[[0.0, -30.0, -30.0]]], dtype=F64).log_softmax(-1)
    return [Case("(3, 4) positions, a vocabulary of 6", [student, teacher], grad=(0,)),
            Case("equal distributions", [student, student.clone()], grad=(0,)),
            Case("a peaked student", [peaked, torch.full((1, 1, 3), -math.log(3), dtype=F64)], grad=(0,)),
            Case("float32", [student.float(), teacher.float()], grad=(0,))]


# ---------------------------------------------------------------------------------------------- agents.py

def episode_masks(seed):
    g = generator(seed, 61)
    B, S = 6, 5
    lengths = torch.randint(0, 4, (B, S), generator=g)
    lengths[lengths == 3] = 0  # empty segments anywhere in a row, a third of them
    lengths[0] = torch.tensor([2, 0, 3, 0, 1])  # empty segments between others
    lengths[1] = torch.tensor([0, 0, 0, 0, 4])  # one segment, at the end
    is_action = torch.rand(B, S, generator=g) < 0.5
    is_action[0] = torch.tensor([True, True, False, False, True])  # each empty segment of another kind
    is_action[1, 4] = bool(torch.rand(1, generator=g) < 0.5)
    is_action[2] = True
    is_action[2, 0] = False  # the environment first, then actions to the end: the padding must not follow them
    lengths[2, 0] = 2
    width = int(lengths.sum(1).max())
    hand = torch.tensor([[3, 4, 2, 0]]), torch.tensor([[True, False, True, False]])
    return [Case("(6, 5) random segments, as wide as the longest row", [lengths, is_action, width]),
            Case("four padding columns more", [lengths, is_action, width + 4]),
            Case("the docstring's example, an empty segment last", [*hand, 10]),
            Case("one segment of the environment", [torch.tensor([[3]]), torch.tensor([[False]]), 5]),
            Case("one segment of the model's, no padding", [torch.tensor([[3]]), torch.tensor([[True]]), 3]),
            Case("a row of empty segments beside a full one", [torch.tensor([[0, 0], [1, 2]]),
                                                               torch.tensor([[True, True], [False, True]]), 4])]


# ---------------------------------------------------------------------------------------------- toy_bandit.py

def two_arm(seed, with_baseline=False, with_bernoulli=False):
    rng = np.random.default_rng(seed * 7919 + 101)
    p = np.concatenate([rng.uniform(0.01, 0.99, 7), [0.5, 2 / 3]])
    r1, r0 = rng.uniform(-1, 2, 2)
    q1, q0 = rng.uniform(0, 1, 2)
    b = rng.uniform(-1, 2, 9)
    cases = [Case("an array of p", [p, float(r1), float(r0)]), Case("one p", [float(p[0]), float(r1), float(r0)]),
             Case("Bernoulli means", [p, float(q1), float(q0)]), Case("rewards 1 and 0 (ints)", [p, 1, 0])]
    if with_baseline:
        cases = [Case(c.label + ", a baseline", c.args + [float(b[0])]) for c in cases]
        cases += [Case("a baseline per p", [p, float(r1), float(r0), b]),
                  Case("one p, an array of baselines", [0.3, float(r1), float(r0), b])]
    if with_bernoulli:
        cases += [Case(c.label + ", Bernoulli rewards", c.args, {"bernoulli": True}) for c in cases
                  if "Bernoulli" in c.label or "per p" in c.label]
    return cases


def softmax_bandit(seed, with_baseline=False, with_bernoulli=False):
    rng = np.random.default_rng(seed * 7919 + 103)
    theta, r = rng.normal(size=5), rng.uniform(0, 1, 5)
    tie = np.array([0.3, 1.2, -0.5, 1.2])
    cases = [Case("5 arms", [theta, r]), Case("two arms", [theta[:2], r[:2]]),
             Case("a tie for the likeliest arm", [tie, np.array([0.1, 0.9, 0.4, 0.2])]),
             Case("rewards of both signs", [theta, rng.normal(size=5)])]
    if with_baseline:
        b = rng.uniform(-1, 2, 4)
        cases = [Case(c.label + ", a baseline", c.args + [float(b[0])]) for c in cases]
        cases.append(Case("an array of baselines", [theta, r, b]))
    if with_bernoulli:
        cases += [Case("5 arms, Bernoulli rewards", [theta, r, 0.4], {"bernoulli": True}),
                  Case("an array of baselines, Bernoulli rewards", [theta, r, np.array([0.0, 0.5])],
                       {"bernoulli": True})]
    return cases


# "file::function" -> cases(seed)
CASES = {
    "common.py::kl_k1": kl_estimator,
    "common.py::kl_k2": kl_estimator,
    "common.py::kl_k3": kl_estimator,
    "common.py::kl_penalty": kl_penalty,
    "common.py::masked_sum": lambda seed: masked_reduction(seed, 1, empty_rows=False),
    "common.py::masked_mean": lambda seed: masked_reduction(seed, 2, empty_rows=True),
    "common.py::masked_whiten": masked_whiten,
    "common.py::completion_mask": completion_mask,
    "common.py::aggregate_loss": aggregate_loss,
    "common.py::reward_to_go": reward_to_go,
    "common.py::clipped_surrogate": clipped_surrogate,
    "common.py::clip_stats": clip_stats,
    "lab/corrections.py::truncated_is_weight": truncated_is_weight,
    "lab/corrections.py::geometric_sequence_mask": geometric_sequence_mask,
    "lab/losses.py::ratio_weighted_kl": ratio_weighted_kl,
    "remax.py::remax_advantages": remax_advantages,
    "remax.py::remax_loss": remax_loss,
    "rloo.py::rloo_advantages": rloo_advantages,
    "rloo.py::rloo_loss": rloo_loss,
    "grpo.py::grpo_advantages": grpo_advantages,
    "grpo.py::grpo_loss": grpo_loss,
    "dapo.py::grpo_advantages": grpo_advantages,
    "dapo.py::dynamic_sampling_filter": dynamic_sampling_filter,
    "dapo.py::overlong_penalty": overlong_penalty,
    "dapo.py::dapo_loss": dapo_loss,
    "ppo.py::gae": gae,
    "vapo.py::decoupled_gae": decoupled_gae,
    "reinforce_pp.py::reinforce_pp_advantages": reinforce_pp_advantages,
    "kimi.py::length_reward": length_reward,
    "kimi.py::priority_weights": priority_weights,
    "vapo.py::length_adaptive_lam": length_adaptive_lam,
    "ppo.py::ppo_policy_loss": ppo_policy_loss,
    "ppo.py::ppo_value_loss": ppo_value_loss,
    "vapo.py::positive_example_nll": positive_example_nll,
    "objectives.py::cispo_loss": cispo_loss,
    "objectives.py::sapo_loss": sapo_loss,
    "objectives.py::gmpo_loss": gmpo_loss,
    "opd.py::rloo_advantages": rloo_advantages,
    "opd.py::opd_advantages": opd_advantages,
    "opd.py::opd_loss": opd_loss,
    "opd.py::full_reverse_kl": full_reverse_kl,
    "agents.py::episode_masks": episode_masks,
    "toy_bandit.py::gradient_variance": lambda seed: two_arm(seed, with_baseline=True, with_bernoulli=True),
    "toy_bandit.py::optimal_baseline": two_arm,
    "toy_bandit.py::two_arm_baselines": two_arm,
    "toy_bandit.py::softmax_gradient_variance": lambda seed: softmax_bandit(seed, with_baseline=True,
                                                                            with_bernoulli=True),
    "toy_bandit.py::softmax_optimal_baseline": softmax_bandit,
    "toy_bandit.py::softmax_baselines": softmax_bandit,
}
