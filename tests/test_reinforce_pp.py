"""REINFORCE++ (docs/algorithms.md): k1 in each token's reward, the return normalised over the whole batch (every
process's tokens), its baseline variant, the clipped surrogate; equal to verl's advantages when verl is installed."""
import ast
import importlib.util
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
import reinforce_pp  # noqa: E402
from reinforce_pp import reinforce_pp_advantages, reinforce_pp_loss  # noqa: E402
from support.run import read_metrics  # noqa: E402

F64 = torch.float64


def whiten(values):
    """(x - mean) / sqrt(var + 1e-8) of a list, var with Bessel's correction."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# two completions, of 2 and 3 tokens: the first's third position is padding, holding junk
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
KL = torch.tensor([[0.1, 0.2, float("nan")], [0.3, 0.0, -0.2]], dtype=F64)
REWARDS = torch.tensor([1.0, 0.0], dtype=F64)


def test_return_is_the_reward_to_go_with_k1_in_each_tokens_reward_whitened_over_the_batch():
    # beta 0.5: G_t = R - 0.5 sum_{s >= t} k1_s; row 0: 1 - 0.15, 1 - 0.1; row 1: -0.05, 0.1, 0.1
    adv = reinforce_pp_advantages(REWARDS, KL, MASK, beta=0.5)
    returns = torch.tensor([0.85, 0.9, -0.05, 0.1, 0.1], dtype=F64)  # mean 0.38; squared deviations sum to 0.833
    torch.testing.assert_close(adv[MASK.bool()], (returns - 0.38) / math.sqrt(0.833 / 4 + 1e-8))
    assert adv[0, 2] == 0.0  # the padding gets 0, whatever its k1


def test_baseline_variant_subtracts_the_group_mean_of_the_sequence_return_then_whitens_its_tokens():
    # two groups of two; G_0 = R - beta sum_t k1_t with beta 1: [1 - 0.3, 0 - 0.1 | 1, 1]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=F64)
    kl = torch.tensor([[0.1, 0.2, 5.0], [0.1, 9.0, 9.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64), kl, mask, beta=1.0, group_size=2)
    # group means 0.3 and 1: per sequence 0.4, -0.4, 0, 0, on each of its 2, 1, 3, 1 tokens (the tokens weigh)
    returns = torch.tensor([0.4, 0.4, -0.4, 0.0, 0.0, 0.0, 0.0], dtype=F64)  # mean 0.4 / 7
    torch.testing.assert_close(adv[mask.bool()], (returns - returns.mean()) / torch.sqrt(returns.var() + 1e-8))
    torch.testing.assert_close(adv[0, 0], adv[0, 1])  # one advantage per sequence


def test_the_batch_not_the_group_sets_the_scale_so_a_solved_prompt_keeps_a_positive_advantage():
    # GRPO gives the all-correct group 0; REINFORCE++ compares it with the batch; the baseline variant gives it 0
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)
    mask, kl = torch.ones(4, 2, dtype=F64), torch.zeros(4, 2, dtype=F64)
    assert (reinforce_pp_advantages(rewards, kl, mask, beta=0.1)[:2] > 0).all()
    assert reinforce_pp_advantages(rewards, kl, mask, beta=0.1, group_size=2)[:2].abs().max() < 1e-6


@pytest.mark.parametrize("group_size", [None, 2])
def test_processes_padded_to_one_length_and_gathered_give_the_whole_batchs_advantages(group_size):
    """Under DDP each process pads its completions to the longest (accelerator.pad_across_processes, zeros) and
    gathers: the statistics are the whole batch's, and each process takes back its rows, cut to its own length."""
    torch.manual_seed(0)
    lengths = torch.tensor([[3, 1, 4, 2], [6, 5, 1, 2]])  # per process, per row
    masks = [(torch.arange(int(row.max()))[None] < row[:, None]).double() for row in lengths]  # T = 4 and 6
    kls = [torch.randn(m.shape, dtype=F64) for m in masks]
    rewards = [torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64), torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64)]
    pad = [torch.nn.functional.pad(x, (0, 6 - x.shape[1])) for x in (*kls, *masks)]
    adv = reinforce_pp_advantages(torch.cat(rewards), torch.cat(pad[:2]), torch.cat(pad[2:]), 0.3, group_size)
    mine = adv.chunk(2)[0][:, :4]  # process 0's rows and length
    tokens = [float(x) for r, k, m in zip(rewards, kls, masks) for x in returns_by_hand(r, k, m, 0.3, group_size)]
    expected = whiten(tokens)[:int(lengths[0].sum())]  # process 0's tokens come first
    torch.testing.assert_close(mine[masks[0].bool()], torch.tensor(expected, dtype=F64))


