"""The lab's policy losses: the lesson's, built from the same pieces of common.py (common.clipped_surrogate,
common.clip_stats, common.kl_penalty, common.aggregate_loss), with what only the lab uses composed on top:

- dual_c > 1, the dual clip (Ye et al., 2020): with A < 0 the lesson's min(rho A, clip(rho) A) is unbounded below as
  rho grows; max(that, c A) bounds the token's loss at c |A| (0 = off). A > 0 is left as it was.
- pg_weight (B, T), detached: the weights of lab/corrections.py's rollout_correction (truncated importance sampling,
  the masks of a stale or low-precision sampler) multiply the surrogate, not the KL term. A padding weight may hold
  anything (NaN): it is set to 0 first, so it never reaches the loss or the gradient.
- ratio_weight: the KL term weighted by pi_theta / pi_old with its gradient (DeepSeek-V3.2), ratio_weighted_kl:
  common.kl_penalty's estimator times the ratio, its k3 written so that fp32 keeps the gradient.
- GSPO's sequence level (a common.Clip's level) as the lesson's grpo_loss computes it, the dual clip and the weights
  applied to the sequence's ratio on each of its tokens.

With every feature off each loss here is the lesson's (grpo.grpo_loss, dapo.dapo_loss, ppo.ppo_policy_loss,
reinforce_pp.reinforce_pp_loss, rloo.rloo_loss, remax.remax_loss), the same operations in the same order: equal bit
for bit, values and gradients (tests/test_lab_losses.py). For REINFORCE's losses the weight is composed by handing
the lesson's loss the weighted log-probs.
"""
import torch

import common
import remax
import rloo


def weighted(x, mask, pg_weight):
    """x times pg_weight where mask is 1 and times 0 elsewhere (a padding weight may be NaN); x itself without one."""
    return x if pg_weight is None else torch.where(mask.bool(), pg_weight, 0.0) * x


def ratio_weighted_kl(logp, ref_logp, old_logp, estimator="k3"):
    """Per-token KL term for a loss, gradient through logp, of tokens sampled by pi_old: common.kl_penalty's k1, k2
    or k3 of (logp, ref_logp) times the ratio pi_theta / pi_old WITH its gradient (DeepSeek-V3.2):
    E_old[ratio * k] = E_theta[k] as a function of theta, so k1 and k3 give the per-state reverse-KL gradient
    (grad(ratio * k3) = ratio * k1 * score); a detached ratio would keep k3's forward-KL gradient. ratio * k3 keeps
    that gradient in fp32 below: the plain product would give autograd ratio * k1 as the difference of two terms of
    size ref / pi_old, which cancel to nothing once log(ref / pi) passes about 20."""
    # BEGIN SOLUTION
    ratio = torch.exp(logp - old_logp)
    if estimator == "k3":  # ratio * (ref/pi - log(ref/pi) - 1) with ratio * ref/pi = ref/pi_old: d/dlogp = ratio * k1
        return torch.exp(ref_logp - old_logp) - ratio * (ref_logp - logp + 1)
    return ratio * common.kl_penalty(logp, ref_logp, estimator)
    # END SOLUTION


def surrogate(logp, old_logp, adv, mask, clip, dual_c=0.0, pg_weight=None):
    """The per-token surrogate (B, T) the policy maximises, with its ratio and the tokens' log-ratio: the lesson's
    common.clipped_surrogate of rho = exp(logp - old_logp) (clip.level "sequence": GSPO's exp(mean_t log rho_t) on
    each token of the sequence), the dual clip dual_c and the weights pg_weight on top. adv: (B, 1) or (B, T)."""
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # rho_t = pi_theta / pi_old
    if clip.level == "sequence":  # GSPO: s_i = exp(mean_t log rho_t), as grpo.grpo_loss
        ratio = torch.exp(common.masked_mean(log_ratio, mask, dim=1))[:, None].expand_as(logp)
    per_token = common.clipped_surrogate(ratio, adv, clip)  # min(rho A, clip(rho) A)
    if dual_c > 0:  # with A < 0 the min above is unbounded in rho: at most c |A| lost
        per_token = torch.where(adv < 0, torch.max(per_token, dual_c * adv), per_token)
    return weighted(per_token, mask, pg_weight), ratio, log_ratio


