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


def test_clip_higher_clips_a_positive_advantage_at_one_plus_epsilon_high_and_a_negative_at_one_minus_epsilon():
    logp = torch.log(torch.tensor([[1.25, 1.3, 0.75]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=F64)
    loss, stats = ppo_policy_loss(logp, torch.zeros(1, 3, dtype=F64), adv, torch.ones(1, 3, dtype=F64), (0.2, 0.28))
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
    cfg = SimpleNamespace(value_pretrain_steps=30, num_epochs=1, num_mini_batches=1, gamma=1.0, max_grad_norm=0)
    stats = lab_ppo.pretrain_value(cfg, accelerator, trainer, critic, None, reward_fn)
    # position 0: rewards 1, 0, 1, 1 -> 0.75; position 1: 1, 0, 1 -> 2/3; position 2: 1, 1 -> 1
    torch.testing.assert_close(model.bias.detach(), torch.tensor([0.75, 2 / 3, 1.0]), atol=1e-3, rtol=0)
    # first batch: V = 0, so 0.5 * mean(R^2) over the 9 tokens: 7 of them with R = 1
    torch.testing.assert_close(stats["pretrain/value_loss_first"], torch.tensor(0.5 * 7 / 9))
    # last batch: what no V can explain, the spread of the rewards at positions 0 (0.75) and 1 (2/3), over 9 tokens
    torch.testing.assert_close(stats["pretrain/value_loss_last"], torch.tensor(0.5 * (0.75 + 2 / 3) / 9), atol=1e-4,
                               rtol=0)