def returns_by_hand(rewards, kl, mask, beta, group_size):
    """Each completion token's return, row by row, by loops (its group's mean G_0 subtracted with group_size)."""
    rows = []
    for r, k, m in zip(rewards.tolist(), kl.tolist(), mask.tolist()):
        n = int(sum(m))
        rows.append([r - beta * sum(k[t:n]) for t in range(n)])
    if group_size:
        firsts = [row[0] for row in rows]
        means = [sum(firsts[i - i % group_size:][:group_size]) / group_size for i in range(len(rows))]
        rows = [[row[0] - mean] * len(row) for row, mean in zip(rows, means)]
    return [x for row in rows for x in row]


def test_loss_is_the_clipped_surrogate_on_per_token_advantages_with_clip_higher():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]], dtype=F64)).requires_grad_()
    old = torch.zeros(1, 3, dtype=F64)
    adv = torch.tensor([[1.0, -2.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    loss, stats = reinforce_pp_loss(logp, old, adv, mask, clip=common.Clip(0.2, 0.28), loss_agg="token-mean")
    # token 0: min(1.5, 1.28) * 1 = 1.28; token 1: min(0.5 * -2, 0.8 * -2) = -1.6; token 2 masked
    torch.testing.assert_close(loss, torch.tensor(-(1.28 - 1.6) / 2, dtype=F64))
    assert stats["clip_frac_high"] == 0.5 and stats["clip_frac_low"] == 0.5
    loss.backward()  # both tokens clipped: no gradient through either
    assert logp.grad.abs().max() == 0


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--baseline"):
        reinforce_pp.Config(baseline="batch")


# ---------------------------------------------------------------- the peer: verl's advantages, when installed

def verl_functions():
    """verl's two REINFORCE++ functions and the masked statistics they call, read from its installed source (verl
    imports ray and more on import; these functions need torch alone). VERL_PATH: a folder holding the package
    (pip install --no-deps verl --target DIR). None without verl."""
    spec = importlib.util.find_spec("verl") if not os.environ.get("VERL_PATH") else None
    folder = Path(os.environ["VERL_PATH"]) / "verl" if os.environ.get("VERL_PATH") else \
        Path(spec.origin).parent if spec and spec.origin else None
    if folder is None or not (folder / "trainer/ppo/core_algos.py").exists():
        return None
    F = SimpleNamespace()
    namespace = {"torch": torch, "defaultdict": defaultdict, "verl_F": F, "Optional": type(None).__class__}
    for path, names in (("utils/torch_functional.py", ("masked_sum", "masked_mean", "masked_var", "masked_whiten")),
                        ("trainer/ppo/core_algos.py", ("compute_reinforce_plus_plus_outcome_advantage",
                                                       "compute_reinforce_plus_plus_baseline_outcome_advantage"))):
        tree = ast.parse((folder / path).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                node.decorator_list, node.returns = [], None
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    arg.annotation = None
                exec(compile(ast.Module([node], []), str(folder / path), "exec"), namespace)
                setattr(F, node.name, namespace[node.name])
    return namespace


@pytest.mark.parametrize("group_size", [None, 4])
def test_advantages_equal_verls_on_identical_tensors(group_size):
    verl = verl_functions()
    if verl is None:
        pytest.skip("verl is not installed (pip install --no-deps verl --target DIR; VERL_PATH=DIR)")
    torch.manual_seed(1)
    B, T, beta = 16, 7, 0.05
    lengths = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    kl, rewards = torch.randn(B, T) * mask, torch.randint(0, 2, (B,)).float()
    # verl's token-level rewards: -beta k1 on each token, the task reward added at the last (apply_kl_penalty)
    token_rewards = -beta * kl
    token_rewards[torch.arange(B), lengths - 1] += rewards
    if group_size is None:
        expected, _ = verl["compute_reinforce_plus_plus_outcome_advantage"](
            token_rewards, mask, config=SimpleNamespace(gamma=1.0))
    else:
        index = [str(i // group_size) for i in range(B)]
        expected, _ = verl["compute_reinforce_plus_plus_baseline_outcome_advantage"](token_rewards, mask, index)
    adv = reinforce_pp_advantages(rewards, kl, mask, beta, group_size)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- a run

def test_one_step_runs_and_logs(tmp_path, monkeypatch):
    monkeypatch.setattr(reinforce_pp.helpers, "evaluate", lambda *args: {"eval/accuracy": 0.0})  # the step alone
    monkeypatch.setattr(sys, "argv", ["reinforce_pp.py", "--num_steps", "1", "--batch_size", "8",
                                      "--baseline", "group", "--output_dir", str(tmp_path)])
    reinforce_pp.main()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["train/kl_seq"] == 0.0 and math.isfinite(rows[1]["train/loss"])  # step 1: policy == reference
