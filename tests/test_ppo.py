"""PPO (docs/algorithms.md): GAE, the clipped policy and value losses, the critic, end-to-end runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import math  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import common  # noqa: E402
from lab import config as lab_config  # noqa: E402
from lab import losses as lab_losses  # noqa: E402
from support import config  # noqa: E402
from support.run import read_metrics  # noqa: E402
from conftest import run_together  # noqa: E402
from lab.ppo import Config  # noqa: E402  (the lab's: --lam_critic, --lam_alpha, --dual_clip_c)
from ppo import (AdaptiveKLController, ValueModel, explained_variance, gae, ppo_policy_loss,  # noqa: E402
                 ppo_value_loss)
from vapo import decoupled_gae, length_adaptive_lam  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def random_episodes(seed=0, lengths=(5, 1, 3, 7), T=7):
    """Rewards and values with completion masks of different lengths; garbage after the end."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(lengths), T, generator=g, dtype=torch.float64)
    values = torch.randn(len(lengths), T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return rewards, values, mask


# ---------------------------------------------------------------- GAE

def test_gae_hand_computed_values():
    """gamma 0.9, lam 0.5, so gamma lam = 0.45. Row 1: rewards (0, 0, 1), values (0.5, 0.2, 0.4):
    delta = (0 + 0.9 * 0.2 - 0.5, 0 + 0.9 * 0.4 - 0.2, 1 + 0 - 0.4) = (-0.32, 0.16, 0.6);
    A_3 = 0.6, A_2 = 0.16 + 0.45 * 0.6 = 0.43, A_1 = -0.32 + 0.45 * 0.43 = -0.1265; R = A + V.
    Row 2 ends at token 2 (EOS); what follows is garbage: delta_2 = 2 + 0 - (-1) = 3 (V after the
    end is 0), delta_1 = 0.5 + 0.9 * (-1) - 1 = -1.4; A = (-1.4 + 0.45 * 3, 3) = (-0.05, 3)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 9.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, -1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.1265, 0.43, 0.6], [-0.05, 3.0, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, torch.tensor([[0.3735, 0.63, 1.0], [0.95, 2.0, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_satisfies_its_recursion_on_every_valid_token(gamma, lam):
    """A_t - gamma lam A_{t+1} = r_t + gamma V_{t+1} - V_t, with A and V zero after each row's end."""
    rewards, values, mask = random_episodes(lengths=(5, 1, 3, 7))
    adv, returns = gae(rewards, values, mask, gamma, lam)
    shift = lambda x: torch.cat([(x * mask)[:, 1:], torch.zeros_like(x[:, :1])], 1)  # noqa: E731
    td_error = (rewards + gamma * shift(values) - values) * mask
    torch.testing.assert_close((adv - gamma * lam * shift(adv)) * mask, td_error, rtol=0, atol=1e-12)
    torch.testing.assert_close(returns, (adv + values) * mask, rtol=0, atol=1e-12)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    """A_t = sum_{t' >= t} r_t' - V_t: PPO reduces to REINFORCE with a token-wise learned baseline."""
    rewards, values, mask = random_episodes(seed=1)
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = torch.where(mask.bool(), common.reward_to_go(rewards, mask) - values, torch.zeros_like(values))
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, common.reward_to_go(rewards, mask), rtol=1e-12, atol=1e-12)


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    rewards, values, mask = random_episodes(seed=2)
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], 1)
    torch.testing.assert_close(adv, (rewards + 0.9 * next_values - values) * mask, rtol=1e-12, atol=1e-12)


def test_gae_padding_does_not_change_valid_advantages_and_gets_zero():
    rewards, values, mask = random_episodes(seed=3)
    adv, returns = gae(rewards, values, mask, 0.95, 0.9)
    padding = ~mask.bool()
    garbage_rewards = torch.where(padding, torch.full_like(rewards, float("nan")), rewards)
    garbage_values = torch.where(padding, torch.full_like(values, 1e6), values)
    adv2, returns2 = gae(garbage_rewards, garbage_values, mask, 0.95, 0.9)
    assert torch.equal(adv, adv2) and torch.equal(returns, returns2)
    assert (adv2[padding] == 0).all() and (returns2[padding] == 0).all()
    # extra padding columns on the right change nothing either
    wide = [torch.cat([x, torch.randn(x.shape[0], 3, dtype=x.dtype)], 1) for x in (rewards, values)]
    adv3, _ = gae(*wide, torch.cat([mask, torch.zeros_like(mask[:, :3])], 1), 0.95, 0.9)
    assert torch.equal(adv3[:, :mask.shape[1]], adv)


