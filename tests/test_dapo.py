"""DAPO (docs/algorithms.md): clip-higher, token-mean, dynamic sampling, overlong shaping, runs."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import math  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import common  # noqa: E402
from lab import losses as lab_losses  # noqa: E402
from lab import tasks  # noqa: E402
from support import config  # noqa: E402
from support.run import read_metrics  # noqa: E402
import grpo  # noqa: E402
from dapo import dapo_loss, dynamic_sampling_filter, grpo_advantages, overlong_penalty  # noqa: E402
from lab import dapo as lab_dapo  # noqa: E402
from lab.dapo import Config  # noqa: E402  (the lab's: --dynamic_sampling_metric and the rest)

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


# ---------------------------------------------------------------- overlong shaping

def test_overlong_penalty_check_values_from_the_paper():
    lengths = torch.tensor([10000, 16384, 17408, 18432, 20480, 20481])
    assert overlong_penalty(lengths, max_len=20480, cache_len=4096).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_overlong_penalty_default_spares_every_right_answer():
    """Defaults here: max_len = max_new_tokens = 8, cache 3: the longest right answer
    (4 digits + EOS = 5 tokens) gets 0, then -1/3, -2/3, -1."""
    penalty = overlong_penalty(torch.arange(1, 9), max_len=8, cache_len=3)
    torch.testing.assert_close(penalty, torch.tensor([0, 0, 0, 0, 0, -1 / 3, -2 / 3, -1]))
    longest = max(len(ex["answer"]) for ex in tasks.arithmetic_examples(5000, seed=0, held_out=False))
    assert longest + 1 <= 8 - 3  # answer + EOS fits under max_len - cache_len


def test_overlong_penalty_with_no_cache_only_punishes_past_max_len():
    assert overlong_penalty(torch.tensor([7, 8, 9]), max_len=8, cache_len=0).tolist() == [0.0, 0.0, -1.0]


# ---------------------------------------------------------------- dynamic sampling

def test_dynamic_sampling_keeps_only_groups_with_mixed_correctness():
    correct = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1], dtype=torch.float)  # G = 3
    assert dynamic_sampling_filter(correct, group_size=3).tolist() == [False, False, True, True]


def test_dynamic_sampling_drops_uniform_groups_of_any_size():
    correct = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # G = 2: mixed, all wrong, all right
    assert dynamic_sampling_filter(correct, group_size=2).tolist() == [True, False, False]
    assert dynamic_sampling_filter(correct, group_size=6).tolist() == [True]


def test_dynamic_sampling_filters_on_correctness_not_on_the_shaped_reward(tmp_path, monkeypatch):
    """main() hands the filter the 0/1 correctness, not the reward. With --reward_scales hetero the
    rewards are per-family values that differ from the correctness, so filtering on them would
    show; the filter's input is compared with what the reward function returned."""
    returned, filtered, make_reward_fn = [], [], tasks.make_reward_fn

    def recording_reward_fn(cfg, device):
        reward_fn = make_reward_fn(cfg, device)

        def recorded(examples, completions, scored=None):
            rewards, correct, stats = reward_fn(examples, completions, scored)
            returned.append((rewards.clone(), correct.clone()))
            return rewards, correct, stats
        return recorded

    def recording_filter(values, group_size):
        filtered.append(values.clone())
        return dynamic_sampling_filter(values, group_size)

    monkeypatch.setattr(tasks, "make_reward_fn", recording_reward_fn)
    monkeypatch.setattr(lab_dapo, "dynamic_sampling_filter", recording_filter)
    monkeypatch.setattr(sys, "argv", ["lab/dapo.py", "--num_steps", "1", "--batch_size", "16", "--reward_scales", "hetero",
                                      "--max_sampling_rounds", "1", "--eval_every", "100", "--save_model", "False",
                                      "--output_dir", str(tmp_path)])
    lab_dapo.main()
    training = [(r, c) for r, c in returned if len(r) == len(filtered[0])]  # not the evaluation's calls
    assert filtered and len(training) >= len(filtered)
    for values, (rewards, correct) in zip(filtered, training):
        assert torch.equal(values, correct) and not torch.equal(values, rewards)


# ---------------------------------------------------------------- advantage and loss

