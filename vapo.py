"""VAPO (Yue et al., 2025, arXiv 2504.05118): PPO with a critic made reliable for long reasoning. Its pieces are
flags of the lab's PPO (`python lab/ppo.py --vapo True`); this file holds its formulas, pure functions that
lab/ppo.py calls: decoupled GAE (VC-PPO), the length-adaptive lambda, and the positive-example LM loss it adds to
the policy loss in one line. Clip-higher is the clip's high side (--epsilon_high); value pretraining is lab/ppo.py's
loop.
Equations: docs/algorithms.md, "VAPO".

    L_NLL = -(1 / N) sum_{i correct} sum_t logp_{i,t},   N = the number of the correct samples' tokens
    loss  = L_PPO + mu * L_NLL                             (mu: --pos_lm_coef, VAPO's 0.1)
"""
import torch

import common
from ppo import gae  # the lesson's GAE


def positive_example_nll(logp, mask, correct, num_tokens=None):
    """VAPO's positive-example LM loss: -(1 / N) sum of logp over the tokens of the correct samples, N their count
    (a token-mean over the correct samples' tokens only; the wrong samples and the padding count for nothing).
    logp, mask: (b, T); correct: (b,) 1 for a correct sample, 0 for a wrong one. num_tokens: N of the whole
    minibatch when logp is one micro-batch of it (the parts then add up to the minibatch's loss; under data
    parallelism the mean count per process, as DDP averages the gradients: it may be below 1); 0 correct tokens
    give 0. Returns a scalar whose gradient flows through logp."""
    # BEGIN SOLUTION
    positive = mask * correct[:, None]  # (b, T)
    n = positive.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logp.dtype)
    return -common.masked_sum(logp, positive) / torch.where(n > 0, n, 1.0)  # only N = 0 is not divided by
    # END SOLUTION


def decoupled_gae(rewards, values, mask, gamma, lam_policy, lam_critic):
    """Decoupled GAE (VC-PPO, Yuan et al., 2025; VAPO): the policy's advantages with lam_policy, the
    critic's targets R_t = A_t + V_t with lam_critic (1: the Monte Carlo return, which an untrained
    V cannot bias). (B, T) in; returns (advantages, returns)."""
    # BEGIN SOLUTION
    advantages, _ = gae(rewards, values, mask, gamma, lam_policy)
    _, returns = gae(rewards, values, mask, gamma, lam_critic)
    return advantages, returns
    # END SOLUTION


def length_adaptive_lam(lengths, alpha):
    """VAPO's length-adaptive GAE (Yue et al., 2025): lam = 1 - 1/(alpha |y|) per sequence, so the
    total weight of the TD errors, 1/(1 - lam) = alpha |y|, grows with the length. Clamped at 0
    (one-step TD) for |y| <= 1/alpha. (B,) lengths in, (B,) lambdas out."""
    # BEGIN SOLUTION
    return (1 - 1 / (alpha * lengths.float())).clamp(min=0.0)
    # END SOLUTION
