"""GRPO (docs/algorithms.md): group advantage, clipped surrogate + k3, end-to-end runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import math  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
from support import config, models  # noqa: E402
from support.run import read_metrics  # noqa: E402
from conftest import assert_params_changed  # noqa: E402
from grpo import grpo_advantages, grpo_loss  # noqa: E402
from lab import grpo as lab_grpo  # noqa: E402
from lab import losses as lab_losses  # noqa: E402
from lab.grpo import Config  # noqa: E402  (the lab's: --dual_clip_c and the rest)

ROOT = Path(__file__).resolve().parents[1]
EPS = 1e-6
F64 = torch.float64
CLIP = common.Clip(0.2, 0.2)


# ---------------------------------------------------------------- advantages

def test_group_advantage_uses_bessel_std_and_eps():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 4.0, 2.0], dtype=F64)
    adv = grpo_advantages(rewards, group_size=4)
    # group 1: mean 0.25, std (ddof=1) sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 (ddof=0 would give 0.433)
    # group 2: mean 3, std sqrt(4 / 3)
    s2 = math.sqrt(4 / 3)
    expected = [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS),
                -1 / (s2 + EPS), 1 / (s2 + EPS), 1 / (s2 + EPS), -1 / (s2 + EPS)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64))


def test_group_advantage_eps_keeps_a_tiny_std_finite():
    """std 1e-9 << eps: the advantage is about (r - mean) / eps, not (r - mean) / std = +-0.707."""
    rewards = torch.tensor([0.0, 1e-9], dtype=F64)
    adv = grpo_advantages(rewards, group_size=2)
    std = math.sqrt(2) * 0.5e-9
    torch.testing.assert_close(adv, torch.tensor([-0.5e-9, 0.5e-9], dtype=F64) / (std + EPS))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_all_equal_group_gives_exactly_zero_advantage(scale_rewards):
    # in float32 the mean of seven 0.7s is not 0.7: r - mean would be ~6e-8, and ~0.06 after / (std + eps)
    rewards = torch.tensor([0.7] * 7 + [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0] + [-3.0] * 7)
    adv = grpo_advantages(rewards, group_size=7, scale_rewards=scale_rewards)
    assert adv[:7].tolist() == [0.0] * 7
    assert adv[14:].tolist() == [0.0] * 7
    assert adv[7:14].abs().min() > 0


def test_scale_rewards_group_batch_none():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0], dtype=F64)  # groups [1, 0] and [3, 1]
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=F64)
    group_std = torch.tensor([math.sqrt(0.5)] * 2 + [math.sqrt(2.0)] * 2, dtype=F64)
    batch_std = math.sqrt((0.25 ** 2 + 1.25 ** 2 + 1.75 ** 2 + 0.25 ** 2) / 3)  # of [1, 0, 3, 1], mean 1.25
    torch.testing.assert_close(grpo_advantages(rewards, 2, "none"), centred)  # Dr. GRPO
    torch.testing.assert_close(grpo_advantages(rewards, 2, "group"), centred / (group_std + EPS))
    torch.testing.assert_close(grpo_advantages(rewards, 2, "batch"), centred / (batch_std + EPS))


def test_group_std_removes_each_prompts_reward_scale():
    """hetero rewards: groups [-5, -1] and [2, 5] both give about -+1/sqrt(2): the per-prompt
    rescaling that makes GRPO scale-free (and biased, docs/algorithms.md)."""
    adv = grpo_advantages(torch.tensor([-5.0, -1.0, 2.0, 5.0], dtype=F64), 2)
    expected = [-2 / (2 * math.sqrt(2) + EPS), 2 / (2 * math.sqrt(2) + EPS), -1.5 / (3 / math.sqrt(2) + EPS), 1.5 / (3 / math.sqrt(2) + EPS)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64))


# ---------------------------------------------------------------- loss

def one_token_loss(ratio, adv, epsilon=0.2):
    """grpo_loss on a single token with pi_theta / pi_old = ratio; returns (loss, d loss / d logp, stats)."""
    logp = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    old_logp = torch.zeros(1, 1, dtype=F64)
    loss, stats = grpo_loss(logp, old_logp, None, torch.tensor([adv], dtype=F64), torch.ones(1, 1),
                            common.Clip(epsilon, epsilon), beta=0.0)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


@pytest.mark.parametrize("adv, ratio, clipped", [
    (2.0, 1.19, False), (2.0, 1.21, True),    # A > 0: the clip stops the ratio growing past 1 + eps ...
    (2.0, 0.79, False), (2.0, 0.5, False),    # ... but never stops it from moving back up
    (-2.0, 0.81, False), (-2.0, 0.79, True),  # A < 0: the clip stops the ratio falling below 1 - eps ...
    (-2.0, 1.21, False), (-2.0, 1.5, False),  # ... but never stops it from moving back down
])
def test_clip_gradient_is_zero_exactly_on_the_clipped_side(adv, ratio, clipped):
    loss, grad, stats = one_token_loss(ratio, adv)
    # d/dlogp of -rho * A is -rho * A (d rho / d logp = rho); of -clip(rho) * A outside the range, 0
    if clipped:
        assert grad == 0.0
        assert loss == pytest.approx(-min(max(ratio, 0.8), 1.2) * adv, rel=1e-12)
    else:
        assert grad == pytest.approx(-ratio * adv, rel=1e-12)
        assert loss == pytest.approx(-ratio * adv, rel=1e-12)
    assert stats["clip_frac_high"].item() == float(clipped and adv > 0)
    assert stats["clip_frac_low"].item() == float(clipped and adv < 0)
    assert stats["approx_kl"].item() == pytest.approx(ratio - 1 - math.log(ratio), rel=1e-12)  # k3 of pi_old / pi


@pytest.mark.parametrize("adv", [2.0, -2.0])
def test_clip_loss_is_the_pessimistic_bound_of_the_unclipped_surrogate(adv):
    """The objective min(rho A, clip(rho) A) is never above rho A: the loss is -rho A where the clip
    cannot help the objective and -clip(rho) A, a larger loss, where it would. Ratios 0.5 ... 1.5."""
    for i in range(21):
        ratio = 0.5 + 0.05 * i
        loss, _, _ = one_token_loss(ratio, adv)
        clipped = (ratio > 1.2 and adv > 0) or (ratio < 0.8 and adv < 0)
        assert loss == pytest.approx(-adv * (min(max(ratio, 0.8), 1.2) if clipped else ratio), abs=1e-12)
        assert loss >= -adv * ratio - 1e-12


def seqs():
    """Two completions (3 tokens and 1 token), log-probs from random logits."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return logits, logp, mask


