"""lab/losses.py: the lab's losses are the lesson's composed with the lab's features. With every feature off each one
is the lesson's loss bit for bit (value, statistics, gradient), on a padded batch off-policy with both clips binding;
with a feature on, it is the hand-computed value (the dual clip, pg_weight and the ratio weight on their own: also
tests/test_grpo.py, test_gspo.py, test_dapo.py, test_ppo.py, test_rloo.py and test_padding.py)."""
import math

import pytest
import torch

import common
import dapo
import grpo
import ppo
import reinforce_pp
import remax
import rloo
from lab import losses

F64 = torch.float64
B, T = 4, 5


def batch():
    """A padded (B, T) batch, off-policy (ratios e^+-0.6: both sides of a 0.2 clip), NaN in every padding."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(T)[None] < torch.tensor([5, 3, 1, 4])[:, None]).long()
    logp = -torch.rand(B, T, dtype=F64, generator=g) * 3
    old = logp + (torch.rand(B, T, dtype=F64, generator=g) - 0.5) * 1.2
    ref = logp + torch.randn(B, T, dtype=F64, generator=g) * 0.3
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=F64)
    token_adv = adv[:, None] * torch.rand(B, T, dtype=F64, generator=g)
    nan = torch.tensor(float("nan"), dtype=F64)
    pad = lambda x: torch.where(mask.bool(), x, nan)  # noqa: E731
    return logp, pad(old), pad(ref), adv, pad(token_adv), mask


def value_and_grad(fn):
    """fn(logp) -> (loss, stats) on batch()'s logp: (loss, stats, d loss / d logp)."""
    logp = batch()[0].clone().requires_grad_()
    loss, stats = fn(logp)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), stats, grad


def assert_identical(lab, lesson):
    (lab_loss, lab_stats, lab_grad), (loss, stats, grad) = value_and_grad(lab), value_and_grad(lesson)
    assert torch.equal(lab_loss, loss) and torch.equal(lab_grad, grad)
    assert lab_stats.keys() == stats.keys() and all(torch.equal(lab_stats[k], stats[k]) for k in stats)


GRPO_CONFIGS = [(common.Clip(0.2, 0.2), "seq-mean-token-mean", "k3"), (common.Clip(0.2, 0.28), "token-mean", "k2"),
                (common.Clip(0.2, 0.2, "sequence"), common.Aggregation("seq-mean-token-sum-norm", 8, 0.5), "k1"),
                (common.Clip(0.1, 0.3), common.Aggregation("seq-mean-token-sum", None, 0.25), "k3")]


