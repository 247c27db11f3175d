"""The corrections of a sampler that is not the learner: a stale one (--rollout_lag, --async_rollouts), a
low-precision copy (--rollout_dtype) or an inference engine (--sampler vllm). Each reweights or masks the
policy-gradient term of the tokens the sampler mu drew, towards the policy trained; rollout_correction combines them
into one detached weight per token, with the mismatch's statistics, for the lab's five loops. Equations and which
log-probs play which role: docs/algorithms.md, "Off-policy corrections"; measured runs: docs/stability.md.

- Truncated importance sampling, per token (truncated_is_weight) or per sequence (sequence_is_weight): Yao et al.,
  2025, "Your efficient RL framework secretly brings you off-policy RL training" (blog post).
- Geometric sequence masking (geometric_sequence_mask): DeepSeek-AI, 2025, DeepSeek-V3.2's off-policy sequence
  masking, arXiv 2512.02556.
- The per-token veto (tis_veto_mask): verl's rollout_token_veto_threshold.
- M2PO (m2po_mask): Zheng, Zhao and Chen, 2025, "Prosperity before collapse", arXiv 2510.01161 (docs/async.md).
- The normalised effective sample size of the weights in use (effective_sample_size).
Tests: tests/test_stability.py, tests/test_sequence_correction.py, tests/test_m2po.py."""
from typing import NamedTuple

import torch

from common import Extreme, Sums, kl_k3, masked_mean, masked_sum


def truncated_is_weight(logp, rollout_logp, cap):
    """Truncated importance sampling, per token: min(pi_train / pi_rollout, cap), detached: it reweights each
    token's policy-gradient term towards the trainer's distribution."""
    # BEGIN SOLUTION
    return torch.exp(logp - rollout_logp).clamp(max=cap).detach()
    # END SOLUTION


def geometric_sequence_mask(logp, old_logp, adv, mask, delta):
    """Off-policy sequence masking (DeepSeek-V3.2): 0 for sequence i when A_i < 0 and (1/|y_i|) sum_t log(pi_old /
    pi_theta) > delta, else 1. The mean log-ratio is the log of the geometric mean ratio, so the test does not grow
    with the length. (B,) detached."""
    # BEGIN SOLUTION
    drift = masked_mean((old_logp - logp).detach(), mask, dim=1)
    return 1.0 - ((adv < 0) & (drift > delta)).to(logp.dtype)
    # END SOLUTION


def sequence_is_weight(logp, rollout_logp, mask, cap):
    """Per-sequence TIS: min(prod_t pi_train / pi_rollout, cap) over the valid tokens, (B,) detached. Unbiased for
    a sequence objective up to the cap, where the per-token ratio is not (docs/algorithms.md, per token or per
    sequence)."""
    return torch.exp(masked_sum((logp - rollout_logp).detach(), mask, dim=1)).clamp(max=cap)  # an overflow gives cap


def tis_veto_mask(logp, rollout_logp, mask, threshold):
    """0 for a sequence any of whose valid tokens has pi_train / pi_rollout < threshold, else 1. (B,) detached."""
    low = torch.exp((logp - rollout_logp).detach()) < threshold  # (B, T)
    return 1.0 - (low & mask.bool()).any(dim=1).to(logp.dtype)


def fraction(flags, mask=None):
    """The fraction of rows ((B,) flags) or of valid tokens ((B, T) flags and their mask) where flags is true."""
    mask = torch.ones_like(flags) if mask is None else mask
    return Sums((masked_sum(flags.float(), mask), mask.sum().float()))


def effective_sample_size(weights, mask=None):
    """(sum w)^2 / (n sum w^2) over the n valid weights, token-level (B, T) with their mask or per sequence (B,):
    1 when all are equal, 1/n when one carries everything. As Sums (.value())."""
    mask = torch.ones_like(weights) if mask is None else mask
    return Sums((masked_sum(weights, mask), masked_sum(weights ** 2, mask), mask.sum().float()),
                lambda s, s2, n: s ** 2 / (n * s2).clamp(min=1e-30))


class Correction(NamedTuple):
    weight: torch.Tensor  # (B, T), detached, on each token's policy-gradient term
    stats: dict           # the mismatch's statistics, is_ess
    per_row: dict         # for the viewer: the TIS weight (B, T), geometric mask and veto (B,)