@pytest.mark.parametrize("loss_agg", common.LOSS_AGG_MODES)
def test_with_one_iteration_ratio_is_one_and_gradient_is_the_policy_gradient(loss_agg):
    """mu = 1: old_logp = logp.detach(), so rho == 1 in value, and the gradient equals that of
    REINFORCE with the advantage, -A_i log pi(y_i,t), aggregated the same way."""
    logits, logp, mask = seqs()
    adv = torch.tensor([1.5, -0.5], dtype=F64)
    loss, stats = grpo_loss(logp, logp.detach(), None, adv, mask, CLIP, 0.0, common.Aggregation(loss_agg, 8))
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    pg = {"seq-mean-token-mean": -(1.5 * logp[0].sum() / 3 - 0.5 * logp[1, 0]) / 2,
          "token-mean": -(1.5 * logp[0].sum() - 0.5 * logp[1, 0]) / 4,
          "seq-mean-token-sum": -(1.5 * logp[0].sum() - 0.5 * logp[1, 0]) / 2,
          "seq-mean-token-sum-norm": -(1.5 * logp[0].sum() / 8 - 0.5 * logp[1, 0] / 8) / 2}[loss_agg]
    (expected,) = torch.autograd.grad(pg, logits)
    torch.testing.assert_close(grad, expected)
    value = {"seq-mean-token-mean": -(1.5 - 0.5) / 2, "token-mean": -(3 * 1.5 - 0.5) / 4,
             "seq-mean-token-sum": -(3 * 1.5 - 0.5) / 2, "seq-mean-token-sum-norm": -(3 * 1.5 / 8 - 0.5 / 8) / 2}
    assert loss.item() == pytest.approx(value[loss_agg], rel=1e-12)  # rho == 1: loss = -aggregate(A)
    assert stats["approx_kl"].item() == 0.0 and stats["clip_frac_low"].item() == stats["clip_frac_high"].item() == 0.0


