"""The clipped-objective family (objectives.py, docs/algorithms.md): CISPO, SAPO, GMPO. Hand values, gradients against
their closed forms in fp64, the plain policy gradient on-policy, one step of the lab's loop with each; the peers'
formulas on identical tensors: tests/test_objectives_peers.py."""
import math

import pytest
import torch

import common
from grpo import grpo_loss
from objectives import cispo_loss, gmpo_loss, sapo_gate, sapo_loss

F64 = torch.float64
CLIP = common.Clip(0.2, 0.2)
NAN = float("nan")


def grad_of(loss_fn, log_ratio, adv, mask, **kwargs):
    """loss_fn with logp = log_ratio and old_logp 0 on the mask, NaN in its padding; returns (loss, d loss / d logp,
    stats)."""
    logp, mask = torch.tensor(log_ratio, dtype=F64, requires_grad=True), torch.tensor(mask)
    old = torch.where(mask.bool(), 0.0, NAN).to(F64)
    loss, stats = loss_fn(logp, old, torch.tensor(adv, dtype=F64), mask, **kwargs)
    loss.backward()
    return loss, logp.grad, stats


def random_batch(seed, B=4, T=6, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = logp + scale * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return logp, old, adv, mask


# ------------------------------------------------------------------------------------------------------ CISPO
def test_cispo_weight_is_the_capped_ratio_and_no_token_is_silenced():
    """Ratios (0.5, 1.1, 3), clip (0.2, 0.28): weights (0.8, 1.1, 1.28), with A = +1 and -1 alike; token-mean over 3
    tokens: d loss / d logp_t = -w_t A / 3. PPO's clip would give 0 to the third token (A > 0) and to the first (A < 0)."""
    ratios = [0.5, 1.1, 3.0]
    for adv in (1.0, -1.0):
        _, grad, stats = grad_of(cispo_loss, [[math.log(r) for r in ratios]], [adv], [[1, 1, 1]], clip=(0.2, 0.28))
        expected = torch.tensor([[-0.8 * adv / 3, -1.1 * adv / 3, -1.28 * adv / 3]], dtype=F64)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
        assert stats["clip_frac_low"].item() == pytest.approx(1 / 3)
        assert stats["clip_frac_high"].item() == pytest.approx(1 / 3)


def test_cispo_value_is_the_weighted_log_prob_and_padding_is_ignored():
    """loss = -sum_t w_t A log pi_t / N over the valid tokens: the value is a REINFORCE surrogate (not the ratio), and
    NaN in the padding of old_logp (junk in logp's: the model's output there) changes nothing."""
    logp = torch.tensor([[-0.5, -2.0, 7.0], [-1.0, 50.0, -60.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-0.5, -1.0, NAN], [-1.5, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, _ = cispo_loss(logp, old, torch.tensor([2.0, -1.0], dtype=F64), mask, (1.0, 0.5))
    w = [1.0, math.exp(-1.0), 1.5]  # ratio of the third token e^0.5 = 1.65, capped at 1.5
    expected = -(w[0] * 2 * -0.5 + w[1] * 2 * -2.0 + w[2] * -1 * -1.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0 and logp.grad[1, 1:].eq(0).all()


@pytest.mark.parametrize("seed", range(3))
def test_cispo_closed_form_gradient(seed):
    logp, old, adv, mask = random_batch(seed)
    logp.requires_grad_(True)
    cispo_loss(logp, old, adv, mask, (0.2, 0.28))[0].backward()
    weight = torch.exp(logp.detach() - old).clamp(0.8, 1.28)
    expected = -weight * adv[:, None] * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)


def test_cispo_on_policy_is_the_plain_policy_gradient():
    """r = 1: d loss / d logp = -A / N for each token, GRPO's gradient with token-mean (one update per batch)."""
    logp, _, adv, mask = random_batch(3)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    cispo_loss(a, a.detach(), adv, mask, (0.2, 0.28))[0].backward()
    grpo_loss(b, b.detach(), None, adv, mask, CLIP, 0.0, "token-mean")[0].backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------------- SAPO
def test_sapo_gate_at_one_is_two_over_tau_with_unit_slope():
    r = torch.tensor([1.0], dtype=F64, requires_grad=True)
    for tau in (1.0, 1.05, 20.0):
        value = sapo_gate(r, tau)
        (slope,) = torch.autograd.grad(value.sum(), r)
        assert value.item() == pytest.approx(2 / tau, rel=1e-12) and slope.item() == pytest.approx(1.0, rel=1e-12)


def test_sapo_hand_values_pick_tau_by_the_sign_of_the_advantage():
    """One token each, r = 2: loss = -f(2; tau) A with tau_pos = 1 for A = 1 and tau_neg = 1.05 for A = -1 (and for
    A = 0, whose loss is 0 anyway). Gradient -A r f'(r) = -A * 2 * 4 s (1 - s), s = sigmoid(tau)."""
    log2 = math.log(2.0)
    for adv, tau in ((1.0, 1.0), (-1.0, 1.05)):
        loss, grad, _ = grad_of(sapo_loss, [[log2]], [adv], [[1]])
        s = 1 / (1 + math.exp(-tau))
        assert loss.item() == pytest.approx(-4 / tau * s * adv, rel=1e-12)
        assert grad.item() == pytest.approx(-adv * 2 * 4 * s * (1 - s), rel=1e-12)
    _, grad, stats = grad_of(sapo_loss, [[log2]], [0.0], [[1]])  # A = 0: no loss, tau_neg in the gate weight
    s = 1 / (1 + math.exp(-1.05))
    assert grad.item() == 0 and stats["gate_weight"].item() == pytest.approx(2 * 4 * s * (1 - s), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_sapo_closed_form_gradient_and_gate_weight(seed):
    logp, old, adv, mask = random_batch(seed, scale=1.0)
    logp.requires_grad_(True)
    _, stats = sapo_loss(logp, old, adv, mask, 1.0, 1.05)
    sapo_loss(logp, old, adv, mask, 1.0, 1.05)[0].backward()
    r = torch.exp(logp.detach() - old)
    tau = torch.where(adv[:, None] > 0, torch.tensor(1.0, dtype=F64), torch.tensor(1.05, dtype=F64))
    s = torch.sigmoid(tau * (r - 1))
    w = 4 * r * s * (1 - s)
    lengths = mask.sum(1, keepdim=True)
    expected = -w * adv[:, None] * mask / (lengths * mask.shape[0])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)
    assert stats["gate_weight"].item() == pytest.approx(((w * mask).sum() / mask.sum()).item(), rel=1e-12)


def test_sapo_on_policy_is_the_plain_policy_gradient():
    """r = 1: weight r f'(r) = 1, so the gradient is GRPO's on-policy gradient with the same aggregation (SAPO, sec. 3);
    the value differs (2 / tau per unit of A), which the gradient does not see."""
    logp, _, adv, mask = random_batch(4)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    _, stats = sapo_loss(a, a.detach(), adv, mask)
    sapo_loss(a, a.detach(), adv, mask)[0].backward()
    grpo_loss(b, b.detach(), None, adv, mask, CLIP, 0.0, "seq-mean-token-mean")[0].backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)
    assert stats["gate_weight"].item() == pytest.approx(1.0, rel=1e-12)


# ------------------------------------------------------------------------------------------------------- GMPO
def test_gmpo_hand_case_clips_each_token_before_the_geometric_mean():
    """A = 1, log-ratios (0.6, 0.0, -0.6), clip 0.4: the first is clipped to 0.4 (above binds for A > 0), the third
    is not (below does not bind for A > 0): g = exp((0.4 + 0 - 0.6) / 3). Gradient -g / 3 on tokens 2 and 3, 0 on the
    clipped one. GSPO would clip exp(mean) = exp(0) = 1 itself: nothing clipped, every token -1/3."""
    loss, grad, stats = grad_of(gmpo_loss, [[0.6, 0.0, -0.6]], [1.0], [[1, 1, 1]])
    g = math.exp(-0.2 / 3)
    assert loss.item() == pytest.approx(-g, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -g / 3, -g / 3]], dtype=F64), rtol=1e-12, atol=0)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 3) and stats["clip_frac_low"].item() == 0
    # A = -1: the third token is clipped (to -0.4), the first is not
    loss, grad, stats = grad_of(gmpo_loss, [[0.6, 0.0, -0.6]], [-1.0], [[1, 1, 1]])
    g = math.exp(0.2 / 3)
    assert loss.item() == pytest.approx(g, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[g / 3, g / 3, 0.0]], dtype=F64), rtol=1e-12, atol=0)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 3)


