"""VAPO's pieces (docs/algorithms.md#vapo): the positive-example LM loss (vapo.py), clip-higher in PPO's policy
loss, value pretraining on Monte Carlo returns, and the --vapo recipe."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import common  # noqa: E402

from lab import ppo as lab_ppo  # noqa: E402
from lab.engine import Trainable  # noqa: E402
from ppo import ppo_policy_loss  # noqa: E402
import vapo  # noqa: E402

F64 = torch.float64


def test_positive_example_nll_is_the_token_mean_of_minus_logp_over_the_correct_samples_only():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -4.0, -5.0], [-0.5, -7.0, -7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=F64)
    correct = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    # the correct samples' tokens: -1, -2 (row 0) and -0.5 (row 2): (1 + 2 + 0.5) / 3, the padding's -9 left out
    whole = vapo.positive_example_nll(logp, mask, correct)
    torch.testing.assert_close(whole, torch.tensor(3.5 / 3, dtype=F64))
    # micro-batches given the minibatch's count of correct tokens add up to the minibatch's loss
    parts = [vapo.positive_example_nll(logp[rows], mask[rows], correct[rows], num_tokens=3.0)
             for rows in (slice(0, 2), slice(2, 3))]
    torch.testing.assert_close(sum(parts), whole)
    assert vapo.positive_example_nll(logp, mask, torch.zeros(3, dtype=F64)) == 0  # no correct sample: 0


def test_positive_example_nll_over_processes_averages_to_the_global_token_mean_even_below_one_token_each():
    """Two processes, one correct token between them (on process 0): N = 1 over the global minibatch, the mean count
    per process 0.5. DDP averages the processes' gradients, so the token's gradient must be -1 / N = -1, not the
    -0.5 a count clamped to at least 1 gives."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 0]], dtype=F64)
    per_process = []
    for correct in (torch.tensor([1.0], dtype=F64), torch.tensor([0.0], dtype=F64)):
        (grad,) = torch.autograd.grad(vapo.positive_example_nll(logp, mask, correct, num_tokens=0.5), logp)
        per_process.append(grad)
    torch.testing.assert_close((per_process[0] + per_process[1]) / 2, torch.tensor([[-1.0, 0.0]], dtype=F64))
    # no correct token on any process: 0, and no division by 0
    loss = vapo.positive_example_nll(logp, mask, torch.tensor([0.0], dtype=F64), num_tokens=0.0)
    assert loss == 0 and torch.isfinite(loss)


