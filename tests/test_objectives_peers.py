"""The clipped-objective family against the peers' formulas on identical tensors: verl's compute_policy_loss_cispo,
compute_policy_loss_sapo and compute_policy_loss_geo_mean (verl/trainer/ppo/core_algos.py) and TRL's GRPOTrainer
loss_type "cispo" and "sapo", transcribed below from their source. The transcriptions are working versions of
classroom exercises: the student copy leaves this file out (classroom/make_student_copy.py, TEACHER_ONLY)."""
import pytest
import torch

from objectives import cispo_loss, gmpo_loss, sapo_loss
from test_objectives import F64, random_batch


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """verl's compute_policy_loss_cispo (verl/trainer/ppo/core_algos.py), token-mean aggregation."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return (pg_losses * response_mask).sum() / response_mask.sum()


def trl_cispo(per_token_logps, old_per_token_logps, advantages, mask, epsilon_high):
    """TRL's GRPOTrainer, loss_type="cispo": an absolute cap from above only, normalised by the batch's tokens."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    clamped = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped * advantages * per_token_logps
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_equals_verls_two_sided_clip_and_trls_absolute_cap(seed):
    """verl: clip_ratio_low / high are our (eps_low, eps_high). TRL: epsilon_high = 5.0 (an absolute cap on r, as in
    ScaleRL) is our eps_high = 4.0 with no lower bound (eps_low = 1). Values and gradients, token-mean."""
    logp, old, adv, mask = random_batch(seed, scale=1.5)
    for ours, theirs in [
        (lambda x: cispo_loss(x, old, adv, mask, (0.2, 0.28))[0],
         lambda x: verl_cispo(old, x, adv[:, None], mask, 0.2, 0.28)),
        (lambda x: cispo_loss(x, old, adv, mask, (1.0, 4.0))[0],
         lambda x: trl_cispo(x, old, adv[:, None], mask, 5.0)),
    ]:
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        loss_a, loss_b = ours(a), theirs(b)
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=0)
        loss_a.backward(), loss_b.backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos, tau_neg):
    """verl's compute_policy_loss_sapo (and TRL's loss_type="sapo"): tau_pos where A > 0, else tau_neg; per-token
    loss -f(r) A; seq-mean-token-mean."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    tau_pos, tau_neg = (torch.as_tensor(tau, dtype=advantages.dtype) for tau in (tau_pos, tau_neg))
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    pg_losses = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * advantages
    return ((pg_losses * response_mask).sum(-1) / response_mask.sum(-1)).mean()


@pytest.mark.parametrize("seed", range(3))
def test_sapo_equals_verls_and_trls(seed):
    logp, old, adv, mask = random_batch(seed, scale=1.0)
    adv[0] = 0.0  # A = 0 takes tau_neg in both
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss_a = sapo_loss(a, old, adv, mask, 1.0, 1.05)[0]
    loss_b = verl_sapo(old, b, adv[:, None].expand_as(b), mask, 1.0, 1.05)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=0)
    loss_a.backward(), loss_b.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high):
    """verl's compute_policy_loss_geo_mean: the log-ratio clamped, min with the sign of A, exp of its token mean."""
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    kl_min = sgn_advantage * torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * clamped)
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


@pytest.mark.parametrize("seed", range(3))
def test_gmpo_equals_verls_geo_mean(seed):
    """Identical tensors; verl divides by (|y| + 1e-8), a relative 1e-8 / |y| of the mean log-ratio and of A: the
    values and gradients agree to 1e-8 relative. Ratios spread so that the clip binds on some tokens, none exactly
    at the bound (where verl's torch.min splits the gradient of a tie)."""
    logp, old, adv, mask = random_batch(seed, scale=0.8)
    lr = logp - old
    assert ((lr.abs() - 0.4).abs() > 1e-6).all() and ((lr.abs() > 0.4) & mask.bool()).any()
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss_a = gmpo_loss(a, old, adv, mask, (0.4, 0.4))[0]
    loss_b = verl_geo_mean(old, b, adv[:, None].expand_as(b), mask.to(F64), 0.4, 0.4)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-7, atol=0)
    loss_a.backward(), loss_b.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-7, atol=1e-15)
