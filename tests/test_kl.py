"""KL estimators, docs/algorithms.md, by exact enumeration: first one categorical (samples
y ~ q = softmax(theta), target KL(q || p)), then sequences of 2 tokens, then samples from another
policy mu. Gradients by autograd on theta."""
import itertools

import torch

from common import aggregate_loss, kl_k1, kl_k2, kl_k3, kl_penalty, reward_to_go
from lab.losses import ratio_weighted_kl

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
    return torch.autograd.grad(scalar, theta, retain_graph=True)[0]


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
    """E_q[grad k1] = E_q[grad log q] = 0. Zero in expectation only: per sample the gradient of k1
    is +grad log q(y) (k1 = log q - log p), which is not 0, so the test also sees the sign."""
    theta, ref_logp = setup()
    g = grad(expectation(theta, ref_logp, kl_k1), theta)
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-12)
    for y in (0, 3):
        score = grad(torch.log_softmax(theta, 0)[y], theta)
        per_sample = grad(kl_k1(torch.log_softmax(theta, 0), ref_logp)[y], theta)
        assert close(per_sample, score) and score.abs().max() > 0.1


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


def test_kl_penalty_is_the_estimator_it_names_and_k3_by_default():
    """GRPO's --kl_estimator: the term is the named estimator's, in value and in gradient through logp."""
    theta, ref_logp = setup()
    logq = torch.log_softmax(theta, 0)
    for name, estimator in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        term = kl_penalty(logq, ref_logp, name)
        assert close(term, estimator(logq, ref_logp)), name
        assert close(grad(term.sum(), theta), grad(estimator(logq, ref_logp).sum(), theta)), name
    assert close(kl_penalty(logq, ref_logp), kl_k3(logq, ref_logp))


def test_k3_of_a_truncated_policy_underestimates_the_kl_by_the_reference_mass_outside_the_kept_set():
    """--top_k / --top_p: q is softmax(theta) kept on its top 3 of 6 outcomes and renormalised, the
    reference p is not truncated. E_q[p/q] = p(kept) < 1, so E_q[k3] = KL(q || p) - p(not kept), while
    E_q[k1] stays KL(q || p)."""
    theta, ref_logp = setup()
    kept = torch.zeros(6, dtype=torch.bool)
    kept[torch.topk(theta.detach(), 3).indices] = True
    logq = torch.log_softmax(theta.detach().masked_fill(~kept, float("-inf")), 0)
    q = logq.exp()[kept]  # the expectations run over the kept outcomes: q = 0 elsewhere
    true = (q * (logq - ref_logp)[kept]).sum()  # KL(q || p)
    outside = ref_logp.exp()[~kept].sum()
    assert outside > 0.1  # 0.333 here
    assert torch.allclose((q * kl_k1(logq, ref_logp)[kept]).sum(), true)
    assert torch.allclose((q * kl_k3(logq, ref_logp)[kept]).sum(), true - outside)


def test_k3_is_not_clamped():
    """No clamp on the log-ratio or on k3 (verl clamps to 20 and 10): the value stays exact."""
    logp, ref_logp = torch.tensor([0.0], dtype=D), torch.tensor([30.0], dtype=D)
    assert torch.allclose(kl_k3(logp, ref_logp), torch.exp(torch.tensor([30.0], dtype=D)) - 31)


