"""ReMax: advantage, loss, and end-to-end runs (single process and 2-process gloo)."""
import subprocess
import sys

import pytest
import torch

import common
from support import run
from conftest import assert_params_changed  # noqa: E402
from remax import remax_advantages, remax_loss

from conftest import ROOT


def test_remax_advantage_subtracts_the_greedy_reward():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    greedy = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert remax_advantages(rewards, greedy).tolist() == [0.0, -1.0, 1.0, 0.0]


def test_remax_advantage_is_invariant_to_a_per_prompt_reward_offset():
    """The baseline removes any per-prompt shift (what --reward_scales hetero adds)."""
    rewards, greedy = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    offset = torch.tensor([5.0, -3.0])
    assert torch.equal(remax_advantages(rewards + offset, greedy + offset), remax_advantages(rewards, greedy))


def test_remax_loss_returns_fold_kl_reward_to_go():
    logp = torch.zeros(1, 3, requires_grad=True)
    kl = torch.tensor([[0.5, 1.0, 2.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = remax_loss(logp, torch.tensor([1.0]), kl, mask, beta=0.1)
    # G_t = A - beta * sum_{t'>=t} k1_t' over kept tokens: [1 - 0.15, 1 - 0.1, 1 - 0]
    assert stats["return_mean"].item() == pytest.approx((0.85 + 0.9) / 2)
    loss.backward()
    # token-mean over the 2 kept tokens: d loss / d logp_t = -G_t / 2; masked token gets 0
    assert torch.allclose(logp.grad, torch.tensor([[-0.425, -0.45, 0.0]]))


def test_remax_loss_does_not_backpropagate_through_the_return():
    """The return G_t is a reward: a k1 that still carries its gradient must not add one.
    logp (-1, -2), ref_logp (-1.5, -1): k1 = (0.5, -1), reward-to-go (-0.5, -1), beta 0.1, A = 1:
    G = (1.05, 1.1) and, token-mean over 2 tokens, d loss / d logp = -G / 2."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    kl = logp - torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # not detached
    loss, _ = remax_loss(logp, torch.tensor([1.0], dtype=torch.float64), kl, torch.ones(1, 2), beta=0.1)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.525, -0.55]], dtype=torch.float64), rtol=0, atol=1e-12)


def test_remax_loss_gradient_is_reinforce_with_baseline():
    """Without KL, the gradient equals that of -mean_i (r_i - b_i) * log pi(y_i) per token."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    adv = remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    loss, _ = remax_loss(logp, adv, torch.zeros_like(logp), mask, beta=0.05, loss_agg="seq-mean-token-mean")
    (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
    expected = -(adv[0] * logp[0].sum() / 3 + adv[1] * logp[1, 0]) / 2
    (g_expected,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(g, g_expected)


def test_remax_loss_seq_mean_token_sum_norm_divides_by_max_len_not_the_batch_width():
    """main() aggregates with max_len = --max_new_tokens (8): a batch padded to 3 tokens still divides by 8."""
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = remax_loss(logp, torch.tensor([1.0, 2.0]), torch.zeros(2, 3), torch.tensor([[1, 1, 1], [1, 0, 0]]), 0.05,
                         common.Aggregation("seq-mean-token-sum-norm", 8))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]]) / 8 / 2)


@pytest.mark.parametrize("args, flag", [
    (["--batch_size", "0"], "--batch_size"),
    (["--learning_rate", "-1"], "--learning_rate"),
    (["--temperature", "0"], "--temperature"),
    (["--beta", "-0.1"], "--beta"),
    (["--baseline", "mean"], "--baseline"),
    (["--loss_agg", "sum"], "--loss_agg"),
    (["--top_p", "1.5"], "--top_p"),
    (["--model_name_or_path", "./no/such/model"], "--model_name_or_path"),
])
def test_bad_input_gives_a_clear_error_naming_the_flag(args, flag, tmp_path):
    out = subprocess.run([sys.executable, "remax.py", *args, "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0
    assert flag in out.stderr
    assert "Traceback" not in out.stderr


def test_remax_end_to_end_writes_metrics_plot_and_model(tmp_path):
    out = subprocess.run([sys.executable, "lab/remax.py", "--num_steps", "3", "--eval_every", "2", "--batch_size", "16",
                          "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = run.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["train/generated"] == 2 * 16  # sampled + greedy
    for key in ("train/reward", "train/greedy_reward", "train/adv_mean", "train/kl_seq", "train/entropy", "train/grad_norm",
                "train/completion_len", "time/tokens_per_s", "time/generation_s"):
        assert key in rows[1], key
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert_params_changed(tmp_path / "final")