@pytest.mark.parametrize("clip, loss_agg, estimator", GRPO_CONFIGS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_lab_grpo_loss_with_its_features_off_is_the_lessons(clip, loss_agg, estimator, beta):
    _, old, ref, adv, _, mask = batch()
    ref = ref if beta > 0 else None
    assert_identical(lambda lp: losses.grpo_loss(lp, old, ref, adv, mask, clip, beta, loss_agg, estimator),
                     lambda lp: grpo.grpo_loss(lp, old, ref, adv, mask, clip, beta, loss_agg, estimator))
    # a weight of 1 everywhere and a dual clip too far to bind change nothing
    assert_identical(lambda lp: losses.grpo_loss(lp, old, ref, adv, mask, clip, beta, loss_agg, estimator,
                                                 dual_c=1e9, pg_weight=torch.ones(B, T, dtype=F64)),
                     lambda lp: grpo.grpo_loss(lp, old, ref, adv, mask, clip, beta, loss_agg, estimator))


@pytest.mark.parametrize("clip, loss_agg", [(common.Clip(0.2, 0.28), "token-mean"),
                                            (common.Clip(0.1, 0.1), common.Aggregation("token-mean", None, 0.5))])
def test_lab_clipped_loss_with_its_features_off_is_dapos_ppos_and_reinforce_pps(clip, loss_agg):
    _, old, _, adv, token_adv, mask = batch()
    assert_identical(lambda lp: losses.clipped_loss(lp, old, adv, mask, clip, loss_agg),
                     lambda lp: dapo.dapo_loss(lp, old, adv, mask, clip, loss_agg))
    assert_identical(lambda lp: losses.clipped_loss(lp, old, token_adv, mask, clip, loss_agg),
                     lambda lp: ppo.ppo_policy_loss(lp, old, token_adv, mask, clip, loss_agg))
    assert_identical(lambda lp: losses.clipped_loss(lp, old, token_adv, mask, clip, loss_agg),
                     lambda lp: reinforce_pp.reinforce_pp_loss(lp, old, token_adv, mask, clip, loss_agg))


@pytest.mark.parametrize("loss_agg", common.LOSS_AGG_MODES)
def test_lab_rloo_and_remax_losses_with_no_weight_are_the_lessons(loss_agg):
    _, _, ref, adv, _, mask = batch()
    kl = torch.where(mask.bool(), batch()[0] - ref, 0.0)
    assert_identical(lambda lp: losses.rloo_loss(lp, adv, mask, loss_agg),
                     lambda lp: rloo.rloo_loss(lp, adv, mask, loss_agg))
    assert_identical(lambda lp: losses.remax_loss(lp, adv, kl, mask, 0.1, loss_agg),
                     lambda lp: remax.remax_loss(lp, adv, kl, mask, 0.1, loss_agg))


def test_a_weight_with_nan_in_the_padding_is_a_weight_with_0_there():
    mask = torch.tensor([[1, 1, 0]])
    x = torch.tensor([[2.0, 3.0, 5.0]], dtype=F64)
    assert losses.weighted(x, mask, torch.tensor([[0.5, 2.0, float("nan")]], dtype=F64)).tolist() == [[1.0, 6.0, 0.0]]
    assert losses.weighted(x, mask, None) is x


def test_lab_grpo_loss_with_every_feature_on_hand_values():
    """Two tokens of one sequence, A = -1, token-mean, beta 0.5, k3 weighted by the ratio: token 1 at rho = 5 (past
    the dual clip c = 3, weight 0.5), token 2 at rho = 1 (weight 2). The surrogate per token: max(min(-5, -0.8), -3)
    = -3 and -1, times its weight: -1.5 and -2; the KL term, unweighted by pg_weight: rho (r - log r - 1) with
    r = ref / pi. d/dlogp: 0 for the dual-clipped token, -w A rho = 2 for the other, plus beta rho k1 (the ratio
    weight's reverse-KL gradient), each over the 2 tokens."""
    logp = torch.tensor([[math.log(5.0), -1.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, -1.0]], dtype=F64)
    ref = torch.tensor([[math.log(2.5), -1.5]], dtype=F64)
    weight = torch.tensor([[0.5, 2.0]], dtype=F64)
    loss, stats = losses.grpo_loss(logp, old, ref, torch.tensor([-1.0], dtype=F64), torch.ones(1, 2),
                                   common.Clip(0.2, 0.2), 0.5, "token-mean", "k3", ratio_weight=True, dual_c=3.0,
                                   pg_weight=weight)
    loss.backward()
    rho = torch.tensor([5.0, 1.0], dtype=F64)
    r = torch.exp(ref[0] - logp.detach()[0])
    k3 = r - torch.log(r) - 1
    assert loss.item() == pytest.approx((1.5 + 2.0 + 0.5 * (rho * k3).sum().item()) / 2, rel=1e-12)
    k1 = logp.detach()[0] - ref[0]
    torch.testing.assert_close(logp.grad[0], (torch.tensor([0.0, 2.0], dtype=F64) + 0.5 * rho * k1) / 2,
                               rtol=1e-12, atol=1e-15)
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0  # rho = 5 with A < 0
    assert stats["kl_k3"].item() == pytest.approx(k3.mean().item(), rel=1e-12)  # the unweighted k3
    assert stats["kl_term"].item() == pytest.approx((rho * k3).mean().item(), rel=1e-12)


def test_lab_clipped_loss_dual_clip_and_weight_on_per_token_advantages():
    """PPO's per-token advantages (NaN in the padding): A = (-1, 2) at rho = (4, 1.5), clip 0.2, c = 2, weights
    (3, 0.5): surrogate max(min(-4, -0.8), -2) = -2 and min(3, 2.4) = 2.4, times the weights: -6 and 1.2."""
    logp = torch.tensor([[math.log(4.0), math.log(1.5), 0.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[-1.0, 2.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = losses.clipped_loss(logp, torch.zeros(1, 3, dtype=F64), adv, mask, common.Clip(0.2, 0.2),
                                      dual_c=2.0, pg_weight=torch.tensor([[3.0, 0.5, float("nan")]], dtype=F64))
    loss.backward()
    assert loss.item() == pytest.approx((6.0 - 1.2) / 2, rel=1e-12)
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0]]  # dual-clipped, clipped, padding
    assert stats["clip_frac_high"].item() == 0.5 and stats["clip_frac_low"].item() == 0.0


def test_lab_rloo_loss_weight_multiplies_each_log_prob_and_keeps_the_unweighted_sequence_log_prob():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weight = torch.tensor([[0.5, 2.0, float("nan")], [1.0, 0.0, 1.0]], dtype=F64)
    loss, stats = losses.rloo_loss(logp, torch.tensor([2.0, -1.0], dtype=F64), mask, pg_weight=weight)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 * (-0.5 - 4.0) + 1.0 * (-0.5 - 0.5)) / 2, rel=1e-12)
    assert logp.grad.tolist() == [[-0.5, -2.0, 0.0], [0.5, 0.0, 0.5]]
    assert stats["seq_logp_mean"].item() == pytest.approx((-3.0 - 1.5) / 2, rel=1e-12)


def test_lab_remax_loss_weight_multiplies_each_tokens_return_times_log_prob():
    """G_t = A - beta sum_{t' >= t} k1: A = 1, beta 0.5, k1 = (0.2, 0.4): G = (0.7, 0.8); weights (2, 0.5),
    token-mean: loss -(2 * 0.7 logp_1 + 0.5 * 0.8 logp_2) / 2, gradient -(w G) / 2; return_mean unweighted."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    kl = torch.tensor([[0.2, 0.4]], dtype=F64)
    loss, stats = losses.remax_loss(logp, torch.tensor([1.0], dtype=F64), kl, torch.ones(1, 2), 0.5,
                                    pg_weight=torch.tensor([[2.0, 0.5]], dtype=F64))
    loss.backward()
    assert loss.item() == pytest.approx(-(2 * 0.7 * -1.0 + 0.5 * 0.8 * -2.0) / 2, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.7, -0.2]], dtype=F64), rtol=1e-12, atol=0)
    assert stats["return_mean"].item() == pytest.approx(0.75, rel=1e-12)


# Dual clip c = 3: A = -0.5 at rho = 10 has surrogate min(-5, -0.6) = -5, bounded to 3 * -0.5 = -1.5; A = 0.5 at
# rho = 0.1 has min(0.05, 0.4) = 0.05 and no bound: the token-mean loss is (1.5 - 0.05) / 2 = 0.725.
DUAL_ADV = torch.tensor([-0.5, 0.5], dtype=F64)
DUAL_LOG_RATIO = torch.log(torch.tensor([10.0, 0.1], dtype=F64))[:, None]
DUAL_CALLS = {  # the lab's loss of each lesson loop, as it calls it: adv (B,) or PPO's per-token (B, T)
    "grpo": lambda lr, adv, c: losses.grpo_loss(lr, torch.zeros_like(lr), None, adv, torch.ones_like(lr),
                                                common.Clip(0.2, 0.2), 0.0, "token-mean", dual_c=c),
    "dapo": lambda lr, adv, c: losses.clipped_loss(lr, torch.zeros_like(lr), adv, torch.ones_like(lr),
                                                   common.Clip(0.2, 0.28), dual_c=c),
    "ppo": lambda lr, adv, c: losses.clipped_loss(lr, torch.zeros_like(lr), adv[:, None].expand_as(lr),
                                                  torch.ones_like(lr), common.Clip(0.2, 0.2), dual_c=c),
}


@pytest.mark.parametrize("name", DUAL_CALLS)
def test_dual_clip_bounds_a_negative_advantage_by_c_times_it_and_leaves_a_positive_one_hand_values(name):
    loss, _ = DUAL_CALLS[name](DUAL_LOG_RATIO.clone(), DUAL_ADV, 3.0)
    assert loss.item() == pytest.approx(0.725, rel=1e-12)
    loss, _ = DUAL_CALLS[name](DUAL_LOG_RATIO.clone(), DUAL_ADV, 0.0)  # off: the lesson's -(-5 + 0.05) / 2
    assert loss.item() == pytest.approx(2.475, rel=1e-12)


def test_lab_rloo_loss_with_a_per_token_weight_is_the_mean_of_its_rows_and_weight_one_changes_nothing():
    g = torch.Generator().manual_seed(19)
    n = torch.tensor([5, 3, 1, 4])
    mask = (torch.arange(T)[None] < n[:, None]).long()
    logp = -torch.rand(B, T, dtype=F64, generator=g) * 3
    adv = torch.randn(B, dtype=F64, generator=g)
    weight = torch.where(mask.bool(), torch.rand(B, T, dtype=F64, generator=g) * 2, float("nan"))
    loss, stats = losses.rloo_loss(torch.where(mask.bool(), logp, float("nan")), adv, mask, pg_weight=weight)
    rows = [losses.rloo_loss(logp[b:b + 1, :int(n[b])], adv[b:b + 1], mask[b:b + 1, :int(n[b])],
                             pg_weight=weight[b:b + 1, :int(n[b])])[0] for b in range(B)]
    torch.testing.assert_close(loss, torch.stack(rows).mean(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(losses.rloo_loss(logp, adv, mask, pg_weight=torch.ones_like(logp))[0],
                               rloo.rloo_loss(logp, adv, mask)[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(stats["seq_logp_mean"], rloo.rloo_loss(logp, adv, mask)[1]["seq_logp_mean"])