def test_gae_last_valid_token_bootstraps_from_zero():
    """V_{T+1} = 0: the last token's advantage is r_T - V_T whatever follows in the tensor."""
    rewards, values, mask = random_episodes(seed=4, lengths=(2, 4), T=4)
    adv, _ = gae(rewards, values, mask, 1.0, 0.95)
    assert adv[0, 1].item() == pytest.approx((rewards[0, 1] - values[0, 1]).item(), abs=1e-12)
    assert adv[1, 3].item() == pytest.approx((rewards[1, 3] - values[1, 3]).item(), abs=1e-12)


# VAPO's options, by hand on one episode: rewards (0, 0, 1), values (0.5, 0.2, 0.4), gamma 1.
# TD errors delta = (0 + 0.2 - 0.5, 0 + 0.4 - 0.2, 1 + 0 - 0.4) = (-0.3, 0.2, 0.6).
HAND_REWARDS = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
HAND_VALUES = torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64)


def test_decoupled_gae_takes_advantages_with_the_policy_lambda_and_targets_with_the_critics():
    adv, returns = decoupled_gae(HAND_REWARDS, HAND_VALUES, torch.ones(1, 3), 1.0, lam_policy=0.5, lam_critic=1.0)
    # lam 0.5: A_3 = 0.6, A_2 = 0.2 + 0.5 * 0.6 = 0.5, A_1 = -0.3 + 0.5 * 0.5 = -0.05
    torch.testing.assert_close(adv, torch.tensor([[-0.05, 0.5, 0.6]], dtype=torch.float64))
    # lam 1: A = (0.5, 0.8, 0.6), R = A + V = the Monte Carlo return 1 at every token
    torch.testing.assert_close(returns, torch.ones(1, 3, dtype=torch.float64))
    same = decoupled_gae(HAND_REWARDS, HAND_VALUES, torch.ones(1, 3), 1.0, 0.95, 0.95)  # the default: one lambda
    for a, b in zip(same, gae(HAND_REWARDS, HAND_VALUES, torch.ones(1, 3), 1.0, 0.95)):
        assert torch.equal(a, b)


def test_length_adaptive_lambda_is_one_minus_one_over_alpha_length_clamped_at_zero():
    lam = length_adaptive_lam(torch.tensor([40, 100, 500, 10]), alpha=0.05)
    torch.testing.assert_close(lam, torch.tensor([0.5, 0.8, 0.96, 0.0]))  # 1/(0.05 * 10) = 2: clamped


def test_gae_takes_one_lambda_per_sequence():
    rewards, values = HAND_REWARDS.repeat(2, 1), HAND_VALUES.repeat(2, 1)
    adv, _ = gae(rewards, values, torch.ones(2, 3), 1.0, torch.tensor([0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[-0.05, 0.5, 0.6], [-0.3, 0.2, 0.6]], dtype=torch.float64))


# ---------------------------------------------------------------- clipped policy loss

def policy_loss_and_grad(ratio, adv, epsilon=0.2):
    old_logp = torch.zeros(1, len(ratio), dtype=torch.float64)
    logp = torch.log(torch.tensor([ratio], dtype=torch.float64)).requires_grad_()
    loss, stats = ppo_policy_loss(logp, old_logp, torch.tensor([adv], dtype=torch.float64), torch.ones(1, len(ratio)),
                                  common.Clip(epsilon, epsilon))
    loss.backward()
    return loss.item(), logp.grad[0], stats


def test_policy_loss_on_policy_gradient_is_the_policy_gradient():
    """At rho = 1 the clip is inactive and d loss / d logp_t = -A_t / N (token-mean)."""
    adv = [1.5, -0.5, 2.0, -3.0]
    loss, grad, stats = policy_loss_and_grad([1.0] * 4, adv)
    assert loss == pytest.approx(-sum(adv) / 4)
    torch.testing.assert_close(grad, -torch.tensor(adv, dtype=torch.float64) / 4)
    assert stats["clip_frac_low"].item() == stats["clip_frac_high"].item() == 0 and stats["approx_kl"].item() == 0