def test_k3_term_value_and_gradient():
    """beta * k3 with gradient through logp: d/dlogp [beta k3] = beta (1 - pi_ref / pi_theta)."""
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=F64)).requires_grad_()
    ref_logp = torch.log(torch.tensor([[0.25, 0.4]], dtype=F64))
    beta = 0.04
    loss, stats = grpo_loss(logp, logp.detach(), ref_logp, torch.zeros(1, dtype=F64), torch.ones(1, 2), CLIP, beta)
    loss.backward()
    # k3 = r - log r - 1 with r = pi_ref / pi: (0.5 + ln 2 - 1) and (2 - ln 2 - 1), mean 0.25
    assert stats["kl_k3"].item() == pytest.approx(0.25, rel=1e-12)
    assert loss.item() == pytest.approx(beta * 0.25, rel=1e-12)
    # per token beta (1 - r) = 0.04 * 0.5 and 0.04 * (-1), then the mean over the 2 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.01, -0.02]], dtype=F64))


def test_kl_estimator_k2_and_k3_with_the_ratio_weight_give_the_k2_gradient():
    """--kl_estimator k2 (the lesson's grpo_loss), or k3 with the lab's --kl_is_weight (lab/losses.py) at mu = 1:
    d/dlogp = beta * (logp - ref_logp); the weighted k3 keeps k3's value (docs/algorithms.md, off-policy)."""
    ref_logp = torch.log(torch.tensor([[0.25, 0.4]], dtype=F64))
    expected = 0.04 * (torch.log(torch.tensor([[0.5, 0.2]], dtype=F64)) - ref_logp) / 2  # the mean of 2 tokens
    for loss_fn, kwargs in ((grpo_loss, {"kl_estimator": "k2"}),
                            (lab_losses.grpo_loss, {"kl_estimator": "k3", "ratio_weight": True})):
        logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=F64)).requires_grad_()
        loss, stats = loss_fn(logp, logp.detach(), ref_logp, torch.zeros(1, dtype=F64), torch.ones(1, 2), CLIP, 0.04,
                              **kwargs)
        loss.backward()
        torch.testing.assert_close(logp.grad, expected)
        assert stats["kl_k3"].item() == pytest.approx(0.25, rel=1e-12)  # the k3 value is logged either way
    assert stats["kl_term"].item() == pytest.approx(0.25, rel=1e-12)


@pytest.mark.parametrize("ratio, adv, surrogate, grad", [
    (5.0, -1.0, -3.0, 0.0),    # A < 0, rho past c = 3: the loss stops at c |A|, no gradient
    (2.0, -1.0, -2.0, 2.0),    # below c: the ordinary clipped surrogate, d(-rho A)/dlogp = -rho A
    (5.0, 1.0, 1.2, 0.0),      # A > 0: the ordinary clip at 1 + epsilon
])
def test_dual_clip_bounds_the_loss_of_a_negative_advantage_token(ratio, adv, surrogate, grad):
    logp = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    loss, _ = lab_losses.grpo_loss(logp, torch.zeros(1, 1, dtype=F64), None, torch.tensor([adv], dtype=F64),
                                   torch.ones(1, 1), CLIP, 0.0, dual_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(-surrogate, rel=1e-12) and logp.grad.item() == pytest.approx(grad, rel=1e-12)


def test_pg_weight_multiplies_the_surrogate_and_not_the_kl_term():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref_logp = torch.tensor([[-1.5, -2.0]], dtype=F64)
    weight = torch.tensor([[2.0, 0.0]], dtype=F64)
    loss, _ = lab_losses.grpo_loss(logp, logp.detach(), ref_logp, torch.tensor([1.0], dtype=F64), torch.ones(1, 2),
                                   CLIP, 0.1, pg_weight=weight)
    loss.backward()
    # per token -w A + beta (1 - ref/pi), mean of 2: the weight 0 leaves the KL gradient on token 2
    k3_grad = 0.1 * (1 - torch.exp(ref_logp - logp.detach()))
    torch.testing.assert_close(logp.grad, (-weight + k3_grad) / 2)


def test_loss_ignores_tokens_after_the_mask():
    logp = torch.tensor([[-1.0, -2.0, -50.0]], dtype=F64, requires_grad=True)
    loss, _ = grpo_loss(logp, logp.detach(), None, torch.tensor([1.0], dtype=F64), torch.tensor([[1, 1, 0]]), CLIP, 0.0)
    loss.backward()
    assert loss.item() == -1.0  # the padding token (log-prob -50) adds nothing
    assert logp.grad.tolist() == [[-0.5, -0.5, 0.0]]


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, flags", [
    ({"batch_size": 12, "num_generations": 8}, ["--batch_size", "--num_generations"]),
    ({"num_generations": 1, "batch_size": 8}, ["--num_generations"]),
    ({"beta": -0.1}, ["--beta"]),
    ({"epsilon": 0.0}, ["--epsilon"]),
    ({"num_epochs": 0}, ["--num_epochs"]),
    ({"scale_rewards": "mean"}, ["--scale_rewards"]),
    ({"loss_agg": "sum"}, ["--loss_agg"]),
    ({"kl_estimator": "k5"}, ["--kl_estimator"]),
    ({"dual_clip_c": 1.0}, ["--dual_clip_c"]),
])
def test_bad_config_raises_a_value_error_naming_the_flag(kwargs, flags):
    with pytest.raises(ValueError) as e:
        Config(**kwargs)
    for flag in flags:
        assert flag in str(e.value)


