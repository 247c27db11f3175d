"""Hidden tests of the losses: statistics and losses on padded batches of several rows whose padding
holds NaN, inf or huge ratios (clipped padding tokens), against the same function on each row alone; and the
lab's ratio-weighted KL term (lab/losses.py), its gradient in float32 far from the reference."""
import math

import pytest
import torch

import common
import dapo
import grpo
import ppo
import remax
import rloo
import vapo
from lab import losses as lab_losses
from teacher_tests.batches import F64, GARBAGE, close, generator, lengths, padded, prefix_mask, token_weighted, widened

B, T = 5, 6
CLIP = common.Clip(0.2, 0.2)


def rollout(salt):
    """log-probs whose ratios fall on both sides of a 0.2 clip, advantages of both signs."""
    g = generator(salt)
    n = lengths(B, T, g)
    mask = prefix_mask(n, T)
    old_logp = -torch.rand(B, T, dtype=F64, generator=g) * 3
    logp = old_logp + torch.randn(B, T, dtype=F64, generator=g) * 0.6
    ref_logp = old_logp + torch.randn(B, T, dtype=F64, generator=g) * 0.3
    adv = torch.randn(B, dtype=F64, generator=g)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1
    logp[0, 0], logp[1, 0] = old_logp[0, 0] + 0.5, old_logp[1, 0] - 0.5  # clipped above (A > 0) and below (A < 0)
    logp[0, 1], logp[1, 1] = old_logp[0, 1] - 0.5, old_logp[1, 1] + 0.5  # past the clip, but not clipped
    return logp, old_logp, ref_logp, adv, mask, n


def spoil(mask, fill, *tensors):
    """Padding of every tensor set to `fill` (logp to fill + 5: a ratio far past any clip when finite)."""
    return [padded(t, mask, fill + 5.0 * (i == 0)) for i, t in enumerate(tensors)]


def check_stats_and_loss(call, tensors, mask, n, fill, mean_over_rows=False):
    """call(tensors..., mask) -> (loss, stats). The padding changes nothing, a wider padding neither,
    and every statistic is the token-weighted mean of the rows' own (the loss too, or the plain
    mean of the rows' losses for a mean over sequences)."""
    clean_loss, clean_stats = call(*tensors, mask)
    loss, stats = call(*spoil(mask, fill, *tensors), mask)
    assert torch.isfinite(loss) and set(stats) == set(clean_stats)
    close(loss, clean_loss)
    for key in stats:  # the fractions are float32 (the reference counts in .float()): tol 1e-6, a token is >= 1/30
        close(stats[key], clean_stats[key], 1e-6)
    wide = [widened(t, 2, fill) for t in spoil(mask, fill, *tensors)]
    wide_loss, wide_stats = call(*wide, widened(mask, 2, 0))
    for key in stats:
        close(wide_stats[key], stats[key], 1e-6)
    rows = [call(*(t[b:b + 1, :int(n[b])] for t in tensors), mask[b:b + 1, :int(n[b])]) for b in range(B)]
    for key in stats:
        close(stats[key], token_weighted([r[1][key] for r in rows], n), 1e-6)
    row_losses = torch.stack([r[0] for r in rows])
    close(loss, row_losses.mean() if mean_over_rows else token_weighted(row_losses, n))
    return loss, stats


def with_adv_rows(fn, adv):
    """Call a loss whose advantages are (B,) with row slices of (B, T) tensors: adv rides as a column."""
    def call(*tensors_and_mask):
        *tensors, advcol, mask = tensors_and_mask
        return fn(*tensors, advcol[:, 0], mask)
    return call


@pytest.mark.parametrize("fill", GARBAGE)
def test_grpo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token(fill):
    logp, old_logp, ref_logp, adv, mask, n = rollout(11)
    adv_col = adv[:, None].expand(B, T).clone()

    def call(logp, old_logp, ref_logp, adv_col, mask):
        return grpo.grpo_loss(logp, old_logp, ref_logp, adv_col[:, 0], mask, clip=CLIP, beta=0.05,
                              loss_agg="token-mean")
    _, stats = check_stats_and_loss(call, [logp, old_logp, ref_logp, adv_col], mask, n, fill)
    assert 0 < stats["clip_frac_low"] < 1 and 0 < stats["clip_frac_high"] < 1  # both clips bind somewhere


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_grpo_loss_means_over_sequences_ignore_the_padding(loss_agg):
    logp, old_logp, ref_logp, adv, mask, n = rollout(12)
    adv_col = adv[:, None].expand(B, T).clone()
    if loss_agg == "seq-mean-token-sum-norm":  # a row alone has the same max_len
        def call(logp, old_logp, ref_logp, adv_col, mask):
            return grpo.grpo_loss(logp, old_logp, ref_logp, adv_col[:, 0], mask, CLIP, 0.05, (loss_agg, 8))
    else:
        def call(logp, old_logp, ref_logp, adv_col, mask):
            return grpo.grpo_loss(logp, old_logp, ref_logp, adv_col[:, 0], mask, CLIP, 0.05, loss_agg)
    check_stats_and_loss(call, [logp, old_logp, ref_logp, adv_col], mask, n, float("nan"), mean_over_rows=True)


