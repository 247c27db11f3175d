"""RLOO (docs/algorithms.md): leave-one-out advantage, sequence-level REINFORCE loss, end-to-end runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from support import run  # noqa: E402
from conftest import assert_params_changed  # noqa: E402
from lab import losses as lab_losses  # noqa: E402
from rloo import Config, rloo_advantages, rloo_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def test_rloo_advantage_is_reward_minus_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 5.0, 3.0, 6.0], dtype=F64)
    # group 2: 2 - (5+3+6)/3 = -8/3, 5 - (2+3+6)/3 = 4/3, 3 - 13/3 = -4/3, 6 - 10/3 = 8/3
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -8 / 3, 4 / 3, -4 / 3, 8 / 3], dtype=F64)
    torch.testing.assert_close(rloo_advantages(rewards, group_size=4), expected)


def test_rloo_hand_computed_values_for_groups_of_three_and_five():
    # K = 3, rewards (3, 0, 6): the others' means are 3, 4.5, 1.5
    assert rloo_advantages(torch.tensor([3.0, 0.0, 6.0], dtype=F64), 3).tolist() == [0.0, -4.5, 4.5]
    # K = 5, one success: it is compared with 0, each failure with 1/4
    assert rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]), 5).tolist() == [1.0] + [-0.25] * 4


@pytest.mark.parametrize("K", [2, 3, 5])
def test_rloo_advantages_of_a_group_sum_to_zero_and_a_samples_baseline_ignores_its_own_reward(K):
    rewards = torch.randn(4 * K, dtype=F64, generator=torch.Generator().manual_seed(K))
    adv = rloo_advantages(rewards, K)
    torch.testing.assert_close(adv.view(-1, K).sum(1), torch.zeros(4, dtype=F64))
    moved = rewards.clone()
    moved[K + 1] += 2.0  # sample 1 of the second group
    delta = rloo_advantages(moved, K) - adv
    torch.testing.assert_close(delta[K + 1], torch.tensor(2.0, dtype=F64))
    assert delta[:K].abs().max() == 0 and delta[2 * K:].abs().max() == 0


def test_rloo_with_two_samples_is_the_reward_difference():
    assert rloo_advantages(torch.tensor([3.0, 1.0, 0.0, 1.0]), 2).tolist() == [2.0, -2.0, -1.0, 1.0]


def test_all_equal_group_gives_zero_advantage():
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5, -3.0, -3.0, -3.0, -3.0, 1.0, 0.0, 0.0, 0.0])
    adv = rloo_advantages(rewards, 4)
    assert adv[:8].tolist() == [0.0] * 8
    assert adv[8:].abs().min() > 0


def test_rloo_advantage_is_invariant_to_a_per_prompt_reward_offset():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    offset = torch.tensor([-5.0] * 3 + [2.0] * 3)
    assert torch.equal(rloo_advantages(rewards + offset, 3), rloo_advantages(rewards, 3))


def test_rloo_loss_treats_the_whole_sequence_as_one_action():
    """loss = -mean_i A_i sum_t logp_i,t: every kept token of sequence i gets gradient -A_i / B,
    whatever the sequence's length (no per-token averaging); padding gets 0."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -50.0, -50.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    loss, stats = rloo_loss(logp, adv, mask)
    assert stats["seq_logp_mean"].item() == pytest.approx((-6.0 - 0.5) / 2, rel=1e-12)
    assert loss.item() == pytest.approx(-(2.0 * -6.0 + -1.0 * -0.5) / 2, rel=1e-12)
    loss.backward()
    assert logp.grad.tolist() == [[-1.0, -1.0, -1.0], [0.5, 0.0, 0.0]]


def test_rloo_loss_does_not_backpropagate_into_the_advantage():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    adv = torch.tensor([1.0], requires_grad=True)
    rloo_loss(logp, adv, torch.ones(1, 1))[0].backward()
    assert adv.grad is None


def test_rloo_loss_pg_weight_scales_each_tokens_log_prob():
    logp = torch.tensor([[-1.0, -2.0, -9.0]], requires_grad=True)
    loss, stats = lab_losses.rloo_loss(logp, torch.tensor([2.0]), torch.tensor([[1, 1, 0]]),
                                       pg_weight=torch.tensor([[0.5, 2.0, 7.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 * (0.5 * -1.0 + 2.0 * -2.0))
    assert logp.grad.tolist() == [[-1.0, -4.0, 0.0]]
    assert stats["seq_logp_mean"].item() == -3.0  # the unweighted log pi(y | x)


def test_rloo_loss_keeps_a_junk_padding_weight_out_of_the_gradient():
    """A per-token weight (TIS) may hold anything in the padding, NaN included: the loss and its gradient at every
    log-prob are those of the weight with 0 there, finite, and 0 at each padded position."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 1, 4])
    mask = (torch.arange(5)[None] < lengths[:, None]).long()
    weight = torch.rand(4, 5, dtype=F64, generator=g) + 0.5
    adv = torch.randn(4, dtype=F64, generator=g)
    grads = []
    for padding in (float("nan"), 0.0):
        logp = (-torch.rand(4, 5, dtype=F64, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = lab_losses.rloo_loss(logp, adv, mask, pg_weight=torch.where(mask.bool(), weight, padding))
        loss.backward()
        grads.append((loss.detach(), logp.grad))
    (nan_loss, nan_grad), (zero_loss, zero_grad) = grads
    assert torch.isfinite(nan_grad).all() and torch.equal(nan_grad, zero_grad) and torch.equal(nan_loss, zero_loss)
    assert (nan_grad[mask == 0] == 0).all() and torch.equal(nan_grad[mask == 1], (-adv[:, None] * weight / 4)[mask == 1])


@pytest.mark.parametrize("kwargs, flags", [
    ({"batch_size": 12, "num_generations": 8}, ["--batch_size", "--num_generations"]),
    ({"num_generations": 1, "batch_size": 8}, ["--num_generations"]),
    ({"beta": -0.1}, ["--beta"]),
])
def test_bad_config_raises_a_value_error_naming_the_flag(kwargs, flags):
    with pytest.raises(ValueError) as e:
        Config(**kwargs)
    for flag in flags:
        assert flag in str(e.value)


def test_rloo_end_to_end_writes_metrics_plot_and_model(tmp_path):
    out = subprocess.run([sys.executable, "lab/rloo.py", "--num_steps", "2", "--eval_every", "1",
                          "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = run.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("eval/accuracy" in r for r in rows)
    for key in ("train/reward", "train/reward_with_kl", "train/frac_zero_std_groups", "train/adv_mean", "train/adv_std",
                "train/kl_seq", "train/entropy", "train/grad_norm", "train/completion_len", "time/generation_s"):
        assert key in rows[1], key
    # step 1: policy == reference, so k1 = 0 and the KL leaves the reward alone; a group with mixed
    # rewards moves the policy, so at step 2 the KL changes the reward
    assert rows[1]["train/adv_std"] > 0
    assert rows[1]["train/kl_seq"] == 0.0 and rows[1]["train/reward_with_kl"] == rows[1]["train/reward"]
    assert rows[2]["train/kl_seq"] != 0.0 and rows[2]["train/reward_with_kl"] != rows[2]["train/reward"]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert_params_changed(tmp_path / "final")

