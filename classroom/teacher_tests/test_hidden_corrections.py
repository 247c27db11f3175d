"""Hidden tests of lab/corrections.py's exercises: random batches of several rows, padding holding NaN, inf or
huge values, drifts of both signs. Each is a property (the result ignores the padding, a row is graded as if
alone), never the formula again."""
import pytest
import torch

from lab import corrections
from teacher_tests.batches import F64, GARBAGE, generator, padded, prefix_mask


@pytest.mark.parametrize("fill", GARBAGE)
def test_geometric_mask_sees_drifts_of_both_signs_through_the_mean_over_valid_tokens(fill):
    """Rows built with a known mean log-ratio log(pi_old / pi_theta): 2 delta, delta / 2 and their
    negatives, over lengths 1 to 6, and advantages of both signs, small and zero; only a drift above
    delta with a negative advantage is dropped."""
    g, delta, T = generator(8), 0.1, 6
    drift = torch.tensor([2, 0.5, -2, -0.5] * 6, dtype=F64) * delta
    adv = torch.tensor([-1.0] * 4 + [-0.01] * 4 + [0.0] * 4 + [0.5] * 4 + [1.0] * 8, dtype=F64)
    B = len(drift)
    n = torch.randint(1, T + 1, (B,), generator=g)
    n[0], n[2] = 6, 6  # a long row whose summed drift would pass delta at either sign
    mask = prefix_mask(n, T)
    logp = torch.randn(B, T, dtype=F64, generator=g)
    wiggle = torch.randn(B, T, dtype=F64, generator=g) * mask  # zero mean over each row's valid tokens
    wiggle = (wiggle - (wiggle.sum(1, keepdim=True) / n[:, None]) * mask)
    old_logp = logp + drift[:, None] + wiggle
    keep = corrections.geometric_sequence_mask(padded(logp, mask, fill), padded(old_logp, mask, -fill), adv, mask,
                                               delta)
    assert keep.shape == (B,) and keep.dtype == F64
    expected = [0.0 if (a < 0 and d > delta) else 1.0 for a, d in zip(adv.tolist(), drift.tolist())]
    assert keep.tolist() == expected


def test_geometric_mask_keeps_a_drift_of_exactly_delta():
    """The drift must pass delta to drop a sequence: rows of 1, 2 and 4 tokens whose mean log-ratio is delta
    exactly in binary (0.125)."""
    delta, n = 0.125, torch.tensor([1, 2, 4])
    mask = prefix_mask(n, 4)
    logp = torch.zeros(3, 4, dtype=F64)
    keep = corrections.geometric_sequence_mask(logp, padded(logp + delta, mask, 9.0), -torch.ones(3, dtype=F64),
                                               mask, delta)
    assert keep.tolist() == [1.0, 1.0, 1.0]