@pytest.mark.parametrize("fill", GARBAGE)
def test_dapo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token(fill):
    logp, old_logp, _, adv, mask, n = rollout(13)
    adv_col = adv[:, None].expand(B, T).clone()

    def call(logp, old_logp, adv_col, mask):
        return dapo.dapo_loss(logp, old_logp, adv_col[:, 0], mask, common.Clip(0.2, 0.28))
    _, stats = check_stats_and_loss(call, [logp, old_logp, adv_col], mask, n, fill)
    assert 0 < stats["clip_frac_low"] < 1 and 0 < stats["clip_frac_high"] < 1


@pytest.mark.parametrize("fill", GARBAGE)
def test_ppo_policy_loss_statistics_ignore_the_padding_and_weigh_every_valid_token(fill):
    logp, old_logp, _, adv, mask, n = rollout(14)
    adv_tokens = adv[:, None] * torch.rand(B, T, dtype=F64, generator=generator(15)) + 0.0

    def call(logp, old_logp, adv, mask):
        return ppo.ppo_policy_loss(logp, old_logp, adv, mask, clip=CLIP)
    _, stats = check_stats_and_loss(call, [logp, old_logp, adv_tokens], mask, n, fill)
    assert 0 < stats["clip_frac_low"] < 1 and 0 < stats["clip_frac_high"] < 1


@pytest.mark.parametrize("fill", GARBAGE)
def test_ppo_value_loss_and_clip_fraction_ignore_the_padding(fill):
    g = generator(16)
    n = lengths(B, T, g)
    mask = prefix_mask(n, T)
    old_values = torch.randn(B, T, dtype=F64, generator=g)
    values = old_values + torch.randn(B, T, dtype=F64, generator=g) * 0.5
    returns = torch.randn(B, T, dtype=F64, generator=g)

    def call(values, old_values, returns, mask):
        return ppo.ppo_value_loss(values, old_values, returns, mask, epsilon_value=0.2)
    _, stats = check_stats_and_loss(call, [values, old_values, returns], mask, n, fill)
    assert 0 < stats["clip_frac"] < 1


@pytest.mark.parametrize("fill", GARBAGE)
def test_positive_example_nll_of_a_padded_batch_is_the_mean_of_the_correct_rows_tokens_in_any_split(fill):
    logp, _, _, _, mask, n = rollout(21)
    correct = (torch.rand(B, generator=generator(22)) < 0.5).to(F64)
    correct[0], correct[1], correct[-1] = 1.0, 0.0, 1.0  # a wrong sample, and a correct one at either end
    logp = padded(logp, mask, fill).requires_grad_(True)
    loss = vapo.positive_example_nll(logp, mask, correct)
    rows = [b for b in range(B) if correct[b]]  # each correct row's tokens, summed alone
    tokens = sum(int(n[b]) for b in rows)
    close(loss, -sum(logp[b, :int(n[b])].sum() for b in rows) / tokens)
    close(vapo.positive_example_nll(widened(logp, 2, fill), widened(mask, 2, 0), correct), loss)
    cut = int(torch.randint(1, B, (1,), generator=generator(23)))  # two micro-batches with correct rows, each / N
    parts = [vapo.positive_example_nll(logp[part], mask[part], correct[part], num_tokens=tokens)
             for part in (slice(0, cut), slice(cut, B))]
    close(sum(parts), loss)
    loss.backward()
    close(logp.grad, -mask * correct[:, None] / tokens)  # -1 / N on each correct token, 0 on the rest
    close(vapo.positive_example_nll(logp.detach(), mask, torch.zeros(B, dtype=F64)), 0.0)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("fill", GARBAGE)
def test_remax_loss_and_return_mean_of_a_padded_batch_weigh_every_valid_token(fill, loss_agg):
    logp, _, ref_logp, adv, mask, n = rollout(17)
    kl = (logp - ref_logp).detach()
    adv_col = adv[:, None].expand(B, T).clone()

    def call(logp, kl, adv_col, mask):
        return remax.remax_loss(logp, adv_col[:, 0], kl, mask, beta=0.3, loss_agg=loss_agg)
    check_stats_and_loss(call, [logp, kl, adv_col], mask, n, fill, mean_over_rows=loss_agg != "token-mean")