@pytest.mark.parametrize("adv, ratio, clipped", [
    (+1.0, 1.2 + 1e-3, True),    # A > 0: past 1 + c the objective stops rewarding a higher ratio
    (+1.0, 1.2 - 1e-3, False),
    (+1.0, 0.8 - 1e-3, False),   # A > 0, ratio fell: no clip, the gradient pushes it back up
    (-1.0, 0.8 - 1e-3, True),    # A < 0: below 1 - c the objective stops rewarding a lower ratio
    (-1.0, 0.8 + 1e-3, False),
    (-1.0, 1.2 + 1e-3, False),   # A < 0, ratio rose: no clip, the gradient pushes it back down
])
def test_policy_loss_gradient_is_zero_exactly_where_clipped(adv, ratio, clipped):
    loss, grad, stats = policy_loss_and_grad([ratio], [adv])
    c_ratio = min(max(ratio, 0.8), 1.2)
    assert loss == pytest.approx(-adv * (c_ratio if clipped else ratio), abs=1e-12)
    if clipped:
        assert grad.item() == 0.0
        assert stats["clip_frac_high" if adv > 0 else "clip_frac_low"].item() == 1.0
    else:
        assert grad.item() == pytest.approx(-adv * ratio, abs=1e-12)  # d(-A rho)/d logp = -A rho
        assert stats["clip_frac_low"].item() == stats["clip_frac_high"].item() == 0.0


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_policy_loss_is_the_pessimistic_bound_of_the_unclipped_surrogate(adv):
    """Per token the objective min(rho A, clip(rho) A) is never above rho A: the loss equals -rho A
    where the clip cannot help the objective (rho inside the range, or moved against A) and is
    -clip(rho) A, a larger loss, elsewhere. Ratios 0.5 ... 1.5 in steps of 0.05."""
    ratios = [0.5 + 0.05 * i for i in range(21)]
    loss, _, _ = policy_loss_and_grad(ratios, [adv] * len(ratios))
    clipped = [(r > 1.2 and adv > 0) or (r < 0.8 and adv < 0) for r in ratios]
    per_token = [-adv * (min(max(r, 0.8), 1.2) if c else r) for r, c in zip(ratios, clipped)]
    assert loss == pytest.approx(sum(per_token) / len(ratios), abs=1e-12)
    assert loss > -adv * sum(ratios) / len(ratios) + 0.01  # strictly above the unclipped loss: some tokens clipped


def test_policy_loss_masks_padding_and_reports_the_ratio_kl():
    logp = torch.tensor([[0.1, -0.2, 5.0]], dtype=torch.float64, requires_grad=True)
    old_logp = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = ppo_policy_loss(logp, old_logp, adv, mask, common.Clip(0.2, 0.2))
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0 and torch.isfinite(loss)
    # both kept ratios, e^0.1 and e^-0.2 (> 0.8), are inside the clip: loss = -mean(rho A) over 2 tokens
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.2)) / 2, abs=1e-12)
    log_r = torch.tensor([0.1, -0.2], dtype=torch.float64)  # logp - old_logp
    k3 = torch.exp(log_r) - 1 - log_r  # rho - 1 - log rho: KL(pi_old || pi_theta), samples from pi_old
    assert stats["approx_kl"].item() == pytest.approx(k3.mean().item())


# ---------------------------------------------------------------- clipped value loss

def value_loss_and_grad(value, old_value, ret, c=0.2):
    values = torch.tensor([[value]], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_value_loss(values, torch.tensor([[old_value]], dtype=torch.float64),
                                 torch.tensor([[ret]], dtype=torch.float64), torch.ones(1, 1), c)
    loss.backward()
    return loss.item(), values.grad.item(), stats["clip_frac"].item()


def test_value_loss_inside_the_clip_is_half_squared_error():
    loss, grad, clipfrac = value_loss_and_grad(value=0.1, old_value=0.0, ret=1.0)
    assert loss == pytest.approx(0.5 * 0.9 ** 2) and grad == pytest.approx(0.1 - 1.0) and clipfrac == 0.0


def test_value_clip_stops_a_move_past_the_clip_towards_the_return():
    """V moved from 0 to 0.5 towards R = 1, past c = 0.2: the clipped term (0.2 - 1)^2 is larger,
    so the loss is constant in V and the gradient is zero."""
    loss, grad, clipfrac = value_loss_and_grad(value=0.5, old_value=0.0, ret=1.0)
    assert loss == pytest.approx(0.5 * 0.8 ** 2) and grad == 0.0 and clipfrac == 1.0


def test_value_clip_never_stops_a_move_back_towards_the_return():
    """V moved away from R past the clip: the unclipped error is larger, so it still gets the gradient."""
    loss, grad, clipfrac = value_loss_and_grad(value=-0.5, old_value=0.0, ret=1.0)
    assert loss == pytest.approx(0.5 * 1.5 ** 2) and grad == pytest.approx(-1.5) and clipfrac == 0.0
    loss, grad, clipfrac = value_loss_and_grad(value=2.5, old_value=2.0, ret=1.0)  # from above
    assert loss == pytest.approx(0.5 * 1.5 ** 2) and grad == pytest.approx(1.5) and clipfrac == 0.0
    loss, grad, clipfrac = value_loss_and_grad(value=0.5, old_value=2.0, ret=1.0)  # overshoot past R, from above
    assert loss == pytest.approx(0.5 * 0.8 ** 2) and grad == 0.0 and clipfrac == 1.0


def test_value_loss_is_a_token_mean_over_the_mask():
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    loss, _ = ppo_value_loss(values, values.detach(), torch.tensor([[0.0, 0.0, float("nan")]]), torch.tensor([[1, 1, 0]]), 0.2)
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)


