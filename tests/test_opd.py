"""On-policy distillation (opd.py, docs/algorithms.md): the sampled token's advantage is minus k1 of the per-token
reverse KL; its expected gradient, by exact enumeration, is the per-state reverse KL's gradient (the full-vocabulary
term's), with the states held fixed, and not the sequence KL's; the run checks the tokenizer first and distils."""
import math
import subprocess
import sys

import pytest
import torch

import opd
import rloo
from conftest import ROOT
from opd import full_reverse_kl, opd_advantages, opd_loss, rloo_advantages
from support.run import read_metrics

F64 = torch.float64
NAN = float("nan")


def test_task_advantage_is_rloos_leave_one_out():
    """opd.py carries its own copy of RLOO's advantage (a file imports no other algorithm file): r_i minus the mean
    of the other G - 1 rewards of its group, equal to rloo.py's on random groups."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 4.0, 2.0], dtype=F64)
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -4 / 3, 4 / 3, 4 / 3, -4 / 3], dtype=F64)
    torch.testing.assert_close(rloo_advantages(rewards, 4), expected, rtol=1e-12, atol=0)
    g = torch.Generator().manual_seed(0)
    for G in (2, 3, 5):
        rewards = torch.randn(4 * G, generator=g, dtype=F64)
        assert torch.equal(rloo_advantages(rewards, G), rloo.rloo_advantages(rewards, G))


def test_advantage_hand_values_student_first():
    """A_t = -lambda (log pi_s - log pi_T) + w A_i: a token the teacher finds likelier gains."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-0.5, -4.0], [-0.5, NAN]], dtype=F64)
    adv = opd_advantages(logp, teacher, torch.tensor([1.0, -2.0], dtype=F64), kl_coef=2.0, reward_weight=0.5)
    expected = torch.tensor([[-2 * -0.5 + 0.5, -2 * 2.0 + 0.5], [0.0 - 1.0, NAN]], dtype=F64)
    torch.testing.assert_close(adv, expected, equal_nan=True)
    assert not adv.requires_grad  # detached: the student's log-prob enters only through the loss


def test_loss_hand_value_and_a_nan_advantage_in_the_padding_never_reaches_the_gradient():
    """seq-mean-token-sum: loss = mean_i sum_t -A_t logp_t; d loss / d logp_t = -A_t / B on the mask, 0 off it."""
    logp = torch.tensor([[-1.0, -2.0, 0.3], [-0.5, 5.0, 7.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, NAN], [3.0, NAN, math.inf]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = opd_loss(logp, adv, mask)
    assert loss.item() == pytest.approx(((1.0 - 4.0) + 1.5) / 2, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 1.0, 0.0], [-1.5, 0.0, 0.0]], dtype=F64))
    assert stats["adv_token_mean"].item() == pytest.approx(2 / 3)
    # with the exact KL: + lambda * KL_t per token, and its mean in the statistics
    full_kl = torch.tensor([[0.5, 0.25, NAN], [1.0, NAN, NAN]], dtype=F64, requires_grad=True)
    loss, stats = opd_loss(logp.detach(), adv, mask, full_kl=full_kl, kl_coef=0.5)
    assert loss.item() == pytest.approx(((1.0 - 4.0) + 1.5) / 2 + 0.5 * (0.75 + 1.0) / 2, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(full_kl.grad, torch.tensor([[0.25, 0.25, 0.0], [0.25, 0.0, 0.0]], dtype=F64))
    assert stats["full_kl"].item() == pytest.approx(1.75 / 3)


def test_full_reverse_kl_hand_value_and_direction():
    """sum_v p_s (log p_s - log p_T): student (0.5, 0.5), teacher (0.9, 0.1) gives 0.5 log(0.5/0.9) + 0.5 log 5,
    not the forward KL 0.9 log 1.8 + 0.1 log 0.2."""
    s, t = torch.tensor([0.5, 0.5], dtype=F64).log(), torch.tensor([0.9, 0.1], dtype=F64).log()
    value = full_reverse_kl(s[None, None], t[None, None]).item()
    assert value == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0), rel=1e-12)
    assert value != pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2))


