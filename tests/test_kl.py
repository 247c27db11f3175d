"""KL estimators, docs/algorithms.md, by exact enumeration over a small categorical.
Samples y ~ q = softmax(theta), target KL(q || p); gradients by autograd on theta."""
import torch

from common import kl_k1, kl_k2, kl_k3

D = torch.float64


def setup(seed=0, n=6, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    theta = (scale * torch.randn(n, generator=g, dtype=D)).requires_grad_()
    ref_logits = scale * torch.randn(n, generator=g, dtype=D)
    return theta, torch.log_softmax(ref_logits, 0)


def expectation(theta, ref_logp, fn):
    """E_{y~q}[fn(logq(y), logp(y))] with the sampling weights q held fixed (no gradient)."""
    logq = torch.log_softmax(theta, 0)
    return (logq.exp().detach() * fn(logq, ref_logp)).sum()


def kl(logq, logp):
    return (logq.exp() * (logq - logp)).sum()


def grad(scalar, theta):
    return torch.autograd.grad(scalar, theta)[0]


def test_k1_and_k3_are_unbiased_for_reverse_kl():
    theta, ref_logp = setup()
    true = kl(torch.log_softmax(theta, 0), ref_logp)
    assert torch.allclose(expectation(theta, ref_logp, kl_k1), true)
    assert torch.allclose(expectation(theta, ref_logp, kl_k3), true)


def test_k3_is_nonnegative_per_sample_and_k1_is_not():
    theta, ref_logp = setup()
    logq = torch.log_softmax(theta, 0)
    assert (kl_k3(logq, ref_logp) >= 0).all()
    assert (kl_k1(logq, ref_logp) < 0).any()


def test_k2_is_biased_at_third_order():
    """E[k2] - KL shrinks like eps^3 as p approaches q: halving eps divides the bias by ~8."""
    theta, _ = setup(1)
    direction = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    biases = []
    for eps in (0.02, 0.01):  # small enough for the asymptotic regime
        ref_logp = torch.log_softmax(theta.detach() + eps * direction, 0)
        biases.append((expectation(theta, ref_logp, kl_k2) - kl(torch.log_softmax(theta, 0), ref_logp)).item())
    assert biases[0] != 0
    assert 6.0 < biases[0] / biases[1] < 10.0


def test_k1_loss_gradient_is_zero():
    theta, ref_logp = setup()
    g = grad(expectation(theta, ref_logp, kl_k1), theta)
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-12)


def test_k2_loss_gradient_is_reverse_kl():
    theta, ref_logp = setup()
    g = grad(expectation(theta, ref_logp, kl_k2), theta)
    target = grad(kl(torch.log_softmax(theta, 0), ref_logp), theta)
    assert torch.allclose(g, target)


def test_k3_loss_gradient_is_forward_kl():
    theta, ref_logp = setup()
    g = grad(expectation(theta, ref_logp, kl_k3), theta)
    forward = grad(kl(ref_logp, torch.log_softmax(theta, 0)), theta)  # KL(p || q)
    reverse = grad(kl(torch.log_softmax(theta, 0), ref_logp), theta)
    assert torch.allclose(g, forward)
    assert not torch.allclose(g, reverse, atol=1e-3)


def reward_penalty_gradient(theta, ref_logp, estimator):
    """E_q[k(y) * grad log q(y)] with k detached: the estimator used as a reward penalty."""
    logq = torch.log_softmax(theta, 0)
    penalty = estimator(logq, ref_logp).detach()
    return grad((logq.exp().detach() * penalty * logq).sum(), theta)


def test_k1_reward_penalty_gradient_is_reverse_kl():
    theta, ref_logp = setup()
    target = grad(kl(torch.log_softmax(theta, 0), ref_logp), theta)
    assert torch.allclose(reward_penalty_gradient(theta, ref_logp, kl_k1), target)


def test_k2_and_k3_reward_penalties_give_wrong_gradients():
    theta, ref_logp = setup()
    target = grad(kl(torch.log_softmax(theta, 0), ref_logp), theta)
    for estimator in (kl_k2, kl_k3):
        assert not torch.allclose(reward_penalty_gradient(theta, ref_logp, estimator), target, atol=1e-3)


def test_estimators_hand_computed_values():
    logp, ref_logp = torch.tensor([-1.0], dtype=D), torch.tensor([-2.0], dtype=D)
    assert torch.allclose(kl_k1(logp, ref_logp), torch.tensor([1.0], dtype=D))
    assert torch.allclose(kl_k2(logp, ref_logp), torch.tensor([0.5], dtype=D))
    # k3 = exp(-1) - (-1) - 1 = exp(-1)
    assert torch.allclose(kl_k3(logp, ref_logp), torch.exp(torch.tensor([-1.0], dtype=D)))