# ----------------------------------------------------------------------------------------
# Sequences. A tabular policy over T tokens from a vocabulary of V: one row of logits per
# prefix. Every sequence is enumerated, so each expectation below is exact.
# ----------------------------------------------------------------------------------------
class Sequences:
    def __init__(self, T=2, V=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        prefixes = [p for n in range(T) for p in itertools.product(range(V), repeat=n)]
        self.row = {p: i for i, p in enumerate(prefixes)}
        self.theta = torch.randn(len(prefixes), V, generator=g, dtype=D).requires_grad_()
        self.ref = torch.log_softmax(torch.randn(len(prefixes), V, generator=g, dtype=D), -1)
        self.mu = torch.log_softmax(torch.randn(len(prefixes), V, generator=g, dtype=D), -1)  # another sampler
        self.seqs = list(itertools.product(range(V), repeat=T))

    def per_token(self, table):
        """(N, T) log-probs of every sequence's tokens under a (prefixes, V) table of log-probs."""
        return torch.stack([torch.stack([table[self.row[y[:t]], y[t]] for t in range(len(y))]) for y in self.seqs])

    def logps(self):
        """logp (with grad), ref_logp, mu_logp, each (N, T); P and P_mu, the sequence probabilities (N,)."""
        logp = self.per_token(torch.log_softmax(self.theta, -1))
        ref_logp, mu_logp = self.per_token(self.ref), self.per_token(self.mu)
        return logp, ref_logp, mu_logp, logp.sum(1).exp().detach(), mu_logp.sum(1).exp()

    def state_weights(self, table):
        """(prefixes,) probability of reaching each prefix under a table, detached."""
        table = table.detach()
        return torch.stack([torch.stack([table[self.row[p[:t]], p[t]] for t in range(len(p))]).sum().exp() if p
                            else torch.tensor(1.0, dtype=D) for p in self.row])

    def per_state_kl(self, states, reverse=True):
        """sum_h d(h) KL(pi(.|h) || ref(.|h)) (or the forward KL), states h weighted by d, held fixed."""
        logq = torch.log_softmax(self.theta, -1)
        p, q = (logq, self.ref) if reverse else (self.ref, logq)
        return (self.state_weights(states) * (p.exp() * (p - q)).sum(-1)).sum()

    def sequence_kl(self, reverse=True):
        logp, ref_logp, _, _, _ = self.logps()
        p, q = (logp.sum(1), ref_logp.sum(1)) if reverse else (ref_logp.sum(1), logp.sum(1))
        return (p.exp() * (p - q)).sum()


def close(a, b):
    return torch.allclose(a, b, rtol=0, atol=1e-12)


def test_k1_reward_to_go_gradient_is_sequence_reverse_kl():
    """E[sum_t s_t sum_{t'>=t} k1_t'], k1 detached: what remax.py and ppo.py (gamma = lam = 1) do."""
    m = Sequences()
    logp, ref_logp, _, P, _ = m.logps()
    mask = torch.ones_like(logp)
    to_go = reward_to_go(kl_k1(logp.detach(), ref_logp), mask)
    g = grad((P[:, None] * to_go * logp).sum(), m.theta)
    assert close(g, grad(m.sequence_kl(), m.theta))


def test_k1_summed_over_the_sequence_gives_the_same_gradient_in_expectation():
    """E[(sum_t k1_t) * sum_t s_t]: rloo.py's whole-sequence penalty. The extra terms k1_t s_t' with
    t' > t have mean zero, so the expectation is the reward-to-go one."""
    m = Sequences()
    logp, ref_logp, _, P, _ = m.logps()
    seq_k1 = kl_k1(logp.detach(), ref_logp).sum(1, keepdim=True)
    g = grad((P[:, None] * seq_k1 * logp).sum(), m.theta)
    assert close(g, grad(m.sequence_kl(), m.theta))


def normaliser_case():
    """Completions of 1 or 2 tokens (token 0 is the EOS), every batch of B = 2 enumerated; the loss is
    remax_loss's KL part, aggregate(reward_to_go(k1) * logp). Returns expected_gradient(mode), the target
    grad KL_seq(pi || ref) and E|y|."""
    g = torch.Generator().manual_seed(0)
    rows = {(): 0, (1,): 1, (2,): 2}  # the prefixes that continue; (0,) has ended
    theta = torch.randn(3, 3, generator=g, dtype=D).requires_grad_()
    ref = torch.log_softmax(torch.randn(3, 3, generator=g, dtype=D), -1)
    seqs = [(0,)] + [(a, b) for a in (1, 2) for b in (0, 1, 2)]
    logq = torch.log_softmax(theta, -1)

    def per_token(table, y):  # (2,) log-probs of y's tokens, 0 on the padding
        padding = [torch.zeros((), dtype=D)] * (2 - len(y))
        return torch.stack([table[rows[y[:t]], y[t]] for t in range(len(y))] + padding)

    logp = torch.stack([per_token(logq, y) for y in seqs])  # (7, 2)
    ref_logp = torch.stack([per_token(ref, y) for y in seqs])
    mask = torch.tensor([[1, 1 if len(y) == 2 else 0] for y in seqs])
    P = logp.sum(1).exp().detach()
    target = grad((logp.sum(1).exp() * (logp - ref_logp).sum(1)).sum(), theta)  # grad KL_seq(pi || ref)
    to_go = reward_to_go(kl_k1(logp.detach(), ref_logp), mask)

    def expected_gradient(mode):
        loss = sum(P[i] * P[j] * aggregate_loss((to_go * logp)[[i, j]], mask[[i, j]], mode, max_len=2)
                   for i in range(7) for j in range(7))
        return grad(loss, theta)

    return expected_gradient, target, (P * mask.sum(1)).sum()


def off_every_multiple(g, direction):
    """The distance from g to the nearest multiple of direction."""
    return (g - (g * direction).sum() / (direction * direction).sum() * direction).norm()


def test_k1_reward_to_go_in_a_loss_gives_the_sequence_kl_gradient_only_with_a_constant_normaliser():
    """Its expected gradient is grad KL_seq / L_max with seq-mean-token-sum-norm. seq-mean-token-mean weighs
    each sequence's term by 1 / |y|, token-mean divides the batch's sum by its token count (a ratio estimator,
    biased at this batch size): neither expectation is a multiple of grad KL_seq, nor token-mean's that of the
    infinite batch, grad KL_seq / E|y|."""
    expected_gradient, target, mean_len = normaliser_case()
    assert close(expected_gradient("seq-mean-token-sum-norm"), target / 2)
    assert off_every_multiple(expected_gradient("seq-mean-token-mean"), target) > 0.03  # 0.069; |target| 0.173
    token_mean = expected_gradient("token-mean")
    assert off_every_multiple(token_mean, target) > 0.02  # 0.042
    assert (token_mean - target / mean_len).norm() > 0.02  # 0.042; E|y| = 1.155


def test_per_token_k2_in_the_loss_is_the_per_state_reverse_kl_not_the_sequence_kl():
    m = Sequences()
    logp, ref_logp, _, P, _ = m.logps()
    g = grad((P[:, None] * kl_k2(logp, ref_logp)).sum(), m.theta)
    assert close(g, grad(m.per_state_kl(states=torch.log_softmax(m.theta, -1)), m.theta))
    gap = (g - grad(m.sequence_kl(), m.theta)).norm()
    assert gap > 0.05  # 0.0794 here, against a sequence-KL gradient of norm 0.656


def test_per_token_k3_in_the_loss_is_the_per_state_forward_kl_not_the_sequence_kl():
    m = Sequences()
    logp, ref_logp, _, P, _ = m.logps()
    g = grad((P[:, None] * kl_k3(logp, ref_logp)).sum(), m.theta)
    assert close(g, grad(m.per_state_kl(states=torch.log_softmax(m.theta, -1), reverse=False), m.theta))
    forward = grad(m.sequence_kl(reverse=False), m.theta)  # KL_seq(ref || pi): states visited by ref
    assert (g - forward).norm() > 0.5  # 0.626 here, against a norm of 1.154
    assert (g - grad(m.sequence_kl(), m.theta)).norm() > 0.3  # 0.448 from the reverse sequence KL's


def test_penalising_each_token_by_its_own_k1_is_the_per_state_reverse_kl_not_the_sequence_kl():
    """The official ReMax code's return A - beta * k1_t (no sum over later tokens): in expectation
    the same gradient as per-token k2 in the loss."""
    m = Sequences()
    logp, ref_logp, _, P, _ = m.logps()
    g = grad((P[:, None] * kl_k1(logp.detach(), ref_logp) * logp).sum(), m.theta)
    assert close(g, grad((P[:, None] * kl_k2(logp, ref_logp)).sum(), m.theta))
    assert (g - grad(m.sequence_kl(), m.theta)).norm() > 0.05


# ----------------------------------------------------------------------------------------
# Off-policy: the tokens were sampled by mu (the policy before the updates, or an inference
# engine), w = pi_theta / mu per token. On one categorical (T = 1) the targets are exact KLs;
# on a sequence the states are mu's, held fixed.
# ----------------------------------------------------------------------------------------
def test_ratio_weighted_k1_and_k3_are_unbiased_kl_values_off_policy():
    m = Sequences(T=1)
    logp, ref_logp, mu_logp, _, P_mu = m.logps()
    w = torch.exp(logp - mu_logp).detach()
    true = m.sequence_kl()
    assert close((P_mu[:, None] * w * kl_k1(logp, ref_logp)).sum(), true)
    assert close((P_mu[:, None] * w * kl_k3(logp, ref_logp)).sum(), true)
    assert not torch.allclose((P_mu[:, None] * kl_k3(logp, ref_logp)).sum(), true, atol=1e-3)  # without w


def test_ratio_weighted_kl_with_the_ratio_in_the_graph_gives_the_reverse_kl_gradient_off_policy():
    """grad E_mu[w k] = grad E_pi[k] as a function of theta: k1 and k3 give grad KL(pi || ref)
    (DeepSeek-V3.2's weighted k3, lab/losses.py's ratio_weighted_kl); k2 does not."""
    m = Sequences(T=1)
    logp, ref_logp, mu_logp, _, P_mu = m.logps()
    reverse = grad(m.sequence_kl(), m.theta)
    for estimator in ("k1", "k3"):
        g = grad((P_mu[:, None] * ratio_weighted_kl(logp, ref_logp, mu_logp, estimator)).sum(), m.theta)
        assert close(g, reverse), estimator
    g = grad((P_mu[:, None] * ratio_weighted_kl(logp, ref_logp, mu_logp, "k2")).sum(), m.theta)
    assert not torch.allclose(g, reverse, atol=1e-3)


def test_detached_ratio_times_k3_gives_the_forward_kl_gradient_and_times_k2_the_reverse():
    m = Sequences(T=1)
    logp, ref_logp, mu_logp, _, P_mu = m.logps()
    w = torch.exp(logp - mu_logp).detach()
    g3 = grad((P_mu[:, None] * w * kl_k3(logp, ref_logp)).sum(), m.theta)
    g2 = grad((P_mu[:, None] * w * kl_k2(logp, ref_logp)).sum(), m.theta)
    assert close(g3, grad(m.sequence_kl(reverse=False), m.theta))
    assert close(g2, grad(m.sequence_kl(), m.theta))


def test_unweighted_k1_off_policy_pushes_away_from_the_sampler_and_k3_gives_neither_kl_gradient():
    m = Sequences(T=1)
    logp, ref_logp, mu_logp, _, P_mu = m.logps()
    g1 = grad((P_mu[:, None] * kl_k1(logp, ref_logp)).sum(), m.theta)
    kl_mu_pi = (P_mu[:, None] * (mu_logp - logp)).sum()  # KL(mu || pi)
    assert close(g1, -grad(kl_mu_pi, m.theta))
    g3 = grad((P_mu[:, None] * kl_k3(logp, ref_logp)).sum(), m.theta)
    for target in (m.sequence_kl(), m.sequence_kl(reverse=False)):
        assert not torch.allclose(g3, grad(target, m.theta), atol=1e-2)


def test_ratio_weighted_k3_on_a_sequence_is_the_per_state_reverse_kl_over_the_samplers_states():
    m = Sequences()
    logp, ref_logp, mu_logp, _, P_mu = m.logps()
    g = grad((P_mu[:, None] * ratio_weighted_kl(logp, ref_logp, mu_logp, "k3")).sum(), m.theta)
    assert close(g, grad(m.per_state_kl(states=m.mu), m.theta))
    assert (g - grad(m.sequence_kl(), m.theta)).norm() > 0.05


def test_kl_is_weight_on_policy_gives_k3_the_gradient_of_k2():
    """With one update per batch old_logp = logp.detach(): the ratio is 1 in value but carries
    the score, and grad(w k3) = w k1 s = grad k2 per sample, so the value is k3's (unbiased) and
    the gradient is the per-state reverse KL's."""
    logp = torch.tensor([-0.3, -2.0, -1.1], dtype=D, requires_grad=True)
    ref_logp = torch.tensor([-1.0, -0.5, -1.1], dtype=D)
    weighted = ratio_weighted_kl(logp, ref_logp, logp.detach(), "k3")
    assert close(weighted, kl_k3(logp, ref_logp))
    assert close(grad(weighted.sum(), logp), grad(kl_k2(logp, ref_logp).sum(), logp))
    assert close(grad(kl_penalty(logp, ref_logp, "k3").sum(), logp), 1 - torch.exp(ref_logp - logp))


def test_ratio_weighted_k3_gradient_is_exact_in_fp32_where_the_reference_is_far_more_likely():
    """d(ratio * k3)/dlogp = ratio * k1. At log(ref / pi) = 18 .. 40, in fp32, ratio_weighted_kl's gradient agrees
    with that fp64 closed form to 1e-6, and its value with ratio * k3 in fp64. Written as ratio * k3,
    autograd forms ratio * k3 + ratio * (1 - ref / pi), two terms of size ref / pi_old whose sum is
    ratio * k1: in fp32 that sum is off by more than 10% at 18 and is exactly 0 from about 20 on."""
    log_ref_over_pi = torch.tensor([18.0, 19.0, 20.5, 25.0, 40.0])
    ref_logp = torch.full((5,), -0.5)
    logp = (ref_logp - log_ref_over_pi).requires_grad_()
    old_logp = logp.detach() + torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4])  # off-policy, and on it (0.0)
    kl = ratio_weighted_kl(logp, ref_logp, old_logp, "k3")
    (g,) = torch.autograd.grad(kl.sum(), logp)
    logp64, ref64, old64 = logp.detach().double(), ref_logp.double(), old_logp.double()
    ratio64 = torch.exp(logp64 - old64)
    torch.testing.assert_close(g.double(), ratio64 * (logp64 - ref64), rtol=1e-6, atol=0)
    torch.testing.assert_close(kl.double(), ratio64 * kl_k3(logp64, ref64), rtol=1e-6, atol=0)
    naive = torch.exp(logp - old_logp) * kl_k3(logp, ref_logp)
    (g_naive,) = torch.autograd.grad(naive.sum(), logp)
    error = (g_naive.double() / (ratio64 * (logp64 - ref64)) - 1).abs()
    assert error.min() > 0.1 and (g_naive[2:] == 0).all()


