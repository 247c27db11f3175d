"""The clipped-objective family beyond PPO's clip: CISPO, SAPO and GMPO, pure functions (tensors in, a loss and its
statistics out) that the lab's GRPO loop composes with the lesson's advantages: `python lab/grpo.py --policy_loss
cispo | sapo | gmpo`. PPO's clip and GSPO's sequence ratio stay in the lesson (grpo.grpo_loss), the dual clip in
lab/losses.py.

Notation (docs/algorithms.md, "The clipped-objective family"): r_t = pi_theta(y_t) / pi_old(y_t), A the advantage of
the token's sequence, sg the stop-gradient. Every loss below is minus its objective. The members differ in one thing:
the weight w(r) of a token's score, d objective_t / d log pi_t = w(r) A. Unclipped importance sampling has w = r;
PPO's clip sets w = 0 past 1 + eps with A > 0 and below 1 - eps with A < 0 (those tokens are silenced); CISPO caps w
and silences none; SAPO replaces the step by a smooth bump; GMPO clips each token before a geometric mean over the
sequence. On-policy (r = 1) all of them give the plain policy gradient (GMPO's with GRPO's per-sequence token mean):
they differ only off-policy (several epochs, a stale or low-precision sampler). docs/figures/objectives.png draws w(r).
"""
import torch

import common