def test_value_loss_keeps_the_padding_out_of_the_gradient():
    # a NaN return or old value at the padded position: the gradient (V - R) / 2 where valid, 0 there
    for nan_at in ("returns", "old_values"):
        values = torch.zeros(1, 3, requires_grad=True)
        inputs = {"old_values": torch.zeros(1, 3), "returns": torch.ones(1, 3)}
        inputs[nan_at][0, 1] = float("nan")
        loss, _ = ppo_value_loss(values, inputs["old_values"], inputs["returns"], torch.tensor([[1, 0, 1]]), 0.2)
        loss.backward()
        assert values.grad.tolist() == [[-0.5, 0.0, -0.5]], nan_at


# ---------------------------------------------------------------- diagnostics and controller

def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0)


def test_adaptive_kl_controller_moves_beta_towards_the_target_at_most_20_percent_per_horizon():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(kl=10.0, n=10)  # far above the target: error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(kl=0.9, n=50)
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * 50 / 100))


# ---------------------------------------------------------------- config

def test_dual_clip_caps_the_loss_of_a_negative_advantage_token_with_a_large_ratio():
    old_logp = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)).requires_grad_()
    loss, _ = lab_losses.clipped_loss(logp, old_logp, torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64),
                                      torch.ones(1, 3), common.Clip(0.2, 0.2), dual_c=3.0)
    loss.backward()
    # rho = 5 past c = 3: loss 3 |A|, no gradient; rho = 2: -rho A as without the dual clip;
    # A > 0 with rho = 5: only the ordinary clip, loss -1.2 A (the dual clip would make it -3 A)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("kwargs, flag", [
    ({"batch_size": 10, "num_mini_batches": 4}, "--num_mini_batches"),
    ({"num_epochs": 0}, "--num_epochs"),
    ({"critic_learning_rate": 0.0}, "--critic_learning_rate"),
    ({"epsilon": -0.1}, "--epsilon"),
    ({"lam": 1.5}, "--lam"),
    ({"gamma": -0.1}, "--gamma"),
    ({"beta": -1.0}, "--beta"),
    ({"beta": 0.0, "adaptive_kl": True}, "--adaptive_kl"),
    ({"lam_critic": 1.5}, "--lam_critic"),
    ({"lam_alpha": -0.05}, "--lam_alpha"),
    ({"dual_clip_c": 0.5}, "--dual_clip_c"),
])
def test_bad_config_raises_a_value_error_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        Config(**kwargs)


def test_bad_flag_on_the_command_line_gives_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, "ppo.py", "--batch_size", "10", "--num_mini_batches", "4", "--output_dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "--num_mini_batches" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- the critic

def test_value_model_gives_the_value_of_the_prefix_before_each_completion_token_and_ignores_left_padding():
    tokenizer = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    critic = ValueModel(config.EMBEDDED_MODEL).eval()
    policy = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    assert torch.equal(critic.model.base_model.embed_tokens.weight, policy.model.embed_tokens.weight)  # initialised from the policy
    enc = tokenizer(["12+3=15", "456+789=1245"], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        values = critic(enc["input_ids"], enc["attention_mask"], num_completion_tokens=2)
        alone = tokenizer(["12+3=15"], return_tensors="pt", add_special_tokens=False)
        full = critic.model.score(critic.model.base_model(**alone).last_hidden_state).squeeze(-1)
    assert values.shape == (2, 2)
    torch.testing.assert_close(values[0], full[0, -3:-1], rtol=1e-4, atol=1e-5)  # V before "1" and before "5"


def test_lora_critic_trains_only_its_adapter_and_head_and_starts_as_the_full_critic():
    from support import models

    enc = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")(
        ["12+3=15", "456+789=1245"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    full = ValueModel(config.EMBEDDED_MODEL).eval()
    torch.manual_seed(0)  # the same random head: the adapter is added after it
    lora = ValueModel(config.EMBEDDED_MODEL, lora=models.lora_config(lab_config.LabConfig(lora_r=4), "SEQ_CLS")).eval()
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name or "score" in name for name in trainable)
    assert any("score" in name for name in trainable) and any("lora_B" in name for name in trainable)
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) < 0.2 * sum(p.numel() for p in full.parameters())
    with torch.no_grad():  # lora_B starts at 0: the same values through the adapter-wrapped model
        torch.testing.assert_close(lora(enc["input_ids"], enc["attention_mask"], 3),
                                   full(enc["input_ids"], enc["attention_mask"], 3), rtol=0, atol=0)