def test_gmpo_counts_each_sequence_once_and_ignores_the_padding():
    """Two sequences of lengths 2 and 1, unclipped: loss = -(A_1 g_1 + A_2 g_2) / 2, token-mean not allowed to weigh
    the longer one twice; junk in the padding changes nothing."""
    loss, grad, _ = grad_of(gmpo_loss, [[0.1, 0.3, 9.0], [-0.2, -30.0, 40.0]], [1.0, 2.0], [[1, 1, 0], [1, 0, 0]],
                            loss_agg="token-mean")
    g1, g2 = math.exp(0.2), math.exp(-0.2)
    assert loss.item() == pytest.approx(-(g1 + 2 * g2) / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-g1 / 4, -g1 / 4, 0], [-g2, 0, 0]], dtype=F64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_gmpo_closed_form_gradient(seed):
    logp, old, adv, mask = random_batch(seed, scale=0.5)
    logp.requires_grad_(True)
    gmpo_loss(logp, old, adv, mask, (0.4, 0.4))[0].backward()
    lr = logp.detach() - old
    a = adv[:, None]
    clipped = ((a > 0) & (lr > 0.4)) | ((a < 0) & (lr < -0.4))
    lengths = mask.sum(1, keepdim=True)
    g = torch.exp((torch.where(clipped, lr.clamp(-0.4, 0.4), lr) * mask).sum(1, keepdim=True) / lengths)
    expected = -g * a * (~clipped) * mask / (lengths * mask.shape[0])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)