@pytest.mark.parametrize("fill", GARBAGE)
def test_rloo_loss_of_a_padded_batch_is_the_mean_of_its_rows(fill):
    logp, _, _, adv, mask, n = rollout(18)
    logp = logp.clone().requires_grad_(True)
    clean_loss, _ = rloo.rloo_loss(logp, adv, mask)
    loss, stats = rloo.rloo_loss(padded(logp, mask, fill), adv, mask)
    assert torch.isfinite(loss)
    close(loss, clean_loss)
    close(rloo.rloo_loss(widened(padded(logp, mask, fill), 2, fill), adv, widened(mask, 2, 0))[0], loss)
    rows = [rloo.rloo_loss(logp[b:b + 1, :int(n[b])], adv[b:b + 1], mask[b:b + 1, :int(n[b])]) for b in range(B)]
    close(loss, torch.stack([r[0] for r in rows]).mean())
    close(stats["seq_logp_mean"], torch.stack([r[1]["seq_logp_mean"] for r in rows]).mean())
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all()


# The grid of hand values: advantages -0.5, 0, 0.5 by ratios 0.5, 1, 4 with epsilon 0.2 (DAPO: 0.2 and 0.28).
# Clipped below: only A = -0.5 with rho = 0.5 (1 of 9); above: only A = 0.5 with rho = 4 (1 of 9).
# approx_kl = mean of rho - 1 - log rho = 3 (0.5 - 1 + log 2 + 0 + 4 - 1 - log 4) / 9 = (2.5 - log 2) / 3.
GRID_ADV = torch.tensor([-0.5, 0.0, 0.5], dtype=F64)
GRID_LOG_RATIO = torch.log(torch.tensor([0.5, 1.0, 4.0], dtype=F64))


def clipped_losses():
    """name -> loss(log_ratio (B, T), adv (B,), epsilon), over (B, T) with one advantage per row."""
    def grpo_call(log_ratio, adv, epsilon):
        old = torch.zeros_like(log_ratio)
        return grpo.grpo_loss(log_ratio, old, None, adv, torch.ones_like(log_ratio), common.Clip(epsilon, epsilon),
                              0.0, "token-mean")

    def dapo_call(log_ratio, adv, epsilon):
        old = torch.zeros_like(log_ratio)
        return dapo.dapo_loss(log_ratio, old, adv, torch.ones_like(log_ratio), common.Clip(epsilon, 1.4 * epsilon))

    def ppo_call(log_ratio, adv, epsilon):
        old = torch.zeros_like(log_ratio)
        return ppo.ppo_policy_loss(log_ratio, old, adv[:, None].expand_as(log_ratio), torch.ones_like(log_ratio),
                                   common.Clip(epsilon, epsilon))
    return {"grpo_loss": grpo_call, "dapo_loss": dapo_call, "ppo_policy_loss": ppo_call}


@pytest.mark.parametrize("name", ["grpo_loss", "dapo_loss", "ppo_policy_loss"])
def test_clip_statistics_count_only_where_the_clip_binds_hand_values(name):
    call = clipped_losses()[name]
    _, stats = call(GRID_LOG_RATIO.expand(3, 3).clone(), GRID_ADV, 0.2)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 9)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 9)
    assert stats["approx_kl"].item() == pytest.approx((2.5 - math.log(2)) / 3, rel=1e-12)
    _, stats = call(torch.zeros(3, 3, dtype=F64), GRID_ADV, 0.0)  # on-policy: rho = 1 exactly, epsilon 0
    assert stats["clip_frac_low"].item() == 0 and stats["clip_frac_high"].item() == 0


@pytest.mark.parametrize("log_ref_over_pi", [5.0, 25.0, 40.0])
def test_ratio_weighted_k3_keeps_its_gradient_in_float32_far_from_the_reference(log_ref_over_pi):
    """grad of ratio * k3 is ratio * k1 (docs/algorithms.md, KL estimators): on-policy, ratio = 1 and the
    gradient is log(pi / ref). Written as ratio * k3, float32 loses it once ref / pi passes e^20."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref_logp = logp.detach() + log_ref_over_pi
    lab_losses.ratio_weighted_kl(logp, ref_logp, logp.detach(), "k3").sum().backward()
    torch.testing.assert_close(logp.grad, torch.full((2,), -log_ref_over_pi), rtol=1e-5, atol=1e-5)