def test_advantage_is_grpos_group_advantage():
    """dapo.py carries its own copy of GRPO's advantage (a file imports no other algorithm file); its default,
    scale_rewards='group', is DAPO's: std with ddof 1, eps 1e-6, all-equal groups exactly 0. The copy agrees
    with grpo.py's for every scaling, on groups with ties and all-equal groups."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rewards = torch.randint(0, 3, (24,), generator=g).to(F64) + 0.5 * torch.randn(24, generator=g, dtype=F64).round()
        for scale in ("group", "batch", "none"):
            assert torch.equal(grpo_advantages(rewards, 4, scale), grpo.grpo_advantages(rewards, 4, scale))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 4.0, 2.0, 0.7, 0.7, 0.7, 0.7], dtype=F64)
    s2 = math.sqrt(4 / 3)  # group 1: mean 1/4, std 1/2; group 2: mean 3, std sqrt(4/3); group 3: all equal
    expected = ([0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3 + [x / (s2 + 1e-6) for x in (-1, 1, 1, -1)]
                + [0.0] * 4)
    torch.testing.assert_close(grpo_advantages(rewards, 4), torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)


def one_token_grad(ratio, adv, epsilon_low=0.2, epsilon_high=0.28):
    logp = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    loss, stats = dapo_loss(logp, torch.zeros(1, 1, dtype=F64), torch.tensor([adv], dtype=F64), torch.ones(1, 1),
                            common.Clip(epsilon_low, epsilon_high))
    loss.backward()
    return logp.grad.item(), stats


@pytest.mark.parametrize("adv, ratio, clipped", [
    (1.0, 1.25, False), (1.0, 1.27, False), (1.0, 1.29, True),  # A > 0: clipped above 1 + 0.28, not 1 + 0.2
    (1.0, 0.7, False),
    (-1.0, 0.81, False), (-1.0, 0.79, True),                      # A < 0: clipped below 1 - 0.2
    (-1.0, 1.25, False), (-1.0, 1.5, False),
])
def test_clip_higher_bounds(adv, ratio, clipped):
    grad, stats = one_token_grad(ratio, adv)
    assert (grad == 0.0) == clipped
    if not clipped:
        assert grad == pytest.approx(-ratio * adv, rel=1e-12)
    assert stats["clip_frac_high"].item() == float(clipped and adv > 0)
    assert stats["clip_frac_low"].item() == float(clipped and adv < 0)


def test_clip_higher_is_asymmetric():
    """At rho = 1.25 a positive-advantage token still learns under clip-higher and not under the
    symmetric clip; at rho = 0.75 a negative-advantage token is clipped in both."""
    assert one_token_grad(1.25, 1.0)[0] != 0.0 and one_token_grad(1.25, 1.0, 0.2, 0.2)[0] == 0.0
    assert one_token_grad(0.75, -1.0)[0] == 0.0 and one_token_grad(0.75, -1.0, 0.2, 0.2)[0] == 0.0


def test_dapo_loss_is_a_token_mean_over_the_batch():
    """Every kept token gets gradient -A_i / (number of kept tokens in the batch), so a long
    response counts per token (GRPO's seq-mean-token-mean would give -A_i / (L_i * B))."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -50.0, -50.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = dapo_loss(logp, logp.detach(), torch.tensor([2.0, -1.0], dtype=F64), mask, common.Clip(0.2, 0.28))
    loss.backward()
    assert loss.item() == pytest.approx(-(3 * 2.0 - 1.0) / 4, rel=1e-12)
    assert logp.grad.tolist() == [[-0.5, -0.5, -0.5], [0.25, 0.0, 0.0]]
    assert stats["approx_kl"].item() == 0.0


def test_dual_clip_and_pg_weight():
    """The lab's --dual_clip_c 3 (lab/losses.py on DAPO's clip): a token with A < 0 and rho = 5 costs 3 |A| and
    gets no gradient; a pg_weight (TIS, masks) scales each token's surrogate."""
    logp = torch.tensor([[math.log(5.0), 0.0]], dtype=F64, requires_grad=True)
    loss, _ = lab_losses.clipped_loss(logp, torch.zeros(1, 2, dtype=F64), torch.tensor([-1.0], dtype=F64),
                                      torch.ones(1, 2), common.Clip(0.2, 0.28), dual_c=3.0,
                                      pg_weight=torch.tensor([[1.0, 0.5]], dtype=F64))
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 0.5 * 1.0) / 2, rel=1e-12)
    assert logp.grad.tolist() == [[0.0, 0.25]]


