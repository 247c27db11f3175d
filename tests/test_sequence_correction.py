"""Sequence-level corrections for a sampler mu that is not the trained policy pi (docs/algorithms.md, Off-policy
corrections): the per-token weight pi_t / mu_t is biased for a sequence objective, the sequence weight
prod_t pi_t / mu_t is exact, the cap's bias, the per-token veto and the effective sample size. Exact enumeration of
every two-token sequence of a three-token vocabulary."""
import itertools
import math

import pytest
import torch

from lab import corrections

F64 = torch.float64
LN = math.log
V = 3
SEQUENCES = torch.tensor(list(itertools.product(range(V), repeat=2)))  # (9, 2): every y = (y1, y2)
MU_1 = torch.tensor([0.5, 0.3, 0.2], dtype=F64)  # the sampler: mu(y1), mu(y2 | y1)
MU_2 = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]], dtype=F64)
PI_1 = torch.tensor([0.2, 0.5, 0.3], dtype=F64)  # the policy trained: pi(y1), pi(y2 | y1)
PI_2 = torch.tensor([[0.3, 0.3, 0.4], [0.5, 0.1, 0.4], [0.2, 0.2, 0.6]], dtype=F64)
F = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0, 1.0, 0.5, 0.0, 1.0], dtype=F64)  # any function of the whole sequence
MASK = torch.ones(len(SEQUENCES), 2)


def per_token_logp(p1, p2):
    """(9, 2): log p(y1), log p(y2 | y1) for every sequence."""
    y1, y2 = SEQUENCES[:, 0], SEQUENCES[:, 1]
    return torch.stack([p1.log()[y1], p2.log()[y1, y2]], dim=1)


def policy():
    """pi's logits, with gradient, and its per-token log-probs."""
    logits_1, logits_2 = PI_1.log().requires_grad_(), PI_2.log().requires_grad_()
    return (logits_1, logits_2), per_token_logp(logits_1.softmax(-1), logits_2.softmax(-1))


def flat_grad(value, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(value, params, retain_graph=True)])


def test_sequence_weight_is_unbiased_for_a_sequence_objective_and_the_token_weight_is_not():
    params, logp = policy()
    rollout_logp = per_token_logp(MU_1, MU_2)
    mu = rollout_logp.sum(1).exp()  # (9,) the sampler's probability of each sequence, the expectation's weights
    objective = (logp.sum(1).exp() * F).sum()  # J = E_pi[f(y)]
    exact = flat_grad(objective, params)

    w_seq = corrections.sequence_is_weight(logp, rollout_logp, MASK, cap=1e9)  # (9,)
    assert not w_seq.requires_grad
    assert (mu * w_seq * F).sum().item() == pytest.approx(objective.item(), rel=1e-14)  # E_mu[w f] = E_pi[f]
    seq_grad = flat_grad((mu * w_seq * F * logp.sum(1)).sum(), params)  # E_mu[w f grad log pi(y)]
    seq_bias = ((seq_grad - exact).norm() / exact.norm()).item()

    w_tok = corrections.truncated_is_weight(logp, rollout_logp, cap=1e9)  # (9, 2) pi_t / mu_t
    tok_grad = flat_grad((mu * F * (w_tok * logp).sum(1)).sum(), params)  # E_mu[f sum_t w_t grad log pi_t]
    tok_bias = ((tok_grad - exact).norm() / exact.norm()).item()
    print(f"relative bias of the policy gradient: sequence weight {seq_bias:.1e}, token weight {tok_bias:.3f}")
    assert seq_bias < 1e-12
    assert tok_bias > 0.1  # the per-token weight corrects each token's distribution, not the prefix it follows


def test_the_cap_biases_the_sequence_weight_by_the_mass_above_it():
    _, logp = policy()
    rollout_logp = per_token_logp(MU_1, MU_2)
    mu = rollout_logp.sum(1).exp()
    w = (logp - rollout_logp).sum(1).exp().detach()  # the uncapped weights, 0.16 .. 3.2 here
    cap = 1.5
    capped = corrections.sequence_is_weight(logp, rollout_logp, MASK, cap=cap)
    torch.testing.assert_close(capped, w.clamp(max=cap))
    objective = (logp.sum(1).exp() * F).sum().item()
    # E_mu[min(w, C) f] = E_pi[f] - E_mu[(w - C)^+ f]: only the sequences the trainer favours most lose weight
    truncation = (mu * (w - cap).clamp(min=0) * F).sum().item()
    assert truncation > 0.05
    assert (mu * capped * F).sum().item() == pytest.approx(objective - truncation, rel=1e-12)


def test_sequence_weight_counts_only_valid_tokens_and_does_not_overflow():
    logp = torch.tensor([[LN(0.5), LN(0.2), LN(0.9)], [0.0, 0.0, 0.0]], dtype=F64)
    rollout_logp = torch.tensor([[LN(0.25), LN(0.4), LN(1e-9)], [-400.0, -400.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = corrections.sequence_is_weight(logp, rollout_logp, mask, cap=10.0)
    # row 0: 2 * 0.5 = 1 (the padding's ratio 9e8 ignored); row 1: exp(800) capped at 10, finite
    torch.testing.assert_close(w, torch.tensor([1.0, 10.0], dtype=F64))


def test_tis_veto_drops_a_sequence_with_one_valid_token_below_the_threshold():
    logp = torch.tensor([[LN(1e-5), LN(0.5)],     # one token with ratio 1e-5 < 1e-4: vetoed
                         [LN(0.9), LN(1e-6)],     # ratio 1e-6, but on padding: kept
                         [LN(2e-4), LN(0.1)],     # ratio 2e-4 >= 1e-4: kept
                         [LN(0.01), LN(0.01)]], dtype=F64)  # ratios 0.01: kept (the sequence ratio 1e-4 is not a veto)
    rollout_logp = torch.tensor([[0.0, LN(0.5)], [LN(0.9), 0.0], [0.0, LN(0.1)], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    keep = corrections.tis_veto_mask(logp.requires_grad_(), rollout_logp, mask, threshold=1e-4)
    assert keep.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert not keep.requires_grad


def test_effective_sample_size_is_one_for_equal_weights_and_one_over_n_for_one_weight():
    assert corrections.effective_sample_size(torch.tensor([0.7, 0.7, 0.7, 0.7])).value().item() == pytest.approx(1.0)
    assert corrections.effective_sample_size(torch.tensor([3.0, 0.0, 0.0, 0.0])).value().item() == pytest.approx(0.25)
    assert corrections.effective_sample_size(torch.tensor([2.0, 1.0, 1.0])).value().item() == pytest.approx(16 / 18)
    # token-level weights: the masked entries do not count; (2 + 1 + 1)^2 / (3 * (4 + 1 + 1))
    weights = torch.tensor([[2.0, 1.0, 50.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert corrections.effective_sample_size(weights, mask).value().item() == pytest.approx(16 / 18)
