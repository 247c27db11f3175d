"""Stale rollouts (--rollout_lag k, docs/stability.md): the sampler is the policy of k optimizer steps
ago, k = 0 is the on-policy loop, and the mismatch metrics, truncated importance sampling and the
geometric mask see the staleness as they see a low-precision sampler."""
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from lab import dapo, grpo, rloo  # the lab's loops: --rollout_lag, --rollout_dtype and the corrections
from lab import engine, sampling
from support import config
from support.run import read_metrics

# 8 prompts x 4 samples at a high learning rate: the policy moves at every step from the first
FLAGS = ["--batch_size", "32", "--num_generations", "4", "--learning_rate", "1e-3", "--eval_every", "100",
         "--save_model", "False"]


def run(module, out_dir, *flags, steps=4, record=None):
    """Run `module` for `steps` steps; with a list `record`, append per step (the trainer's weights when it
    samples, the sampler's weights). Returns the metrics of steps 1..steps."""
    original = engine.Trainer.generate

    def generate(self, *args, **kwargs):
        start = [p.detach().clone() for p in self.accelerator.unwrap_model(self.policy.model).parameters()]
        rollout = original(self, *args, **kwargs)
        record.append((start, [p.detach().clone() for p in self.rollout_model.parameters()]))
        return rollout

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [module.__name__.replace(".", "/") + ".py", "--num_steps", str(steps), *FLAGS, *flags,
                                 "--output_dir", str(out_dir)])
        if record is not None:
            mp.setattr(engine.Trainer, "generate", generate)
        module.main()
    return read_metrics(out_dir / "metrics.jsonl")[1:]


@pytest.mark.parametrize("k, extra", [(2, []), (1, ["--rollout_dtype", "bfloat16"]), (2, ["--lora_r", "4"])])
def test_the_sampler_at_step_t_holds_the_trainers_weights_of_step_t_minus_k(k, extra, tmp_path):
    """At step t the trainer starts from its weights after step t - 1; the sampler from those after
    step t - 1 - k (the initial weights while t <= k), cast to --rollout_dtype. Under LoRA the adapter
    is what lags; the frozen base is the trainer's."""
    record = []
    rows = run(grpo, tmp_path, "--rollout_lag", str(k), *extra, steps=5, record=record)
    dtype = torch.bfloat16 if extra[:1] == ["--rollout_dtype"] else torch.float32
    for (before, _), (after, _) in zip(record, record[1:]):  # every step moves the trainer: an off-by-one shows
        assert any(not torch.equal(a, b) for a, b in zip(before, after))
    for t in range(1, 6):
        trainer_then, sampler = record[max(t - k, 1) - 1][0], record[t - 1][1]
        assert all(torch.equal(s, w.to(dtype)) for s, w in zip(sampler, trainer_then, strict=True)), t
        assert rows[t - 1]["train/staleness"] == min(k, t - 1)
    trainer_now, sampler = record[-1]
    assert any(not torch.equal(s, w.to(dtype)) for s, w in zip(sampler, trainer_now))  # the lag is visible


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """GRPO, 4 steps, seed 0: on-policy; --rollout_lag 0; lag 2; lag 2 with TIS and the geometric mask."""
    out = tmp_path_factory.mktemp("lag")
    return {"on-policy": run(grpo, out / "a"), "lag 0": run(grpo, out / "b", "--rollout_lag", "0"),
            "lag 2": run(grpo, out / "c", "--rollout_lag", "2"),
            "corrected": run(grpo, out / "d", "--rollout_lag", "2", "--tis_cap", "1.01", "--geo_mask_delta", "1e-3")}


def train_metrics(row):
    return {key: value for key, value in row.items() if key.startswith(("train/", "eval/", "step"))}


def test_lag_0_reproduces_the_on_policy_run(runs):
    assert [train_metrics(r) for r in runs["lag 0"]] == [train_metrics(r) for r in runs["on-policy"]]
    # no sampler copy: the mismatch is not measured (it would be 0), as in the on-policy run
    assert all(r["train/staleness"] == 0 and "train/mismatch_k3" not in r for r in runs["lag 0"])