if __name__ == "__main__":  # `PYTHONPATH=. python tests/test_kl.py`: the figures docs/algorithms.md quotes
    m = Sequences()
    logp, ref_logp, _, P, _ = m.logps()
    reverse, forward = grad(m.sequence_kl(), m.theta), grad(m.sequence_kl(reverse=False), m.theta)
    k2 = grad((P[:, None] * kl_k2(logp, ref_logp)).sum(), m.theta)
    k3 = grad((P[:, None] * kl_k3(logp, ref_logp)).sum(), m.theta)
    print(f"2-token model: |grad KL_seq(pi || ref)| = {reverse.norm():.3f}; "
          f"per-token k2 off by {(k2 - reverse).norm():.3f}; "
          f"|grad KL_seq(ref || pi)| = {forward.norm():.3f}; per-token k3 off from it by {(k3 - forward).norm():.3f} "
          f"and from the reverse one by {(k3 - reverse).norm():.3f}")
    expected_gradient, target, mean_len = normaliser_case()
    token_mean = expected_gradient("token-mean")
    print(f"batches of two: |grad KL_seq| = {target.norm():.3f}, E|y| = {mean_len:.3f}; seq-mean-token-mean "
          f"{off_every_multiple(expected_gradient('seq-mean-token-mean'), target):.3f} from every multiple of it, "
          f"token-mean {off_every_multiple(token_mean, target):.3f}, and {(token_mean - target / mean_len).norm():.3f} "
          "from grad KL_seq / E|y|")