def grpo_loss(logp, old_logp, ref_logp, adv, mask, clip, beta, loss_agg="seq-mean-token-mean", kl_estimator="k3",
              ratio_weight=False, dual_c=0.0, pg_weight=None):
    """grpo.grpo_loss with the lab's dual clip, pg_weight (the surrogate's, not the KL term's) and the KL term's
    ratio weight (ratio_weighted_kl). Arguments and (loss, stats) as the lesson's."""
    clip = common.Clip(*clip)
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())  # the padding: logp's value, no NaN gradient
    ref_logp = None if ref_logp is None else torch.where(mask.bool(), ref_logp, logp.detach())
    adv = adv[:, None]
    per_token, ratio, log_ratio = surrogate(logp, old_logp, adv, mask, clip, dual_c, pg_weight)
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    elif ratio_weight:  # DeepSeek-V3.2's ratio weight
        kl = ratio_weighted_kl(logp, ref_logp, old_logp, kl_estimator)
    else:
        kl = common.kl_penalty(logp, ref_logp, kl_estimator)
    if clip.level == "sequence":  # GSPO: the surrogate once per sequence, the KL term per token
        loss = common.aggregate_loss(-per_token, mask, common.per_sequence(loss_agg)) + \
            common.aggregate_loss(beta * kl, mask, loss_agg)
    else:
        loss = common.aggregate_loss(-per_token + beta * kl, mask, loss_agg)
    with torch.no_grad():
        stats = {
            **common.clip_stats(ratio, log_ratio, adv, mask, clip),
            "kl_k3": common.masked_mean(common.kl_k3(logp, ref_logp) if ref_logp is not None else kl, mask),
            "kl_term": common.masked_mean(kl, mask),
        }
    return loss, stats


def clipped_loss(logp, old_logp, adv, mask, clip, loss_agg="token-mean", dual_c=0.0, pg_weight=None):
    """dapo.dapo_loss (adv (B,)), ppo.ppo_policy_loss and reinforce_pp.reinforce_pp_loss (adv (B, T)): the clipped
    surrogate alone, with the lab's dual clip and pg_weight. Arguments and (loss, stats) as the lesson's."""
    clip = common.Clip(*clip)
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())  # the padding: logp's value, no NaN gradient
    adv = adv[:, None] if adv.dim() == 1 else torch.where(mask.bool(), adv, 0.0)  # a padding advantage may be NaN
    per_token, ratio, log_ratio = surrogate(logp, old_logp, adv, mask, clip, dual_c, pg_weight)
    loss = common.aggregate_loss(-per_token, mask, loss_agg)
    return loss, common.clip_stats(ratio, log_ratio, adv, mask, clip)


def rloo_loss(logp, adv, mask, loss_agg="seq-mean-token-sum", pg_weight=None):
    """rloo.rloo_loss of the weighted log-probs: -A_i sum_t w_t logp_t; seq_logp_mean stays the unweighted one."""
    loss, stats = rloo.rloo_loss(weighted(logp, mask, pg_weight), adv, mask, loss_agg)
    if pg_weight is not None:
        stats = {"seq_logp_mean": common.masked_sum(logp.detach(), mask, dim=1).mean()}
    return loss, stats


def remax_loss(logp, adv, kl, mask, beta, loss_agg="token-mean", pg_weight=None):
    """remax.remax_loss of the weighted log-probs: each token's -G_t logp_t times its weight w_t."""
    return remax.remax_loss(weighted(logp, mask, pg_weight), adv, kl, mask, beta, loss_agg)
