"""Random batches for the hidden tests: several rows of different lengths, padding that holds
anything (NaN, inf, huge values), one row that fills the width. The seed comes from GRADE_SEED
(classroom/grade.py draws a new one for every grading run; 0 otherwise)."""
import os

import torch

SEED = int(os.environ.get("GRADE_SEED", "0"))
F64 = torch.float64
GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e6, -1e6]


def generator(salt):
    return torch.Generator().manual_seed(SEED * 7919 + salt)


def lengths(B, T, g, low=1):
    """(B,) lengths in [low, T]: one row fills the width, one has `low` tokens, the others are random."""
    n = torch.randint(low, T + 1, (B,), generator=g)
    n[0], n[1] = T, low
    return n[torch.randperm(B, generator=g)]


def prefix_mask(n, T):
    return (torch.arange(T)[None, :] < n[:, None]).long()


def padded(x, mask, fill):
    """x where mask is 1, fill elsewhere."""
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


def widened(x, extra, fill):
    """x with `extra` more columns of `fill` on the right (more padding)."""
    return torch.cat([x, torch.full((x.shape[0], extra), fill, dtype=x.dtype)], dim=1)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=tol, atol=tol)


def token_weighted(values, n):
    """The batch value of a per-token mean from its per-row values: sum_b n_b v_b / sum_b n_b."""
    values, n = torch.as_tensor(values, dtype=F64), n.to(F64)
    return (values * n).sum() / n.sum()