def test_a_stale_sampler_is_on_policy_until_the_first_update_and_then_off_policy(runs):
    on_policy, stale = runs["on-policy"], runs["lag 2"]
    # step 1: no update yet, the sampler is the trainer: the same completions, loss and gradient
    for key in ("train/reward", "train/loss", "train/grad_norm"):
        assert stale[0][key] == on_policy[0][key], key
    assert stale[0]["train/mismatch_k3"] == 0
    assert stale[0]["train/mismatch_ratio_max"] == stale[0]["train/mismatch_ratio_min"] == 1
    # then the sampler lags the trainer: KL(sampler || trainer) > 0, ratios on both sides of 1
    assert [r["train/staleness"] for r in stale] == [0, 1, 2, 2]
    for row in stale[1:]:
        assert row["train/mismatch_k3"] > 0
        assert row["train/mismatch_ratio_min"] < 1 < row["train/mismatch_ratio_max"]
    assert all("train/mismatch_k3" not in r for r in on_policy)  # the trainer samples: nothing to measure


def test_tis_and_the_geometric_mask_act_on_a_stale_sampler(runs):
    stale, corrected = runs["lag 2"], runs["corrected"]
    # step 1 is on-policy: every weight is 1, nothing capped or masked, the same loss
    assert corrected[0]["train/loss"] == stale[0]["train/loss"]
    assert corrected[0]["train/tis_clip_frac"] == corrected[0]["train/geo_masked_frac"] == 0
    # step 2: the same samples (the same initial sampler, the same trainer after step 1), weighted otherwise
    assert corrected[1]["train/reward"] == stale[1]["train/reward"]
    assert corrected[1]["train/mismatch_k3"] == stale[1]["train/mismatch_k3"]
    assert corrected[1]["train/loss"] != stale[1]["train/loss"]
    assert max(r["train/tis_clip_frac"] for r in corrected) > 0
    assert max(r["train/geo_masked_frac"] for r in corrected) > 0
    assert all(r["train/tis_clip_frac"] == r["train/geo_masked_frac"] == 0 for r in stale)


@pytest.mark.parametrize("module", [rloo, dapo])
def test_rloo_and_dapo_sample_with_a_stale_policy(module, tmp_path):
    """DAPO samples several rounds per step: every round of a step uses the same stale weights."""
    rows = run(module, tmp_path, "--rollout_lag", "1", "--tis_cap", "2", steps=3)
    assert [r["train/staleness"] for r in rows] == [0, 1, 1]
    assert rows[0]["train/mismatch_k3"] == 0 and rows[2]["train/mismatch_k3"] > 0


def test_after_a_resume_the_sampler_restarts_from_the_resumed_weights(tmp_path):
    """The past weights are not checkpointed (docs/stability.md): the lag grows back from 0."""
    run(grpo, tmp_path, "--rollout_lag", "2", "--save_steps", "3", steps=3)
    rows = run(grpo, tmp_path, "--rollout_lag", "2", "--save_steps", "3", "--resume_from", "latest", steps=6)
    assert [r["train/staleness"] for r in rows if r.get("step", 0) >= 4 and "train/staleness" in r] == [0, 1, 2]


@pytest.mark.parametrize("kwargs, flag", [
    ({"rollout_lag": -1}, "--rollout_lag"),
    ({"tis_cap": 2.0, "rollout_lag": 0}, "--tis_cap"),  # neither a copy nor a lag: nothing to correct
    ({"geo_mask_delta": 0.1, "rollout_lag": 0}, "--geo_mask_delta"),
])
def test_bad_lag_flags_raise_a_value_error_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        grpo.Config(**kwargs)
    grpo.Config(rollout_lag=2, tis_cap=2.0, geo_mask_delta=0.1)  # a stale sampler: both corrections allowed
    rloo.Config(rollout_lag=1, tis_cap=2.0)


def test_a_lag_under_zero3_is_refused():
    """ZeRO-3 shards every weight (DeepSpeed marks them with ds_id): there is no whole policy to copy."""
    policy = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    next(policy.parameters()).ds_id = 0
    with pytest.raises(SystemExit, match="--rollout_lag"):
        sampling.load_rollout_model(grpo.Config(rollout_lag=1), policy)
