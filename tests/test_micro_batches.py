"""Micro-batching is exact: the weighted losses of micro-batches add up to the whole batch's loss, so
their gradients add up to its gradient, for every algorithm's loss and every aggregation, and across
data-parallel processes; a real run's logged losses do not depend on --micro_batch_size."""
import os
import sys

import pytest
import torch

import common
import dapo
import grpo
import ppo
import remax
import rloo
from conftest import run_together
from lab import losses
from support.helpers import micro_batches
from support.run import read_metrics

B, T, V, D = 8, 5, 6, 4


def make_batch(seed=0):
    """A shared weight matrix (the 'model'), fixed features, targets and a ragged completion mask, fp64."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 5, 2, 4, 1, 5])
    return {
        "weight": torch.randn(D, V, generator=g, dtype=torch.float64),
        "value_weight": torch.randn(D, generator=g, dtype=torch.float64),
        "features": torch.randn(B, T, D, generator=g, dtype=torch.float64),
        "targets": torch.randint(0, V, (B, T), generator=g),
        "mask": (torch.arange(T)[None, :] < lengths[:, None]).long(),
        "adv": torch.randn(B, generator=g, dtype=torch.float64),
        "token_adv": torch.randn(B, T, generator=g, dtype=torch.float64),
        "old_shift": 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),  # pi_old != pi_theta: clips bind
        "ref_shift": 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "returns": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def logprobs(batch, rows, weight):
    logits = batch["features"][rows] @ weight
    return torch.log_softmax(logits, -1).gather(-1, batch["targets"][rows, :, None]).squeeze(-1)


def loss_fn(name, loss_agg):
    """loss(batch, rows, weight, value_weight) of one algorithm on the given rows, as its loop calls it."""
    def remax_(b, rows, w, vw):
        logp = logprobs(b, rows, w)
        kl = common.kl_k1(logp.detach(), logp.detach() - b["ref_shift"][rows])
        return remax.remax_loss(logp, b["adv"][rows], kl, b["mask"][rows], 0.1, common.Aggregation(loss_agg, T))[0]

    def grpo_(b, rows, w, vw):
        logp = logprobs(b, rows, w)
        old = logp.detach() + b["old_shift"][rows]
        return losses.grpo_loss(logp, old, old + b["ref_shift"][rows], b["adv"][rows], b["mask"][rows],
                                common.Clip(0.2, 0.2), 0.04, common.Aggregation(loss_agg, T), dual_c=3.0)[0]

    def dapo_(b, rows, w, vw):
        logp = logprobs(b, rows, w)
        return dapo.dapo_loss(logp, logp.detach() + b["old_shift"][rows], b["adv"][rows], b["mask"][rows],
                              common.Clip(0.2, 0.28), common.Aggregation(loss_agg))[0]

    def rloo_(b, rows, w, vw):
        return rloo.rloo_loss(logprobs(b, rows, w), b["adv"][rows], b["mask"][rows])[0]

    def ppo_(b, rows, w, vw):
        logp = logprobs(b, rows, w)
        pg_loss, _ = ppo.ppo_policy_loss(logp, logp.detach() + b["old_shift"][rows], b["token_adv"][rows],
                                         b["mask"][rows], common.Clip(0.2, 0.2))
        values = b["features"][rows] @ vw
        vf_loss, _ = ppo.ppo_value_loss(values, values.detach() + b["old_shift"][rows], b["returns"][rows],
                                        b["mask"][rows], 0.2)
        return pg_loss + 0.1 * vf_loss

    return {"remax": remax_, "grpo": grpo_, "dapo": dapo_, "rloo": rloo_, "ppo": ppo_}[name]


def flat_grads(*params):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def gradients(batch, fn, parts):
    """Gradients of sum over parts of weight(part) * loss(part), as the loops backpropagate them.
    parts: (rows, num_tokens, num_sequences, loss_agg) per micro-batch."""
    w = batch["weight"].clone().requires_grad_()
    vw = batch["value_weight"].clone().requires_grad_()
    for rows, num_tokens, num_sequences, loss_agg in parts:
        weight = common.micro_batch_weight(batch["mask"][rows], loss_agg, num_tokens, num_sequences)
        (weight * fn(batch, rows, w, vw)).backward()
    return flat_grads(w, vw)


CASES = [("remax", agg) for agg in common.LOSS_AGG_MODES] + [("grpo", agg) for agg in common.LOSS_AGG_MODES] + \
    [("dapo", "token-mean"), ("rloo", "seq-mean"), ("ppo", "token-mean")]


@pytest.mark.parametrize("name, loss_agg", CASES)
@pytest.mark.parametrize("micro_batch_size", [1, 3, 0])
def test_micro_batch_gradients_add_up_to_the_whole_batch_gradient(name, loss_agg, micro_batch_size):
    batch, fn = make_batch(), loss_fn(name, loss_agg)
    w = batch["weight"].clone().requires_grad_()
    vw = batch["value_weight"].clone().requires_grad_()
    fn(batch, slice(0, B), w, vw).backward()
    whole = flat_grads(w, vw)
    num_tokens = batch["mask"].sum().double()
    parts = [(mb, num_tokens, B, loss_agg) for mb in micro_batches(B, micro_batch_size)]
    assert whole.abs().max() > 1e-3
    torch.testing.assert_close(gradients(batch, fn, parts), whole, rtol=0, atol=1e-12)


def test_averaging_each_micro_batchs_token_mean_is_not_the_token_mean():
    """The trap the weights avoid: with ragged lengths, the mean over micro-batches of their own token-means
    weighs a token of a short micro-batch more than one of a long micro-batch."""
    batch, fn = make_batch(), loss_fn("dapo", "token-mean")
    num_tokens = batch["mask"].sum().double()
    right = gradients(batch, fn, [(mb, num_tokens, B, "token-mean") for mb in micro_batches(B, 2)])
    naive = gradients(batch, fn, [(mb, batch["mask"][mb].sum() * 4, B, "token-mean")  # each micro-batch's mean / 4
                                  for mb in micro_batches(B, 2)])
    assert (right - naive).abs().max() > 1e-3


@pytest.mark.parametrize("name, loss_agg", [("grpo", "token-mean"), ("ppo", "token-mean"),
                                            ("grpo", "seq-mean-token-mean"), ("rloo", "seq-mean")])
def test_loss_across_processes_is_the_loss_of_the_global_batch(name, loss_agg):
    """Two data-parallel processes of 4 sequences with different token counts (14 and 12), each in
    micro-batches: DDP averages their gradients, and with num_tokens = the mean token count per process
    the result is the gradient of the loss over the union of both batches."""
    batch, fn = make_batch(), loss_fn(name, loss_agg)
    w = batch["weight"].clone().requires_grad_()
    vw = batch["value_weight"].clone().requires_grad_()
    fn(batch, slice(0, B), w, vw).backward()
    whole = flat_grads(w, vw)
    halves = [slice(0, 4), slice(4, B)]
    assert batch["mask"][halves[0]].sum() != batch["mask"][halves[1]].sum()
    num_tokens = batch["mask"].sum().double() / 2
    per_process = []
    for half in halves:
        rows = [slice(half.start + mb.start, half.start + mb.stop) for mb in micro_batches(4, 3)]
        per_process.append(gradients(batch, fn, [(r, num_tokens, 4, loss_agg) for r in rows]))
    torch.testing.assert_close((per_process[0] + per_process[1]) / 2, whole, rtol=0, atol=1e-12)


def test_micro_batches_cover_the_batch_in_order():
    assert micro_batches(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert micro_batches(7, 0) == [slice(0, 7)]
    assert micro_batches(4, 8) == [slice(0, 4)]


# Every loop of both tiers, with what makes its statistics: several epochs (a ratio that moves), PPO's minibatches,
# the lab's stale sampler and its corrections (TIS, the veto, the geometric mask, M2PO) and VAPO's pieces.
LOOPS = {
    "remax.py": [], "rloo.py": [], "grpo.py": ["--num_epochs", "2"], "dapo.py": ["--num_epochs", "2"],
    "ppo.py": ["--num_epochs", "2", "--num_mini_batches", "2"], "reinforce_pp.py": ["--num_epochs", "2"],
    "lab/remax.py": [], "lab/rloo.py": ["--rollout_lag", "1", "--tis_cap", "2", "--m2po_tau", "1e-4"],
    "lab/grpo.py": ["--num_epochs", "2", "--rollout_lag", "1", "--tis_cap", "1.5", "--tis_veto", "0.5",
                    "--geo_mask_delta", "1e-4", "--m2po_tau", "1e-4"],
    "lab/dapo.py": ["--num_epochs", "2", "--rollout_lag", "1", "--tis_cap", "2", "--tis_level", "sequence"],
    "lab/ppo.py": ["--num_epochs", "2", "--num_mini_batches", "2", "--value_pretrain_steps", "1", "--pos_lm_coef",
                   "0.1", "--lam_alpha", "0.05", "--num_generations", "4"],
}


def command(script, micro_batch_size, out_dir):
    lab = ["--generation_batch_size", "16", "--save_model", "False"] if script.startswith("lab/") else []
    return [sys.executable, script, "--num_steps", "2", "--batch_size", "16", "--micro_batch_size",
            str(micro_batch_size), "--eval_every", "1000", "--output_dir", str(out_dir), *lab, *LOOPS[script]]


@pytest.mark.parametrize("script", LOOPS)
def test_a_run_in_micro_batches_logs_every_statistic_of_one_in_whole_batches(script, tmp_path):
    """Every statistic a loop logs (train/ and pretrain/) is the whole batch's, whatever --micro_batch_size: a mean
    over tokens by the micro-batches' token counts, a mean over rows by their rows, a fraction or an ESS from their
    sums, an extreme from their extremes. Compared up to float rounding over the first step, whose updates start
    from the same weights; later the runs' weights part by more than rounding (AdamW moves a weight by about lr
    whatever the size of its gradient, so an element near 0 whose sign rounding flips moves visibly), and only the
    loss is compared there, as the loss and the gradient norm are by their own bounds."""
    small = 8 if "rloo" in script else 5  # rloo: whole groups of 8; the others: 5 does not divide 16
    sizes = (small, 16)
    for out in run_together([command(script, mb, tmp_path / str(mb)) for mb in sizes],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}):
        assert out.returncode == 0, out.stderr[-2000:]
    rows = {mb: [r for r in read_metrics(tmp_path / str(mb) / "metrics.jsonl") if "train/loss" in r
                 or "pretrain/value_loss_first" in r] for mb in sizes}
    assert len(rows[small]) == len(rows[16]) == 2 + ("--value_pretrain_steps" in LOOPS[script])
    for a, b in zip(rows[small][:-1], rows[16][:-1]):  # step 1 (and the pretraining before it)
        keys = sorted(k for k in b if k.startswith(("train/", "pretrain/")))
        assert sorted(k for k in a if k.startswith(("train/", "pretrain/"))) == keys
        for key in set(keys) - {"train/loss", "train/grad_norm", "train/critic_grad_norm"}:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"])
    for a, b in zip(rows[small][-2:], rows[16][-2:]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    # the first step's gradient norm only (AdamW, above)
    assert rows[small][-2]["train/grad_norm"] == pytest.approx(rows[16][-2]["train/grad_norm"], rel=1e-4)
    assert rows[16][-1]["train/loss"] != rows[16][-2]["train/loss"]  # the weights moved between steps


def test_two_optimizers_under_fp16_loss_scaling_step_once_each_on_gradients_unscaled_once(monkeypatch):
    """PPO steps the policy's and the critic's optimizers after one backward. With fp16 loss scaling both are
    clipped and stepped on the true gradients, and the scale is updated once: as without a scaler."""
    from accelerate import Accelerator

    from lab import engine

    accelerator = Accelerator(cpu=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monkeypatch.setattr(accelerator, "scaler", scaler)  # what accelerate builds for fp16 on a GPU
    torch.manual_seed(0)
    x = torch.randn(4, 3)

    def parts():
        torch.manual_seed(1)
        nets = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)]
        return nets, [torch.optim.SGD(m.parameters(), lr=0.1) for m in nets]

    nets, optimizers = parts()  # the reference: no scaler
    (nets[0](x).square().sum() + nets[1](x).sum()).backward()
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in nets]
    for opt in optimizers:
        opt.step()
    nets_s, optimizers_s = parts()
    prepared = accelerator.prepare(*nets_s, *optimizers_s)  # the optimizers get the scaler
    monkeypatch.setattr(accelerator, "native_amp", True)  # after prepare: the forwards stay fp32, exact
    monkeypatch.setattr(type(accelerator), "mixed_precision", property(lambda self: "fp16"))
    trainables = [engine.Trainable(prepared[0], prepared[2], None), engine.Trainable(prepared[1], prepared[3], None,
                                                                                     "critic")]
    accelerator.backward(prepared[0](x).square().sum() + prepared[1](x).sum())  # scaled by 1024
    norms_s = engine.clip_grad_norms(accelerator, trainables, 0.5)
    engine.step_optimizers(accelerator, trainables)
    torch.testing.assert_close(torch.stack(norms_s), torch.stack(norms))
    for m, m_s in zip(nets, prepared[:2]):
        for p, p_s in zip(m.parameters(), m_s.parameters()):
            torch.testing.assert_close(p_s, p)
            assert p_s.grad is None or not p_s.grad.any()  # zeroed
    assert scaler._growth_tracker == 1  # one scale update for the step, not one per optimizer