@pytest.mark.parametrize("kwargs, flags", [
    ({"batch_size": 12, "num_generations": 8}, ["--batch_size", "--num_generations"]),
    ({"num_generations": 1, "batch_size": 8}, ["--num_generations"]),
    ({"epsilon_high": 0.1}, ["--epsilon_high", "--epsilon_low"]),
    ({"epsilon_low": 1.0, "epsilon_high": 1.0}, ["--epsilon_low"]),
    ({"max_sampling_rounds": 0}, ["--max_sampling_rounds"]),
    ({"overlong_cache_len": 9}, ["--overlong_cache_len"]),
    ({"dynamic_sampling_metric": "score"}, ["--dynamic_sampling_metric"]),
    ({"num_epochs": 0}, ["--num_epochs"]),
])
def test_bad_config_raises_a_value_error_naming_the_flag(kwargs, flags):
    with pytest.raises(ValueError) as e:
        Config(**kwargs)
    for flag in flags:
        assert flag in str(e.value)


# ---------------------------------------------------------------- runs

def assert_params_changed(final_dir, changed=True):
    trained = AutoModelForCausalLM.from_pretrained(final_dir)
    start = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    assert (max((a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters())) > 0) == changed


def run(args, tmp_path):
    out = subprocess.run([sys.executable, "lab/dapo.py", *args, "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return read_metrics(tmp_path / "metrics.jsonl"), out.stderr


def test_dapo_end_to_end_writes_metrics_plot_and_model(tmp_path):
    rows, _ = run(["--num_steps", "2", "--eval_every", "1", "--batch_size", "16"], tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("eval/accuracy" in r for r in rows)
    for key in ("train/reward", "train/sampling_rounds", "train/groups_dropped", "train/groups_kept", "train/overlong_penalty",
                "train/clip_frac_low", "train/clip_frac_high", "train/approx_kl", "train/entropy", "train/grad_norm",
                "train/completion_len", "time/generation_s"):
        assert key in rows[1], key
    assert "train/kl_seq" not in rows[1] and "train/kl_k3" not in rows[1]  # no reference model, no KL
    for r in rows[1:]:
        assert r["train/frac_zero_std_groups"] == 0.0 and r["train/groups_kept"] == 16 / 8
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert_params_changed(tmp_path / "final")


def test_dynamic_sampling_stops_at_the_cap_and_skips_a_step_with_nothing_kept(tmp_path):
    """Near-greedy sampling makes every group's G samples identical, so no group is mixed: the
    loop stops after --max_sampling_rounds rounds, warns naming the flag, and does not update."""
    rows, stderr = run(["--num_steps", "1", "--batch_size", "16", "--temperature", "1e-4", "--max_sampling_rounds", "3"], tmp_path)
    assert rows[1]["train/sampling_rounds"] == 3 and rows[1]["train/groups_dropped"] == 3 * 16 / 8
    assert rows[1]["train/skipped_step"] == 1.0
    assert rows[1]["train/generated"] == 3 * 16  # every round's samples count, none trained on
    assert "--max_sampling_rounds 3" in stderr and "skipping the step" in stderr
    assert_params_changed(tmp_path / "final", changed=False)


def test_dynamic_sampling_trains_on_the_groups_kept_when_the_cap_is_hit(tmp_path):
    """One round of 32 groups of 2: some are mixed and some not, so the batch is not full."""
    rows, stderr = run(["--num_steps", "1", "--batch_size", "64", "--num_generations", "2", "--max_sampling_rounds", "1"], tmp_path)
    assert rows[1]["train/sampling_rounds"] == 1 and rows[1]["train/skipped_step"] == 0.0
    assert 0 < rows[1]["train/groups_kept"] < 32 and rows[1]["train/groups_kept"] + rows[1]["train/groups_dropped"] == 32
    assert rows[1]["train/generated"] == 64
    # the sampled reward covers all 32 groups of 2: a kept (mixed) group sums to 1, a dropped one to 0 or 2
    dropped_sum = rows[1]["train/reward_sampled"] * 64 - rows[1]["train/groups_kept"]
    assert round(dropped_sum) == pytest.approx(dropped_sum, abs=1e-4) and round(dropped_sum) % 2 == 0
    assert 0 <= dropped_sum <= 2 * rows[1]["train/groups_dropped"]
    assert "--max_sampling_rounds 1" in stderr and "training on those" in stderr
    assert_params_changed(tmp_path / "final")

