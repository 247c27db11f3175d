"""VAPO (Yue et al., 2025, arXiv 2504.05118): PPO with a critic made reliable for long reasoning. Its pieces are
flags of the lab's PPO (`python lab/ppo.py --vapo True`); this file holds the one that is a new formula, the
positive-example LM loss, a pure function that lab/ppo.py adds to the policy loss in one line. The others are
ppo.py's (decoupled and length-adaptive GAE, clip-higher) or lab/ppo.py's loop (value pretraining).
Equations: docs/algorithms.md, "VAPO".

    L_NLL = -(1 / N) sum_{i correct} sum_t logp_{i,t},   N = the number of the correct samples' tokens
    loss  = L_PPO + mu * L_NLL                             (mu: --pos_lm_coef, VAPO's 0.1)
"""
import torch

import common


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