def m2po_mask(log_ratio, mask, tau):
    """M2PO (Zheng et al., 2025): with log r_t = log pi_theta / mu per token, mask the valid tokens of largest
    (log r_t)^2 one by one until the mean (log r_t)^2 of those left is <= tau. (B, T) keep mask: 1 kept, 0 masked
    or padding. Masking, not clipping: a kept token keeps its whole ratio."""
    m2 = torch.where(mask.bool(), log_ratio.detach().double() ** 2, -1.0).flatten()  # padding sorts last
    order = torch.sort(m2, descending=True, stable=True).indices[:int(mask.sum())]  # valid tokens, largest first
    left = m2[order].flip(0).cumsum(0).flip(0)  # left[j]: the sum of (log r)^2 once the j largest are masked
    done = (left / torch.arange(len(order), 0, -1) <= tau).nonzero()  # masking all, none left, always is
    j = int(done[0]) if len(done) else len(order)
    return torch.zeros_like(m2, dtype=torch.float32).index_fill_(0, order[j:], 1.0).view(mask.shape)


def rollout_correction(logp, old_logp, rollout_logp, adv, mask, tis_cap=0.0, geo_mask_delta=0.0, tis_level="token",
                       tis_veto=0.0, m2po_keep=None):
    """A Correction. logp: the policy trained; old_logp: the trainer's at the start of the update (pi_prox);
    rollout_logp: the sampler's, a low-precision copy or the --rollout_lag policy (None: old_logp). TIS weighs by
    min(old / rollout, tis_cap), per token or the sequence's product (tis_level); tis_veto drops a sequence with a
    token whose old / rollout is below it; the geometric mask plays pi_old with rollout_logp (the mismatch and the
    updates since sampling); m2po_keep: these rows of M2PO's (B, T) mask of the batch (None: off). is_ess and
    tis_clip_frac: of the importance weights in use, at their level. 0 turns each off."""
    rollout_logp = old_logp if rollout_logp is None else rollout_logp
    sequence = tis_level == "sequence"
    tis = torch.ones_like(logp)
    if tis_cap > 0:
        tis = sequence_is_weight(old_logp, rollout_logp, mask, tis_cap)[:, None].expand_as(logp) if sequence else \
            truncated_is_weight(old_logp, rollout_logp, tis_cap)
    keep = geometric_sequence_mask(logp, rollout_logp, adv, mask, geo_mask_delta) if geo_mask_delta > 0 else \
        torch.ones_like(logp[:, 0])  # (B,); adv is read by the mask alone (PPO's is per token)
    veto = tis_veto_mask(old_logp, rollout_logp, mask, tis_veto) if tis_veto > 0 else torch.ones_like(keep)
    m2po = torch.ones_like(logp) if m2po_keep is None else m2po_keep.to(logp.dtype)
    weight = tis * (keep * veto)[:, None] * m2po  # a token M2PO masks: weight 0
    with torch.no_grad():
        log_ratio = torch.where(mask.bool(), old_logp - rollout_logp, 0.0)  # trainer over sampler, the same weights
        ratio = torch.exp(log_ratio)
        capped = torch.exp(masked_sum(log_ratio, mask, dim=1)) > tis_cap if sequence else ratio > tis_cap
        stats = {"mismatch_k3": masked_mean(kl_k3(rollout_logp, old_logp), mask),  # KL(sampler || trainer)
                 "mismatch_ratio_max": Extreme(torch.where(mask.bool(), ratio, 0.0).max(), "max"),
                 "mismatch_ratio_min": Extreme(torch.where(mask.bool(), ratio, float("inf")).min(), "min"),
                 "tis_clip_frac": fraction(capped, None if sequence else mask) if tis_cap > 0 else 0.0,
                 "geo_masked_frac": fraction(keep == 0), "tis_veto_frac": fraction(veto == 0),
                 "is_ess": effective_sample_size(tis[:, 0] * keep * veto) if sequence else
                 effective_sample_size(weight, mask),
                 "m2po_masked_frac": fraction(m2po == 0, mask)}
    per_row = {"tis_weight": tis if tis_cap > 0 else None, "geo_mask": keep if geo_mask_delta > 0 else None,
               "veto": veto if tis_veto > 0 else None}
    return Correction(weight, stats, per_row)