def test_gmpo_on_policy_is_grpos_gradient_with_seq_mean_token_mean():
    logp, _, adv, mask = random_batch(5)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    gmpo_loss(a, a.detach(), adv, mask)[0].backward()
    grpo_loss(b, b.detach(), None, adv, mask, CLIP, 0.0, "seq-mean-token-mean")[0].backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


def test_each_objective_keeps_a_junk_padding_weight_out_of_the_gradient():
    logp, old, adv, mask = random_batch(6)
    weight = torch.where(mask.bool(), 0.5, NAN).to(F64)
    for fn in (lambda *a, **k: cispo_loss(*a, clip=(0.2, 0.28), **k), sapo_loss, gmpo_loss):
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        fn(a, old, adv, mask, pg_weight=weight)[0].backward()
        fn(b, old, adv, mask)[0].backward()
        torch.testing.assert_close(a.grad, 0.5 * b.grad, rtol=1e-12, atol=0)


def test_micro_batch_aggregation_weight_is_kept():
    logp, old, adv, mask = random_batch(7)
    agg = common.Aggregation("seq-mean-token-mean", None, 0.25)
    for fn in (lambda *a, **k: cispo_loss(*a, clip=(0.2, 0.28), **k), sapo_loss, gmpo_loss):
        assert fn(logp, old, adv, mask, loss_agg=agg)[0].item() == pytest.approx(
            0.25 * fn(logp, old, adv, mask, loss_agg="seq-mean-token-mean")[0].item(), rel=1e-12)


# ---------------------------------------------------------------------------------- the lab: --policy_loss
def lab_step(out_dir, *flags):
    """One step of lab/grpo.py (in process); its metrics row."""
    from lab import grpo as lab_grpo
    from support.run import read_metrics

    argv = ["lab/grpo.py", "--num_steps", "1", "--batch_size", "16", "--num_generations", "4", "--eval_every", "100",
            "--save_model", "False", "--log_rollouts", "0", "--output_dir", str(out_dir), *flags]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", argv)
        lab_grpo.main()
    return read_metrics(out_dir / "metrics.jsonl")[-1]


