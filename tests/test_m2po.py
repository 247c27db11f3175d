"""M2PO (docs/async.md): the tokens of largest squared log-ratio between the trainer and a stale sampler are masked,
one by one, until the mean squared log-ratio of the tokens left is at most tau."""
import sys
from types import SimpleNamespace

import pytest
import torch

from lab import corrections, engine, grpo  # the lab's loop: --m2po_tau is its
from support.helpers import combine
from support.run import read_metrics

# two rows, the first with one padded position (holding a value that would dominate were it counted)
LOG_RATIO = torch.tensor([[1.0, 0.25, 9.0], [-0.5, 0.0, 0.125]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
# (log r)^2 of the valid tokens: 1, 1/16, 1/4, 0, 1/64 (exact in binary); their mean 17/64. Masking the largest
# one by one leaves means 21/256 (4 left), 5/192 (3 left), 1/128 (2 left), 0 (the 0.0 token alone).


@pytest.mark.parametrize("tau, kept", [
    (0.3, [[1, 1, 0], [1, 1, 1]]),            # already below: nothing masked
    (17 / 64, [[1, 1, 0], [1, 1, 1]]),        # the stopping rule is <= tau
    (21 / 256, [[0, 1, 0], [1, 1, 1]]),       # the largest, 1.0, goes first
    (0.04, [[0, 1, 0], [0, 1, 1]]),           # then -0.5: by the square, not the signed ratio (0.25 would go)
    (0.02, [[0, 0, 0], [0, 1, 1]]),           # 5/192 > 0.02 over the 3 left (over all 5 it would be 1/64 and stop)
    (0.0, [[0, 0, 0], [0, 1, 0]]),            # only the token whose ratio is 1 survives
])
def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_of_the_rest_is_at_most_tau(tau, kept):
    keep = corrections.m2po_mask(LOG_RATIO, MASK, tau)
    assert keep.tolist() == kept  # padding is never kept, and never counted


def test_m2po_ignores_what_the_padding_holds():
    padded = LOG_RATIO.clone()
    padded[0, 2] = float("nan")
    assert torch.equal(corrections.m2po_mask(padded, MASK, 0.04), corrections.m2po_mask(LOG_RATIO, MASK, 0.04))
    assert corrections.m2po_mask(LOG_RATIO, torch.zeros_like(MASK), 0.04).sum() == 0  # no valid token: nothing kept


def test_m2po_masks_the_whole_batch_whatever_its_micro_batches_and_is_ess_counts_the_mask():
    """(log r)^2 of row 0: [1, 0 x 29], of row 1: [0.2 x 10], tau = 0.04. Over the batch's 40 tokens (mean 3/40)
    masking 1.0, then 0.2 three times leaves 1.4 / 36 = 0.0389 <= tau: 4 of 40 masked. Row by row, row 0 alone
    (mean 1/30) would mask nothing and row 1 alone all ten (0.2 > tau however many are left): 10 of 40."""
    mask = torch.zeros(2, 30, dtype=torch.long)
    mask[0], mask[1, :10] = 1, 1
    log_ratio = torch.zeros(2, 30, dtype=torch.float64)
    log_ratio[0, 0], log_ratio[1, :10] = 1.0, 0.2 ** 0.5
    keep = corrections.m2po_mask(log_ratio, mask, 0.04)
    assert ((keep == 0) & mask.bool()).sum() == 4 and keep[0, 0] == 0 and keep[0, 1:].all()
    rowwise = sum(int(((corrections.m2po_mask(log_ratio[i:i + 1], mask[i:i + 1], 0.04) == 0)
                       & mask[i:i + 1].bool()).sum()) for i in range(2))
    assert rowwise == 10  # what a mask computed per micro-batch of one row gave
    logp = torch.zeros_like(log_ratio)  # the loss takes the batch's mask, one micro-batch or two
    whole = corrections.rollout_correction(logp, logp, -log_ratio, torch.ones(2, dtype=torch.float64), mask,
                                           m2po_keep=keep)
    assert (whole.weight * mask).equal(keep.double())
    assert whole.stats["m2po_masked_frac"].value() == 4 / 40
    # is_ess of the weights in use: 36 ones and 4 zeros over the 40 valid tokens, 36^2 / (40 x 36)
    assert whole.stats["is_ess"].value().item() == pytest.approx(0.9, rel=1e-12)
    rows = [corrections.rollout_correction(logp[i:i + 1], logp[i:i + 1], -log_ratio[i:i + 1], torch.ones(1),
                                           mask[i:i + 1], m2po_keep=keep[i:i + 1]).stats for i in range(2)]
    split = combine([(mask[i].sum() / mask.sum(), rows[i]) for i in range(2)])
    assert split["m2po_masked_frac"].item() == pytest.approx(0.1, rel=1e-7)
    assert split["is_ess"].item() == pytest.approx(0.9, rel=1e-7)


def test_m2po_s_mask_is_computed_once_from_pi_old_over_the_sampler():
    """engine.m2po_keep: of log(pi_old / mu) over the process's whole batch, pi_old scored when the loop has
    none (one update per batch); None when M2PO is off or the policy samples itself."""
    rollout = SimpleNamespace(mask=MASK)
    old_logp, rollout_logp = LOG_RATIO - 2.0, torch.full_like(LOG_RATIO, -2.0)
    trainer = SimpleNamespace(cfg=SimpleNamespace(m2po_tau=0.04), old_logprobs=lambda r: old_logp,
                              accelerator=SimpleNamespace(num_processes=1, process_index=0))
    expected = corrections.m2po_mask(LOG_RATIO, MASK, 0.04)
    assert engine.m2po_keep(trainer, rollout, old_logp, rollout_logp).equal(expected)
    assert engine.m2po_keep(trainer, rollout, None, rollout_logp).equal(expected)  # scored now
    assert engine.m2po_keep(trainer, rollout, old_logp, None) is None
    trainer.cfg.m2po_tau = 0.0
    assert engine.m2po_keep(trainer, rollout, old_logp, rollout_logp) is None


class Process:
    """One of several data-parallel processes, run as threads: gather and pad_across_processes as accelerate's
    collectives (every process calls them in the same order; each waits for all)."""
    def __init__(self, rank, world, slots, barrier):
        self.process_index, self.num_processes, self.slots, self.barrier = rank, world, slots, barrier

    def _all(self, x):
        self.slots[self.process_index] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def gather(self, x):
        return torch.cat(self._all(x))

    def pad_across_processes(self, x, dim=0):
        size = max(t.shape[dim] for t in self._all(x))
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, size - x.shape[dim]]
        return torch.nn.functional.pad(x, pad)


def on_processes(parts, tau):
    """engine.m2po_keep on each process's (log_ratio, mask), the processes run together."""
    import threading
    slots, barrier, out = [None] * len(parts), threading.Barrier(len(parts)), [None] * len(parts)

    def run(rank):
        log_ratio, mask = parts[rank]
        trainer = SimpleNamespace(cfg=SimpleNamespace(m2po_tau=tau), accelerator=Process(rank, len(parts), slots,
                                                                                           barrier))
        out[rank] = engine.m2po_keep(trainer, SimpleNamespace(mask=mask), log_ratio, torch.zeros_like(log_ratio))
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def test_m2po_masks_every_process_s_tokens_together_whatever_the_process_count():
    """The docs' two rows, (log r)^2 = [1, 0 x 29] and [0.2 x 10], at tau = 0.04, one row on each of two processes:
    4 of the 40 tokens masked, as on one process holding both (a mask per process: row 0's mean 1/30 masks nothing,
    row 1 all ten, 10 of 40). The processes' batches differ in width (30 and 10 columns) and in rows (1 and 2)."""
    log_ratio = torch.zeros(2, 30, dtype=torch.float64)
    log_ratio[0, 0], log_ratio[1, :10] = 1.0, 0.2 ** 0.5
    mask = torch.zeros(2, 30, dtype=torch.long)
    mask[0], mask[1, :10] = 1, 1
    one = on_processes([(log_ratio, mask)], 0.04)[0]
    assert ((one == 0) & mask.bool()).sum() == 4
    wide, narrow = (log_ratio[:1], mask[:1]), (log_ratio[1:, :10].repeat(2, 1), mask[1:, :10].repeat(2, 1))
    narrow[1][1] = 0  # process 1's second row is all padding: it holds 10 tokens, as row 1
    keep = on_processes([wide, narrow], 0.04)
    assert keep[0].shape == (1, 30) and keep[1].shape == (2, 10)
    assert keep[0].equal(one[:1]) and keep[1][0].equal(one[1, :10]) and keep[1][1].sum() == 0
    separately = [on_processes([part], 0.04)[0] for part in (wide, narrow)]
    assert sum(int(((k == 0) & m.bool()).sum()) for k, (_, m) in zip(separately, (wide, narrow))) == 10


@pytest.mark.parametrize("kwargs", [{"m2po_tau": 0.04}, {"m2po_tau": -1.0, "rollout_lag": 1}])
def test_bad_m2po_flags_raise_a_value_error_naming_the_flag(kwargs):
    with pytest.raises(ValueError, match="--m2po_tau"):
        grpo.Config(**kwargs)  # the first: the trainer samples, its ratio is 1, nothing to mask
    grpo.Config(m2po_tau=0.04, rollout_lag=2)


def test_m2po_masks_nothing_on_policy_tokens_once_the_sampler_is_stale_and_the_same_in_micro_batches(tmp_path,
                                                                                                         monkeypatch):
    runs = {}
    for micro_batch_size in (0, 8):
        out = tmp_path / str(micro_batch_size)
        monkeypatch.setattr(sys, "argv", ["lab/grpo.py", "--num_steps", "2", "--batch_size", "32", "--num_generations",
                                          "4", "--learning_rate", "1e-3", "--rollout_lag", "1", "--m2po_tau", "1e-6",
                                          "--micro_batch_size", str(micro_batch_size), "--eval_every", "100",
                                          "--save_model", "False", "--output_dir", str(out)])
        grpo.main()
        runs[micro_batch_size] = rows = read_metrics(out / "metrics.jsonl")[1:]
        assert rows[0]["train/m2po_masked_frac"] == 0  # step 1: the sampler is the trainer, every log-ratio 0
        assert 0 < rows[1]["train/m2po_masked_frac"] < 1
    for key in ("train/m2po_masked_frac", "train/is_ess", "train/loss", "train/grad_norm"):  # the batch's mask
        assert runs[8][1][key] == pytest.approx(runs[0][1][key], rel=1e-4, abs=1e-9), key