def test_sampled_advantage_is_unbiased_for_the_per_state_kl_and_its_expected_gradient_is_the_full_vocab_gradient():
    """One state, V = 5, exact enumeration over the drawn token y ~ pi_s: E[-A_y] = KL(pi_s || pi_T), and
    E_y[d(-A_y log pi_s(y)) / d theta] = d KL(pi_s || pi_T) / d theta = d full_reverse_kl / d theta."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g, dtype=F64, requires_grad=True)
    teacher = torch.randn(5, generator=g, dtype=F64).log_softmax(-1)
    logp = theta.log_softmax(-1)
    probs = logp.exp().detach()
    adv = opd_advantages(logp[None], teacher[None], torch.zeros(1, dtype=F64))[0]  # (V,): each token drawn
    kl = full_reverse_kl(logp, teacher)
    assert (probs * -adv).sum().item() == pytest.approx(kl.item(), rel=1e-12)
    (expected_grad,) = torch.autograd.grad((probs * -adv * logp).sum(), theta, retain_graph=True)
    (kl_grad,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected_grad, kl_grad, rtol=1e-12, atol=1e-15)


def two_token_tree(seed=1, V=3):
    """A two-token student (theta1: (V,), theta2: (V, V) the second token's logits given the first) and teacher."""
    g = torch.Generator().manual_seed(seed)
    theta1 = torch.randn(V, generator=g, dtype=F64, requires_grad=True)
    theta2 = torch.randn(V, V, generator=g, dtype=F64, requires_grad=True)
    t1, t2 = torch.randn(V, generator=g, dtype=F64).log_softmax(-1), torch.randn(V, V, generator=g, dtype=F64)
    return theta1, theta2, t1, t2.log_softmax(-1)


def test_discount_zero_gradient_is_the_per_state_kl_with_the_states_held_fixed_not_the_sequence_kl():
    """Enumerate every two-token completion (y1, y2). The loss's expected gradient (per-token advantages, a discount
    of 0) equals grad [KL_1 + sum_y1 sg(p(y1)) KL_2(y1)], the per-state KLs at fixed states; the gradient of the
    sequence KL has one more term, sum_y1 grad p(y1) KL_2(y1) (how the first token changes the second state), which
    the return (A_1 = -(k1_1 + k1_2), the reward-to-go) restores."""
    theta1, theta2, t1, t2 = two_token_tree()
    V = theta1.shape[0]
    lp1, lp2 = theta1.log_softmax(-1), theta2.log_softmax(-1)  # (V,), (V, V)
    y1, y2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    y1, y2 = y1.reshape(-1), y2.reshape(-1)  # every completion
    logp = torch.stack([lp1[y1], lp2[y1, y2]], 1)  # (V*V, 2)
    teacher = torch.stack([t1[y1], t2[y1, y2]], 1)
    prob = logp.sum(1).exp().detach()  # (V*V,) each completion's probability
    mask = torch.ones_like(logp, dtype=torch.long)
    adv = opd_advantages(logp, teacher, torch.zeros(len(prob), dtype=F64))

    def expected_grad(per_token_adv):
        loss = (prob * (-per_token_adv * logp).sum(1)).sum()  # E over completions of the per-sequence loss
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, (theta1, theta2), retain_graph=True)])

    def grad_of(value):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, (theta1, theta2), retain_graph=True)])

    kl1 = full_reverse_kl(lp1, t1)
    kl2 = full_reverse_kl(lp2, t2)  # (V,) at each second state
    fixed_states = kl1 + (lp1.exp().detach() * kl2).sum()
    sequence_kl = kl1 + (lp1.exp() * kl2).sum()
    ours = expected_grad(adv)
    torch.testing.assert_close(ours, grad_of(fixed_states), rtol=1e-10, atol=1e-12)
    assert (ours - grad_of(sequence_kl)).abs().max() > 1e-3  # the bias the docstring states
    to_go = torch.stack([adv.sum(1), adv[:, 1]], 1)  # the reward-to-go of the per-token advantages
    torch.testing.assert_close(expected_grad(to_go), grad_of(sequence_kl), rtol=1e-10, atol=1e-12)
    # the loss as the lesson computes it (aggregation included) gives the same expectation
    loss, _ = opd_loss(logp, adv, mask, "seq-mean-token-sum")
    assert loss.item() == pytest.approx((-(adv * logp).sum(1)).mean().item(), rel=1e-12)


# ---------------------------------------------------------------------------------------- a run
def run_opd(tmp_path, monkeypatch, *flags):
    monkeypatch.setattr(opd.helpers, "evaluate", lambda *args: {"eval/accuracy": 0.5})  # the step alone
    monkeypatch.setattr(sys, "argv", ["opd.py", "--num_steps", "1", "--batch_size", "8", "--output_dir",
                                      str(tmp_path), *flags])
    opd.main()
    return read_metrics(tmp_path / "metrics.jsonl")


def test_a_teacher_equal_to_the_student_gives_zero_advantage_and_zero_gradient(tmp_path, monkeypatch):
    """--teacher embedded_model (the student itself): every k1 is 0, so are the loss and its gradient. With
    --full_vocab_kl the exact KL is 0 and so is its gradient, sum_v p (log p - log q + 1) grad log p = sum_v grad p,
    in exact arithmetic; in float32 the sum of V terms rounds (1e-6 here)."""
    rows = run_opd(tmp_path / "sampled", monkeypatch, "--teacher", "embedded_model")
    assert rows[1]["train/kl_seq"] == 0.0 and rows[1]["train/loss"] == 0.0 and rows[1]["train/grad_norm"] == 0.0
    rows = run_opd(tmp_path / "full", monkeypatch, "--teacher", "embedded_model", "--full_vocab_kl")
    assert rows[1]["train/kl_seq"] == 0.0 and abs(rows[1]["train/full_kl"]) < 1e-6
    assert rows[1]["train/grad_norm"] < 1e-4


def test_one_step_with_the_embedded_teacher_and_the_task_reward(tmp_path, monkeypatch):
    rows = run_opd(tmp_path, monkeypatch, "--reward_weight", "1", "--full_vocab_kl")
    assert rows[1]["train/kl_seq"] != 0.0 and rows[1]["train/full_kl"] > 0 and math.isfinite(rows[1]["train/loss"])


def test_another_tokenizer_is_one_error_line_before_any_model_loads(tmp_path):
    out = subprocess.run([sys.executable, "opd.py", "--teacher", "embedded_model/agent", "--output_dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --teacher 'embedded_model/agent' has another tokenizer")
    assert not (tmp_path / "metrics.jsonl").exists()