def test_each_policy_loss_trains_one_step_with_the_on_policy_gradient_of_its_peer(tmp_path):
    """One update on the same samples (the same seed): on-policy CISPO's gradient is PPO's with token-mean, SAPO's
    and GMPO's are PPO's with seq-mean-token-mean (the gradient norms agree to float32 rounding); each loss logs
    its own statistics."""
    rows = {name: lab_step(tmp_path / name, *flags) for name, flags in {
        "ppo": [], "ppo_token": ["--loss_agg", "token-mean"], "cispo": ["--policy_loss", "cispo", "--loss_agg",
                                                                       "token-mean"],
        "sapo": ["--policy_loss", "sapo"], "gmpo": ["--policy_loss", "gmpo"]}.items()}
    for name, peer in (("cispo", "ppo_token"), ("sapo", "ppo"), ("gmpo", "ppo")):
        assert rows[name]["train/reward"] == rows[peer]["train/reward"]
        assert rows[name]["train/grad_norm"] == pytest.approx(rows[peer]["train/grad_norm"], rel=1e-4), name
    assert rows["sapo"]["train/gate_weight"] == pytest.approx(1.0, abs=1e-5)
    assert rows["cispo"]["train/clip_frac_high"] == 0 and rows["gmpo"]["train/clip_frac_low"] == 0


@pytest.mark.parametrize("flags, message", [
    ({"policy_loss": "sapo", "importance_sampling_level": "sequence"}, "--importance_sampling_level sequence is"),
    ({"policy_loss": "gmpo", "loss_agg": "token-mean"}, "--loss_agg token-mean"),
    ({"policy_loss": "sapo", "epsilon_high": 0.3}, "--epsilon_high needs"),
    ({"policy_loss": "cispo", "tau_pos": 0.0}, "--tau_pos must be > 0"),
    ({"policy_loss": "clip"}, "--policy_loss must be ppo, cispo, sapo or gmpo"),
])
def test_policy_loss_flags_are_checked(flags, message):
    from lab.grpo import Config

    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        Config(**flags)


def test_cispo_and_gmpo_clip_defaults():
    """CISPO: no lower bound and the cap r <= 5 (eps_high 4); GMPO: (e^-0.4, e^0.4); PPO keeps 0.2."""
    from lab.grpo import Config

    assert Config(policy_loss="cispo").clip[:2] == (1.0, 4.0)
    assert Config(policy_loss="cispo", epsilon=0.2, epsilon_high=0.28).clip[:2] == (0.2, 0.28)
    assert Config(policy_loss="gmpo").clip[:2] == (0.4, 0.4)
    assert Config().clip[:2] == (0.2, 0.2)


@pytest.mark.parametrize("kl_is_weight", [False, True])
@pytest.mark.parametrize("policy_loss, loss_agg", [("sapo", "seq-mean-token-mean"), ("gmpo", "seq-mean-token-mean"),
                                                   ("cispo", "token-mean")])
def test_the_labs_composition_adds_grpos_kl_term(policy_loss, loss_agg, kl_is_weight):
    """lab/grpo.py's objective_loss: the objective plus beta times the KL term, per token, aggregated as grpo_loss adds
    it. On-policy the objectives' gradients are the policy gradient, so with a reference (k3, beta 0.1, its padding
    NaN; --kl_is_weight: weighted by the ratio) the whole gradient and the kl_term statistic are the lab's grpo_loss's
    (the lesson's without the ratio weight)."""
    from lab.grpo import Config, objective_loss
    from lab.losses import grpo_loss as lab_grpo_loss

    logp, ref, adv, mask = random_batch(8)
    ref = torch.where(mask.bool(), ref, NAN)
    cfg = Config(policy_loss=policy_loss, beta=0.1, loss_agg=loss_agg, kl_is_weight=kl_is_weight)
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    _, stats = objective_loss(cfg, a, a.detach(), ref, adv, mask, loss_agg, None)
    objective_loss(cfg, a, a.detach(), ref, adv, mask, loss_agg, None)[0].backward()
    peer = (lambda *args: lab_grpo_loss(*args, ratio_weight=True)) if kl_is_weight else grpo_loss
    _, peer_stats = peer(b, b.detach(), ref, adv, mask, CLIP, 0.1, loss_agg)
    peer(b, b.detach(), ref, adv, mask, CLIP, 0.1, loss_agg)[0].backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15)
    assert stats["kl_term"].item() == pytest.approx(peer_stats["kl_term"].item(), rel=1e-12)