def cispo_loss(logp, old_logp, adv, mask, clip, loss_agg="token-mean", pg_weight=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): J = sum_i sum_t sg(r_hat_t) A_i log pi_theta(y_t) / sum_i |y_i|,
    r_hat = clip(r, 1 - eps_low, 1 + eps_high). The clipped ratio is a detached weight on the REINFORCE term, so
    d J / d log pi_t = clip(r, 1 - eps_low, 1 + eps_high) A: every token keeps its gradient, only its weight is
    capped (PPO's clip silences a clipped token: weight 0). No token is silenced; at r = 1 the gradient is the plain
    policy gradient's.

    Convention: clip = (eps_low, eps_high) relative to 1 as PPO's (a common.Clip or a pair); eps_low >= 1 means no
    lower bound (MiniMax-M1 tunes only the upper one). verl `cispo`: clip_ratio_low / clip_ratio_high are these two.
    TRL `loss_type="cispo"` caps from above only, with an absolute cap: its epsilon_high = 1 + our eps_high, and our
    eps_low = 1. logp: (B, T) with grad; old_logp: (B, T) detached; adv: (B,); loss_agg: common.aggregate_loss's mode
    or an Aggregation (the paper: token-mean); pg_weight: (B, T) detached weights (the lab's corrections) or None.
    Returns (loss, stats): clip_frac_low (r < 1 - eps_low) and clip_frac_high (r > 1 + eps_high), capped tokens
    whatever the sign of A, and approx_kl (k3 of the ratio)."""
    low, high = clip[0], clip[1]
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())  # padding: ratio 1, no inf * 0
    # BEGIN SOLUTION
    ratio = torch.exp(logp.detach() - old_logp)  # (B, T), detached: only log pi carries the gradient
    weight = torch.clamp(ratio, min=max(1 - low, 0.0), max=1 + high)
    surrogate = weight * adv[:, None] * logp  # sg(r_hat) A log pi
    if pg_weight is not None:
        surrogate = torch.where(mask.bool(), pg_weight, 0.0) * surrogate
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean((ratio < 1 - low).float(), mask),
            "clip_frac_high": common.masked_mean((ratio > 1 + high).float(), mask),
            "approx_kl": common.masked_mean(ratio - 1 - torch.log(ratio), mask),
        }
    return loss, stats
    # END SOLUTION


def sapo_gate(ratio, tau):
    """SAPO's soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)) (arXiv 2511.20347): f(1) = 2 / tau, f'(1) = 1."""
    return 4.0 / tau * torch.sigmoid(tau * (ratio - 1))


def sapo_loss(logp, old_logp, adv, mask, tau_pos=1.0, tau_neg=1.05, loss_agg="seq-mean-token-mean", pg_weight=None):
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): the hard clip replaced by a soft gate,
    J = mean_i mean_t f_t(r_t) A_i with f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos when A > 0, tau_neg
    otherwise (A <= 0, as TRL and verl; defaults 1.0 and 1.05, theirs). d J / d log pi_t = r f'(r) A with
    f'(r) = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1): the weight is 1 at r = 1 (on-policy the plain policy
    gradient, as the paper says), peaks just past it and decays smoothly on both sides, so a far off-policy token is
    damped, never silenced outright. verl `sapo` forces seq-mean-token-mean; TRL `sapo` uses it too.

    logp: (B, T) with grad; old_logp: (B, T) detached; adv: (B,); loss_agg: a mode or an Aggregation; pg_weight:
    (B, T) detached or None. Returns (loss, stats): gate_weight (the mean of w(r) = r f'(r) over the tokens, 1
    on-policy: how much of the gradient the gate lets through) and approx_kl."""
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)
    adv = adv[:, None]
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # (B, 1)
    surrogate = sapo_gate(ratio, tau) * adv  # (B, T)
    if pg_weight is not None:
        surrogate = torch.where(mask.bool(), pg_weight, 0.0) * surrogate
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    with torch.no_grad():
        gate = torch.sigmoid(tau * (ratio - 1))
        stats = {
            "gate_weight": common.masked_mean(4 * ratio * gate * (1 - gate), mask),
            "approx_kl": common.masked_mean(ratio - 1 - log_ratio, mask),
        }
    return loss, stats
    # END SOLUTION


def gmpo_loss(logp, old_logp, adv, mask, clip=(0.4, 0.4), loss_agg="seq-mean-token-mean", pg_weight=None):
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673): each token's ratio clipped first, on the side that
    would raise the objective, then the geometric mean over the sequence:
        J = (1/G) sum_i (prod_t min(r_t^s, clip(r_t^s, e^-low, e^high))^s)^(1/|y_i|) A_i,   s = sgn(A_i),
    i.e. in logs, l_t = log r_t clipped to [-low, high] where it binds for that sign (A > 0: above; A < 0: below),
    g_i = exp(mean_t l_t), J = mean_i g_i A_i (the paper: low = high = 0.4). GSPO clips the geometric mean itself
    (grpo.grpo_loss at sequence level); GMPO clips its factors. d J / d log pi_t = g_i A_i / (|y_i| G) on an unclipped
    token and 0 on a clipped one (silenced, as PPO's clip does, but the bound is wider and a token's weight is the
    sequence's g_i, not its own ratio). On-policy the gradient is GRPO's with seq-mean-token-mean. verl `geo_mean`.

    logp: (B, T) with grad; old_logp: (B, T) detached; adv: (B,); clip: (low, high) on the log scale; loss_agg: its
    micro-batch weight is kept, the mode is per sequence (one term per sequence); pg_weight: (B, T) detached or None
    (enters as its mean over the sequence's tokens). Returns (loss, stats): clip_frac_low (A < 0, log r < -low),
    clip_frac_high (A > 0, log r > high), approx_kl."""
    low, high = clip[0], clip[1]
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp  # (B, T)
    adv = adv[:, None]
    clipped_low = (adv < 0) & (log_ratio < -low)
    clipped_high = (adv > 0) & (log_ratio > high)
    bound = torch.where(clipped_low, torch.full_like(log_ratio, -low), torch.full_like(log_ratio, high))
    clipped_log_ratio = torch.where(clipped_low | clipped_high, bound, log_ratio)  # a clipped token: a constant
    geo_mean = torch.exp(common.masked_mean(clipped_log_ratio, mask, dim=1))[:, None]  # (B, 1)
    surrogate = (geo_mean * adv).expand_as(logp)  # one term per sequence, on each of its tokens
    if pg_weight is not None:
        surrogate = torch.where(mask.bool(), pg_weight, 0.0) * surrogate
    loss = common.aggregate_loss(-surrogate, mask, common.per_sequence(loss_agg))
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean(clipped_low.float(), mask),
            "clip_frac_high": common.masked_mean(clipped_high.float(), mask),
            "approx_kl": common.masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),
        }
    return loss, stats
    # END SOLUTION