def test_clip_higher_clips_a_positive_advantage_at_one_plus_epsilon_high_and_a_negative_at_one_minus_epsilon():
    logp = torch.log(torch.tensor([[1.25, 1.3, 0.75]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=F64)
    loss, stats = ppo_policy_loss(logp, torch.zeros(1, 3, dtype=F64), adv, torch.ones(1, 3, dtype=F64),
                                  common.Clip(0.2, 0.28))
    # 1.25 inside [0.8, 1.28] (the symmetric 0.2 would clip it); 1.3 clipped to 1.28; 0.75 clipped to 0.8 with A < 0
    torch.testing.assert_close(loss, torch.tensor(-(1.25 + 1.28 - 0.8) / 3, dtype=F64))
    loss.backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0
    assert stats["clip_frac_high"] == 1 / 3 and stats["clip_frac_low"] == 1 / 3


def test_vapo_recipe_fills_the_flags_left_unset_and_keeps_those_given():
    cfg = lab_ppo.Config(vapo=True)
    assert (cfg.lam_critic, cfg.lam_alpha, cfg.clip.high, cfg.pos_lm_coef, cfg.value_pretrain_steps,
            cfg.num_generations) == (1.0, 0.05, 0.28, 0.1, 10, 16)
    cfg = lab_ppo.Config(vapo=True, lam_alpha=0.1, pos_lm_coef=0.0, value_pretrain_steps=3, num_generations=1)
    assert (cfg.lam_alpha, cfg.pos_lm_coef, cfg.value_pretrain_steps, cfg.num_generations) == (0.1, 0.0, 3, 1)
    cfg = lab_ppo.Config()  # off: PPO as the lesson
    assert (cfg.lam_critic, cfg.lam_alpha, cfg.clip.high, cfg.pos_lm_coef, cfg.value_pretrain_steps,
            cfg.num_generations) == (None, 0.0, 0.2, 0.0, 0, 1)
    with pytest.raises(ValueError, match="--num_generations"):
        lab_ppo.Config(vapo=True, batch_size=8, num_mini_batches=2)  # 16 samples of a prompt do not fit in 8


def test_group_sampling_one_step_samples_batch_size_over_g_prompts_g_times_each_adjacent(tmp_path):
    """VAPO's group sampling in a one-step run: 8 rows are 2 prompts sampled 4 times each, each prompt's rows
    adjacent (the run's rollouts.jsonl shows every row of step 1)."""
    subprocess.run([sys.executable, "lab/ppo.py", "--vapo", "True", "--num_steps", "1", "--value_pretrain_steps", "1",
                    "--batch_size", "8", "--num_generations", "4", "--num_mini_batches", "2", "--num_epochs", "1",
                    "--eval_every", "1", "--log_rollouts", "8", "--output_dir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = json.loads((tmp_path / "rollouts.jsonl").read_text().splitlines()[0])["rows"]
    prompts = [row["prompt"] for row in rows]
    assert len(prompts) == 8 and prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4
    assert prompts[0] != prompts[4]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("pretrain/value_loss_first" in m for m in metrics) and any("train/pos_lm_loss" in m for m in metrics)


class BiasCritic(torch.nn.Module):
    """V(h_t) = one learned number per position."""
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(3))

    def forward(self, input_ids, attention_mask, num_tokens):
        return self.bias[:num_tokens].expand(len(input_ids), num_tokens)


def test_value_pretraining_regresses_the_critic_on_the_monte_carlo_return_and_reports_its_loss():
    """Rewards 1, 0, 1, 1 at the last token: with lam = 1 and V = 0 every token's target is its sequence's reward,
    so each position's value goes to the mean reward of the sequences that reach it, and the loss falls."""
    accelerator = Accelerator(cpu=True)
    model = BiasCritic()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    critic = Trainable(*accelerator.prepare(model, optimizer), None, name="critic")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    fields = {"mask": mask, "input_ids": torch.zeros(4, 5, dtype=torch.long), "attention_mask": torch.ones(4, 5),
              "examples": None, "completions": None, "rewards": None, "__len__": lambda self: 4}
    rollout = type("Rollout", (), fields)()
    trainer = SimpleNamespace(rollout=lambda sampler: rollout,
                              values=lambda model, rollout: model(rollout.input_ids, rollout.attention_mask, 3).detach())

    def reward_fn(*args):
        return torch.tensor([1.0, 0.0, 1.0, 1.0]), None, None
    cfg = SimpleNamespace(value_pretrain_steps=30, num_epochs=1, num_mini_batches=1, gamma=1.0, max_grad_norm=0,
                          beta=0.05)
    stats = lab_ppo.pretrain_value(cfg, accelerator, trainer, critic, None, reward_fn)
    # position 0: rewards 1, 0, 1, 1 -> 0.75; position 1: 1, 0, 1 -> 2/3; position 2: 1, 1 -> 1
    torch.testing.assert_close(model.bias.detach(), torch.tensor([0.75, 2 / 3, 1.0]), atol=1e-3, rtol=0)
    # first batch: V = 0, so 0.5 * mean(R^2) over the 9 tokens: 7 of them with R = 1
    torch.testing.assert_close(stats["pretrain/value_loss_first"], torch.tensor(0.5 * 7 / 9))
    # last batch: what no V can explain, the spread of the rewards at positions 0 (0.75) and 1 (2/3), over 9 tokens
    torch.testing.assert_close(stats["pretrain/value_loss_last"], torch.tensor(0.5 * (0.75 + 2 / 3) / 9), atol=1e-4,
                               rtol=0)


class OneOfTwoProcesses:
    """An accelerator of one process of two whose other process holds other_tokens tokens in every minibatch:
    its reduce(.., "mean") averages with that count; everything else is the real single-process accelerator's."""
    def __init__(self, accelerator, other_tokens):
        self.accelerator, self.other_tokens = accelerator, other_tokens

    def __getattr__(self, name):
        return getattr(self.accelerator, name)

    def reduce(self, tensor, reduction):
        assert reduction == "mean"
        return (tensor + self.other_tokens) / 2


def pretraining_update(mask, rewards, accelerator=None):
    """The change of a BiasCritic's values after one pretraining step (SGD, lr 1) on a batch of these rows."""
    accelerator = accelerator or Accelerator(cpu=True)
    model = BiasCritic()
    critic = Trainable(model, torch.optim.SGD(model.parameters(), lr=1.0), None, name="critic")
    fields = {"mask": mask, "input_ids": torch.zeros(len(mask), 5, dtype=torch.long),
              "attention_mask": torch.ones(len(mask), 5), "examples": None, "completions": None, "rewards": None,
              "__len__": lambda self: len(mask)}
    rollout = type("Rollout", (), fields)()
    trainer = SimpleNamespace(rollout=lambda sampler: rollout,
                              values=lambda model, rollout: model(rollout.input_ids, rollout.attention_mask, 3).detach())
    cfg = SimpleNamespace(value_pretrain_steps=1, num_epochs=1, num_mini_batches=1, gamma=1.0, max_grad_norm=0,
                          beta=0.05)
    lab_ppo.pretrain_value(cfg, accelerator, trainer, critic, None, lambda *args: (rewards, None, None))
    return model.bias.detach()


def test_value_pretraining_under_data_parallelism_is_the_global_batch_s_token_mean():
    """Process 0 holds 3 tokens, process 1 holds 7: DDP averages their gradients, and the update must be that of the
    token-mean over all 10 (each token weighing 1/10), not the mean of two token-means (1/6 and 1/14)."""
    mask_a = torch.tensor([[1, 1, 1]], dtype=torch.float32)
    mask_b = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    rewards_a, rewards_b = torch.tensor([1.0]), torch.tensor([0.0, 1.0, 1.0])
    accelerator = Accelerator(cpu=True)
    update_a = pretraining_update(mask_a, rewards_a, OneOfTwoProcesses(accelerator, 7.0))
    update_b = pretraining_update(mask_b, rewards_b, OneOfTwoProcesses(accelerator, 3.0))
    whole = pretraining_update(torch.cat([mask_a, mask_b]), torch.cat([rewards_a, rewards_b]), accelerator)
    # the whole batch's token-mean, by hand: d/dV_p of 0.5 sum (V_p - R)^2 / 10 at V = 0 is -(sum of R at p) / 10
    torch.testing.assert_close(whole, torch.tensor([3.0, 2.0, 2.0]) / 10)
    torch.testing.assert_close((update_a + update_b) / 2, whole)


def test_value_pretraining_targets_include_the_k1_penalty_of_a_truncated_sampler():
    """With --top_p the policy's log-probs are the truncated distribution's and k1 = logp - ref_logp is not 0: the
    target is the main loop's return, R - beta sum_{s >= t} k1_s, at lam = 1 and V = 0."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    k1 = torch.tensor([[0.5, 1.0, 2.0], [1.0, 3.0, 9.0]])  # row 1's last is padding
    fields = {"mask": mask, "input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5),
              "examples": None, "completions": None, "rewards": None, "__len__": lambda self: 2}
    rollout = type("Rollout", (), fields)()
    model = BiasCritic()
    accelerator = Accelerator(cpu=True)
    critic = Trainable(model, torch.optim.SGD(model.parameters(), lr=0.0), None, name="critic")
    trainer = SimpleNamespace(rollout=lambda sampler: rollout, old_logprobs=lambda rollout: k1 - 4.0,
                              reference_logprobs=lambda ref_model, rollout: torch.full_like(k1, -4.0),
                              values=lambda model, rollout: model(rollout.input_ids, rollout.attention_mask, 3).detach())
    cfg = SimpleNamespace(value_pretrain_steps=1, num_epochs=1, num_mini_batches=1, gamma=1.0, max_grad_norm=0, beta=0.1)
    stats = lab_ppo.pretrain_value(cfg, accelerator, trainer, critic, None,
                                   lambda *args: (torch.tensor([1.0, 0.0]), None, None), ref_model="the reference")
    # returns: row 0: 1 - 0.1 * (3.5, 3, 2); row 1: 0 - 0.1 * (4, 3); V = 0, so the loss is 0.5 mean R_t^2
    returns = torch.tensor([0.65, 0.7, 0.8, -0.4, -0.3])
    torch.testing.assert_close(stats["pretrain/value_loss_first"], 0.5 * (returns ** 2).mean())
