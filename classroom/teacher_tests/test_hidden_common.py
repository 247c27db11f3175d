"""Hidden tests of common.py's exercises: random batches of several rows, padding holding NaN, inf or
huge values, an EOS in the last column. Each is a property (the result ignores the padding, a row is
graded as if alone, a batch statistic weighs every valid token once), never the formula again."""
import pytest
import torch

import common
from teacher_tests.batches import F64, GARBAGE, close, generator, lengths, padded, prefix_mask, token_weighted, widened


def random_batch(salt, B=5, T=7):
    g = generator(salt)
    n = lengths(B, T, g)
    return torch.randn(B, T, dtype=F64, generator=g), prefix_mask(n, T), n


@pytest.mark.parametrize("fill", GARBAGE)
def test_masked_sum_of_a_padded_batch_ignores_the_padding_and_sums_each_row_alone(fill):
    x, mask, _ = random_batch(1)
    clean = padded(x, mask, 0.0)
    total, rows = common.masked_sum(padded(x, mask, fill), mask), common.masked_sum(padded(x, mask, fill), mask, 1)
    close(total, common.masked_sum(clean, mask))
    close(common.masked_sum(widened(padded(x, mask, fill), 3, fill), widened(mask, 3, 0)), total)
    assert rows.shape == (5,)
    for b in range(5):
        close(rows[b], common.masked_sum(clean[b], mask[b]))
    close(rows.sum(), total)
    columns = common.masked_sum(padded(x, mask, fill), mask, 0)  # along the batch
    assert columns.shape == (7,) and torch.isfinite(columns).all()
    close(columns.sum(), total)


@pytest.mark.parametrize("fill", GARBAGE)
def test_masked_mean_of_a_padded_batch_weighs_every_valid_token_once(fill):
    x, mask, n = random_batch(2)
    x = padded(x, mask, fill)
    rows = common.masked_mean(x, mask, 1)
    assert torch.isfinite(rows).all()
    for b in range(5):
        close(rows[b], common.masked_mean(x[b, :n[b]], torch.ones(int(n[b]))))
    close(common.masked_mean(x, mask), token_weighted(rows, n))
    empty = torch.zeros_like(mask)
    assert common.masked_mean(x, empty, 1).tolist() == [0.0] * 5
    one = torch.zeros_like(mask)
    one[2, 0] = 1  # a single valid token: its own value
    assert common.masked_mean(x, one).item() == x[2, 0].item()


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("fill", GARBAGE)
def test_masked_whiten_of_a_padded_batch_ignores_the_padding_and_leaves_it_zero(fill, shift_mean):
    x, mask, _ = random_batch(3)
    x = 3.0 * x + 2.0
    out = common.masked_whiten(padded(x, mask, fill), mask, shift_mean=shift_mean)
    assert (out[mask == 0] == 0).all(), "the padding must be 0"
    wide = common.masked_whiten(widened(padded(x, mask, fill), 2, fill), widened(mask, 2, 0), shift_mean=shift_mean)
    close(wide[:, :7], out)
    valid, whitened = x[mask.bool()], out[mask.bool()]
    if shift_mean:
        close(whitened.mean(), 0.0)
        close(whitened.std(), 1.0, tol=1e-6)  # eps = 1e-8 inside the square root
    else:  # only the scale changes: the mean stays where it was
        close(whitened.mean(), valid.mean())
        close(whitened.std(), 1.0, tol=1e-6)
    two = torch.zeros_like(mask)
    two[1, 0] = two[3, 2] = 1  # two valid tokens: Bessel's std divides by 1
    out = common.masked_whiten(padded(x, two, fill), two, shift_mean=shift_mean)[two.bool()]
    close(out - out.mean(), torch.tensor([1.0, -1.0], dtype=F64) * (x[1, 0] - x[3, 2]).sign() / 2**0.5, 1e-6)


def test_masked_whiten_of_a_constant_is_zero_not_nan():
    x, mask, _ = random_batch(9)
    out = common.masked_whiten(padded(torch.full_like(x, 2.5), mask, float("nan")), mask)
    assert (out == 0).all()  # var = 0: eps keeps the scale finite