# ---------------------------------------------------------------- end to end

def assert_params_changed(final_dir):
    trained = AutoModelForCausalLM.from_pretrained(final_dir)
    start = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    diffs = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters())]
    assert max(diffs) > 0


def test_ppo_end_to_end_writes_metrics_plots_policy_and_critic(tmp_path):
    out = subprocess.run([sys.executable, "lab/ppo.py", "--num_steps", "2", "--eval_every", "1", "--output_dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("train/reward", "train/kl_seq", "train/entropy", "train/grad_norm", "train/completion_len",
                "train/value_loss", "train/value_clip_frac", "train/explained_variance", "train/clip_frac_low", "train/clip_frac_high",
                "train/approx_kl", "train/critic_grad_norm", "time/generation_s", "time/scoring_s",
                "time/forward_backward_s", "time/optimizer_s"):
        assert key in rows[1], key
    assert all("eval/accuracy" in r for r in rows)
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "critic_curves.png").stat().st_size > 1000
    assert_params_changed(tmp_path / "final")
    # the critic is a sequence-classification checkpoint that --reward_model_path can load again
    reloaded = ValueModel(str(tmp_path / "final" / "critic"))
    fresh = ValueModel(config.EMBEDDED_MODEL)
    assert not torch.equal(reloaded.model.base_model.norm.weight, fresh.model.base_model.norm.weight)


def test_ppo_with_lora_saves_a_whole_critic_with_the_adapter_merged(tmp_path):
    out = subprocess.run([sys.executable, "lab/ppo.py", "--num_steps", "2", "--eval_every", "2", "--batch_size", "8",
                          "--lora_r", "4", "--learning_rate", "1e-2", "--critic_learning_rate", "1e-2",
                          "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "final" / "adapter_config.json").exists()  # the policy: its adapter
    reloaded = ValueModel(str(tmp_path / "final" / "critic"))  # the critic: a plain checkpoint
    fresh = ValueModel(config.EMBEDDED_MODEL)
    layer, start = reloaded.model.base_model.layers[0], fresh.model.base_model.layers[0]
    assert not torch.equal(layer.self_attn.q_proj.weight, start.self_attn.q_proj.weight)  # the adapter, merged
    assert torch.equal(layer.input_layernorm.weight, start.input_layernorm.weight)  # not in the adapter: frozen



def test_resume_restores_critic_optimizers_and_kl_controller(tmp_path):
    """A run stopped at step 2 and resumed equals the uninterrupted run: the critic, both AdamW
    states and the adaptive beta all travel in the checkpoint."""
    def run(*runs):
        cmds = [[sys.executable, "lab/ppo.py", "--eval_every", "2", "--batch_size", "8", "--num_mini_batches", "2",
                 "--adaptive_kl", "--kl_horizon", "20", "--save_model", "False", *args] for args in runs]
        for out in run_together(cmds, env={**os.environ, "OMP_NUM_THREADS": "1"}):
            assert out.returncode == 0, out.stderr[-3000:]

    def comparable(path):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(path)]

    run(["--num_steps", "4", "--output_dir", str(tmp_path / "full")],
        ["--num_steps", "2", "--save_steps", "2", "--output_dir", str(tmp_path / "half")])
    run(["--num_steps", "4", "--output_dir", str(tmp_path / "half"), "--resume_from", str(tmp_path / "half" / "checkpoint-2")])
    full, resumed = comparable(tmp_path / "full" / "metrics.jsonl"), comparable(tmp_path / "half" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert full[3]["train/beta"] != 0.05  # the controller moved, so restoring it matters
    assert full == resumed