def test_bad_flag_on_the_command_line_gives_one_clear_line():
    with pytest.raises(SystemExit) as e:
        config.parse_config(Config, ["--batch_size", "12", "--num_generations", "8"])
    assert "--num_generations" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- runs

def run_in_process(args, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lab/grpo.py", *args, "--save_model", "False", "--output_dir", str(tmp_path)])
    lab_grpo.main()
    return read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("beta, loaded", [(0.0, [True]), (0.04, [True, False])])
def test_beta_zero_loads_no_reference_model(beta, loaded, tmp_path, monkeypatch):
    calls, load_model = [], models.load_model
    monkeypatch.setattr(models, "load_model", lambda cfg, trainable=True: calls.append(trainable) or load_model(cfg, trainable))
    run_in_process(["--beta", str(beta), "--num_steps", "1", "--batch_size", "8"], tmp_path, monkeypatch)
    assert calls == loaded


def test_several_iterations_take_the_ratio_against_the_sampling_time_policy(tmp_path, monkeypatch):
    """mu = 3: every update's old_logp are the log-probs at sampling time, i.e. the first update's
    logp. With the ratio taken against the previous update instead, the third update's old_logp
    would be the second update's logp (mu = 2 cannot tell the two apart: there the previous update
    is the sampling time)."""
    calls, grpo_loss = [], lab_losses.grpo_loss

    def recording_loss(logp, old_logp, *args, **kwargs):
        calls.append((logp.detach().clone(), old_logp.detach().clone()))
        return grpo_loss(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(lab_losses, "grpo_loss", recording_loss)
    rows = run_in_process(["--num_steps", "1", "--num_epochs", "3", "--beta", "0"], tmp_path, monkeypatch)
    assert rows[1]["train/adv_std"] > 0 and len(calls) % 3 == 0
    per_update = len(calls) // 3  # loss calls per update (micro-batches)
    first = torch.cat([logp for logp, _ in calls[:per_update]])
    for update in range(3):
        logps, olds = zip(*calls[update * per_update:(update + 1) * per_update])
        torch.testing.assert_close(torch.cat(olds), first, rtol=0, atol=1e-5)  # sampling time, every update
        if update > 0:  # the policy moved, so the ratio is not 1 and "the previous update" would differ
            assert (torch.cat(logps) - first).abs().max() > 1e-3


def run(args, tmp_path):
    out = subprocess.run([sys.executable, "lab/grpo.py", *args, "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return read_metrics(tmp_path / "metrics.jsonl")


def test_grpo_end_to_end_writes_metrics_plot_and_model(tmp_path):
    rows = run(["--num_steps", "2", "--eval_every", "1"], tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("eval/accuracy" in r for r in rows)
    for key in ("train/reward", "train/reward_std", "train/frac_zero_std_groups", "train/adv_mean", "train/adv_std",
                "train/clip_frac_low", "train/clip_frac_high", "train/approx_kl", "train/kl_k3", "train/kl_seq", "train/entropy",
                "train/grad_norm", "train/completion_len", "time/generation_s", "time/scoring_s",
                "time/forward_backward_s", "time/optimizer_s"):
        assert key in rows[1], key
    # step 1: policy == reference, k3 = 0; a group with mixed rewards moves the policy, so k3 > 0 at step 2
    assert rows[1]["train/adv_std"] > 0
    assert rows[1]["train/kl_k3"] == 0.0 < rows[2]["train/kl_k3"]
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert_params_changed(tmp_path / "final")