def test_completion_mask_of_random_ids_keeps_each_rows_prefix_through_its_first_eos():
    g, eos, B, T = generator(4), 3, 12, 6
    ids = torch.randint(0, 6, (B, T), generator=g)
    ids[0] = torch.tensor([1, 2, 4, 5, 0, eos])  # the EOS in the last column
    ids[1] = torch.tensor([1, 2, 4, 5, 0, 1])  # no EOS: cut at the limit
    ids[2] = torch.tensor([eos, eos, 1, eos, 2, 2])  # EOS first, and again later
    ids[3] = torch.tensor([eos, 1, 1, 1, 1, 1])
    perm = torch.randperm(B, generator=g)
    ids = ids[perm]
    mask = common.completion_mask(ids, eos)
    assert mask.shape == (B, T) and mask.dtype == torch.long and set(mask.unique().tolist()) <= {0, 1}
    assert (mask[:, 0] == 1).all(), "the first token always counts"
    assert (mask[:, 1:] <= mask[:, :-1]).all(), "the kept tokens are a prefix"
    for b in range(B):
        k = int(mask[b].sum())
        assert eos not in ids[b, :k - 1].tolist(), "no EOS before the last kept token"
        assert k == T or ids[b, k - 1] == eos, "a completion shorter than T ends at its EOS"
    assert mask[(perm == 0).nonzero().item()].tolist() == [1] * 6
    assert mask[(perm == 1).nonzero().item()].tolist() == [1] * 6
    assert mask[(perm == 2).nonzero().item()].tolist() == [1, 0, 0, 0, 0, 0]
    for b in range(B):  # each row alone gives its own mask
        assert torch.equal(common.completion_mask(ids[b:b + 1], eos)[0], mask[b])


@pytest.mark.parametrize("fill", GARBAGE)
def test_aggregate_loss_of_a_padded_batch_ignores_the_padding_and_weighs_tokens_or_rows(fill):
    x, mask, n = random_batch(5)
    loss = padded(x, mask, fill)
    rows = {mode: torch.stack([common.aggregate_loss(loss[b:b + 1], mask[b:b + 1], mode, 9) for b in range(5)])
            for mode in common.LOSS_AGG_MODES}
    for mode in common.LOSS_AGG_MODES:
        value = common.aggregate_loss(loss, mask, mode, 9)
        assert torch.isfinite(value)
        close(common.aggregate_loss(widened(loss, 2, fill), widened(mask, 2, 0), mode, 9), value)
        close(value, token_weighted(rows[mode], n) if mode == "token-mean" else rows[mode].mean())
    one = torch.zeros_like(mask)
    one[4, 0] = 1  # a single valid token in the whole batch
    assert common.aggregate_loss(loss, one, "token-mean").item() == x[4, 0].item()


def test_seq_mean_token_sum_norm_divides_by_the_batch_width_even_when_every_row_is_shorter():
    x, mask, _ = random_batch(6)
    x, mask = widened(padded(x, mask, float("nan")), 3, float("nan")), widened(mask, 3, 0)  # width 10, rows <= 7
    by_default = common.aggregate_loss(x, mask, "seq-mean-token-sum-norm")
    close(by_default, common.aggregate_loss(x, mask, "seq-mean-token-sum-norm", 10))
    close(by_default * 10 / 5, common.aggregate_loss(x, mask, "seq-mean-token-sum-norm", 5))


@pytest.mark.parametrize("fill", GARBAGE)
def test_reward_to_go_of_a_padded_batch_runs_along_each_row_alone(fill):
    x, mask, n = random_batch(7)
    out = common.reward_to_go(padded(x, mask, fill), mask)
    assert torch.isfinite(out).all() and (out[mask == 0] == 0).all()
    close(common.reward_to_go(widened(padded(x, mask, fill), 2, fill), widened(mask, 2, 0))[:, :7], out)
    for b in range(5):
        last = int(n[b]) - 1
        close(out[b, last], x[b, last])  # the last valid token: only itself
        close(out[b, :last], x[b, :last] + out[b, 1:last + 1])  # each token: itself plus the rest of its row
        close(common.reward_to_go(x[b:b + 1, :last + 1], mask[b:b + 1, :last + 1])[0], out[b, :last + 1])
