"""M2PO (docs/async.md): the tokens of largest squared log-ratio between the trainer and a stale sampler are masked,
one by one, until the mean squared log-ratio of the tokens left is at most tau."""
import sys

import pytest
import torch

import common
from lab import grpo  # the lab's loop: --m2po_tau is its
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
    keep = common.m2po_mask(LOG_RATIO, MASK, tau)
    assert keep.tolist() == kept  # padding is never kept, and never counted


def test_m2po_ignores_what_the_padding_holds():
    padded = LOG_RATIO.clone()
    padded[0, 2] = float("nan")
    assert torch.equal(common.m2po_mask(padded, MASK, 0.04), common.m2po_mask(LOG_RATIO, MASK, 0.04))
    assert common.m2po_mask(LOG_RATIO, torch.zeros_like(MASK), 0.04).sum() == 0  # no valid token: nothing kept


def test_rollout_correction_zeroes_the_masked_tokens_and_reports_their_fraction_over_micro_batches():
    """r = pi_theta / mu: the trainer's log-probs 0, the sampler's minus LOG_RATIO. At tau = 0.04 two of the five
    valid tokens go; the fraction is the batch's whether the rows come in one micro-batch or one by one (the
    mask itself is computed over the rows given, the batch at --micro_batch_size 0)."""
    logp = torch.zeros_like(LOG_RATIO)
    weight, stats, _ = common.rollout_correction(logp, logp, -LOG_RATIO, torch.ones(2, dtype=torch.float64), MASK,
                                                 m2po_tau=0.04)
    assert (weight * MASK).tolist() == [[0, 1, 0], [0, 1, 1]]
    assert stats["m2po_masked_frac"].value() == 2 / 5
    rows = [common.rollout_correction(logp[i:i + 1], logp[i:i + 1], -LOG_RATIO[i:i + 1], torch.ones(1),
                                      MASK[i:i + 1], m2po_tau=0.04).stats for i in range(2)]
    # row by row: row 0 alone (1, 1/16) masks both (1/16 > 0.04); row 1 alone (1/4, 0, 1/64) masks -0.5: 3 tokens of
    # 5, combined by their token counts, not the mean of the rows' fractions (1 and 1/3)
    assert combine([(MASK[i].sum() / MASK.sum(), rows[i]) for i in range(2)])["m2po_masked_frac"].item() == \
        pytest.approx(3 / 5, rel=1e-7)
    weight, stats, _ = common.rollout_correction(logp, logp, -LOG_RATIO, torch.ones(2), MASK, m2po_tau=0.3)
    assert stats["m2po_masked_frac"].value() == 0 and (weight * MASK).equal(MASK.double())


@pytest.mark.parametrize("kwargs", [{"m2po_tau": 0.04}, {"m2po_tau": -1.0, "rollout_lag": 1}])
def test_bad_m2po_flags_raise_a_value_error_naming_the_flag(kwargs):
    with pytest.raises(ValueError, match="--m2po_tau"):
        grpo.Config(**kwargs)  # the first: the trainer samples, its ratio is 1, nothing to mask
    grpo.Config(m2po_tau=0.04, rollout_lag=2)


def test_m2po_masks_nothing_on_policy_and_tokens_once_the_sampler_is_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lab/grpo.py", "--num_steps", "3", "--batch_size", "32", "--num_generations", "4",
                                      "--learning_rate", "1e-3", "--rollout_lag", "1", "--m2po_tau", "1e-6",
                                      "--eval_every", "100", "--save_model", "False", "--output_dir", str(tmp_path)])
    grpo.main()
    rows = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert rows[0]["train/m2po_masked_frac"] == 0  # step 1: the sampler is the trainer, every log-ratio 0
    assert all(0 < r["train/m2po_masked_frac"] < 1 for r in rows[1:])
