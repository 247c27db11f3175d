"""Train-inference mismatch and its corrections (docs/stability.md): truncated importance
sampling, geometric sequence masking, the sampler's top-k/top-p mask kept when scoring, the
low-precision rollout copy, and short runs of the three group methods with all of it on."""
import math
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import common
from lab import corrections, dapo, grpo, rloo  # the lab's loops: --rollout_lag, --rollout_dtype and the corrections
from lab import sampling
from support import config, models, tasks
from support.run import read_metrics

F64 = torch.float64
LN = math.log


def test_truncated_is_weight_is_the_capped_detached_ratio():
    logp = torch.tensor([[LN(0.5), LN(0.1), LN(0.9)]], dtype=F64, requires_grad=True)
    rollout_logp = torch.tensor([[LN(0.25), LN(0.4), LN(0.1)]], dtype=F64)
    w = corrections.truncated_is_weight(logp, rollout_logp, cap=2.0)
    # ratios 2, 0.25, 9: capped above at 2 and never below (0.25 < 1 / cap stays)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.25, 2.0]], dtype=F64))
    assert not w.requires_grad


def test_geometric_sequence_mask_uses_the_mean_log_ratio_over_valid_tokens_and_spares_a_positive_advantage():
    # per-token log(pi_old / pi_theta); the last column is padding and must not count
    drift = torch.tensor([[0.3, 0.1, 5.0],    # mean 0.2 > 0.15, A < 0: masked
                          [0.3, 0.1, 5.0],    # the same drift, A > 0: kept
                          [0.1, 0.1, 0.1],    # mean 0.1 (sum 0.3 > 0.15): kept, the test is per token
                          [0.1, 0.1, 1.0],    # mean 0.1 (0.4 if the padding counted): kept
                          [0.3, 9.0, 9.0]], dtype=F64)  # one valid token, 0.3: masked
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0, -0.5], dtype=F64)
    logp = torch.full_like(drift, -1.0, requires_grad=True)
    keep = corrections.geometric_sequence_mask(logp, logp.detach() + drift, adv, mask, delta=0.15)
    assert keep.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert not keep.requires_grad


def test_rollout_correction_weighs_by_tis_times_the_mask_and_reports_the_mismatch():
    old_logp = torch.tensor([[LN(0.4), LN(0.1)], [LN(0.3), LN(0.3)]], dtype=F64)
    rollout_logp = torch.tensor([[LN(0.2), LN(0.2)], [LN(0.3), LN(0.9)]], dtype=F64)  # ratios 2, 0.5 | 1, 1/3
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    logp = old_logp.clone().requires_grad_()  # one update per batch: pi_theta = pi_old
    weight, stats, per_row = corrections.rollout_correction(logp, old_logp, rollout_logp, adv, mask, tis_cap=1.5,
                                                            geo_mask_delta=0.1)
    # row 0: TIS min(2, 1.5), min(0.5, 1.5); row 1: mean log(rollout / theta) = 0 on its one valid token: kept
    torch.testing.assert_close(weight, torch.tensor([[1.5, 0.5], [1.0, 1.0 / 3]], dtype=F64))
    # k3 of the trainer under the sampler: r - 1 - log r for r = 2, 0.5, 1 (valid tokens only)
    assert stats["mismatch_k3"].item() == pytest.approx(((1 - LN(2)) + (LN(2) - 0.5) + 0) / 3, rel=1e-12)
    # the extremes, which combine over micro-batches by their max and min
    assert stats["mismatch_ratio_max"] == (pytest.approx(2.0), "max")
    assert stats["mismatch_ratio_min"] == (pytest.approx(0.5), "min")
    assert stats["tis_clip_frac"].value().item() == pytest.approx(1 / 3) and stats["geo_masked_frac"].value() == 0.0
    # per row, for the viewer: the TIS weight per token, the mask per sequence, no veto (off)
    torch.testing.assert_close(per_row["tis_weight"][0], torch.tensor([1.5, 0.5], dtype=F64))
    assert per_row["geo_mask"].tolist() == [1.0, 1.0] and per_row["veto"] is None
    # the trainer sampled: every weight is 1 and there is no mismatch
    weight, stats, per_row = corrections.rollout_correction(logp, old_logp, None, adv, mask)
    assert torch.equal(weight, torch.ones_like(weight)) and stats["mismatch_k3"].item() == 0.0
    assert all(value is None for value in per_row.values())


def test_rollout_correction_per_sequence_with_a_veto_and_the_effective_sample_size():
    old_logp = torch.tensor([[LN(0.4), LN(0.3)], [LN(0.3), LN(0.3)]], dtype=F64)
    rollout_logp = torch.tensor([[LN(0.2), LN(0.2)], [LN(0.3), LN(0.9)]], dtype=F64)  # ratios 2, 1.5 | 1, (1/3)
    mask, adv = torch.tensor([[1, 1], [1, 0]]), torch.tensor([1.0, -1.0], dtype=F64)

    def correct(**kw):
        return corrections.rollout_correction(old_logp.clone(), old_logp, rollout_logp, adv, mask, tis_cap=2.5, **kw)
    weight, stats, _ = correct()  # per token: min(r, 2.5) on 2, 1.5, 1; ESS = (sum w)^2 / (n sum w^2)
    assert weight[0].tolist() == pytest.approx([2.0, 1.5]) and weight[1, 0].item() == pytest.approx(1.0)
    assert stats["is_ess"].value().item() == pytest.approx(4.5 ** 2 / (3 * (4 + 2.25 + 1)), rel=1e-12)
    weight, stats, _ = correct(tis_level="sequence")  # min(2 * 1.5, 2.5) = 2.5 | 1: the padded 1/3 counts for nothing
    torch.testing.assert_close(weight, torch.tensor([[2.5, 2.5], [1.0, 1.0]], dtype=F64))
    assert stats["is_ess"].value().item() == pytest.approx(3.5 ** 2 / (2 * (6.25 + 1)), rel=1e-12)
    weight, stats, per_row = correct(tis_level="sequence", tis_veto=1.2)  # row 1's ratio 1 < 1.2: no gradient
    torch.testing.assert_close(weight, torch.tensor([[2.5, 2.5], [0.0, 0.0]], dtype=F64))
    assert per_row["veto"].tolist() == [1.0, 0.0]
    assert stats["tis_veto_frac"].value() == 0.5 and stats["is_ess"].value().item() == pytest.approx(0.5)
    assert correct(tis_veto=0.5).stats["tis_veto_frac"].value() == 0.0  # row 1's 1/3 is padding: no veto


def test_geometric_mask_in_rollout_correction_plays_pi_old_with_the_samplers_log_probs():
    """pi_theta == trainer at sampling time; the sampler is 0.5 nats per token more confident, so
    only the sampler's log-probs reveal the drift."""
    old_logp = torch.full((2, 3), -1.0, dtype=F64)
    rollout_logp = old_logp + 0.5
    weight, stats, _ = corrections.rollout_correction(old_logp.clone(), old_logp, rollout_logp,
                                                      torch.tensor([-1.0, 1.0]), torch.ones(2, 3), geo_mask_delta=0.4)
    assert weight[:, 0].tolist() == [0.0, 1.0] and stats["geo_masked_frac"].value() == 0.5


def split_stats(old_logp, rollout_logp, mask, rows_per_micro_batch, **kw):
    """rollout_correction's statistics of the whole batch, and those of its micro-batches combined as the trainer
    combines them (lab/engine.py: combine, each micro-batch's share of the tokens)."""
    from support.helpers import combine

    def stats(rows):
        adv = torch.ones(len(old_logp[rows]), dtype=F64)
        return corrections.rollout_correction(old_logp[rows].clone(), old_logp[rows], rollout_logp[rows], adv,
                                              mask[rows], **kw).stats
    parts = [slice(i, i + rows_per_micro_batch) for i in range(0, len(mask), rows_per_micro_batch)]
    whole = combine([(torch.tensor(1.0), stats(slice(None)))])
    split = combine([(mask[p].sum() / mask.sum(), stats(p)) for p in parts])
    return whole, split


def test_the_effective_sample_size_and_the_veto_fraction_are_the_whole_batchs_in_micro_batches():
    """4 sequences of 2 tokens, the second one's ratio 10 on a token, truncated at 5 (per sequence): the batch's ESS is
    (1 + 5 + 1 + 1)^2 / (4 (1 + 25 + 1 + 1)) = 4/7; micro-batches of 2 rows averaged by their tokens would say
    (36/52 + 1) / 2 = 0.846. One vetoed sequence of 32 in micro-batches of 10, 10, 10 and 2 rows: 1/32."""
    old_logp = torch.zeros(4, 2, dtype=F64)
    rollout_logp = old_logp.clone()
    rollout_logp[1, 0] = -math.log(10.0)
    mask = torch.ones(4, 2)
    whole, split = split_stats(old_logp, rollout_logp, mask, 2, tis_cap=5.0, tis_level="sequence")
    assert whole["is_ess"].item() == pytest.approx(4 / 7, rel=1e-12) and split["is_ess"] == whole["is_ess"]
    old_logp, mask = torch.zeros(32, 3, dtype=F64), torch.ones(32, 3)
    rollout_logp = old_logp.clone()
    rollout_logp[5, 1] = math.log(4.0)  # pi_train / pi_rollout = 1/4 on a token of row 5: below the veto 0.5
    mask[20:, 2] = 0  # the micro-batches hold different token counts
    whole, split = split_stats(old_logp, rollout_logp, mask, 10, tis_cap=2.0, tis_level="sequence", tis_veto=0.5)
    assert whole["tis_veto_frac"] == split["tis_veto_frac"] == 1 / 32
    assert split["is_ess"].item() == pytest.approx(whole["is_ess"].item(), rel=1e-12)


def test_ppos_updates_log_the_batchs_extremes_and_effective_sample_size():
    """PPO's step: 8 rows of 8 tokens in 4 minibatches of 2 rows, one token with pi_train / pi_rollout = e, TIS
    capped at 3. The batch's max is e (a mean of the minibatches' maxima would say (e + 3) / 4 = 1.430) and its ESS
    (63 + e)^2 / (64 (63 + e^2)) = 0.9587 (the minibatches' mean: (0.8763 + 3) / 4 = 0.9691)."""
    from lab import engine
    from support.helpers import combine
    old_logp, mask = torch.zeros(8, 8, dtype=F64), torch.ones(8, 8, dtype=F64)
    rollout_logp = old_logp.clone()
    rollout_logp[5, 3] = -1.0
    updates, micro_batches = [], []
    for rows in torch.arange(8).chunk(4):  # each minibatch one update, of one micro-batch
        stats = corrections.rollout_correction(old_logp[rows].clone(), old_logp[rows], rollout_logp[rows],
                                               torch.ones(2, dtype=F64), mask[rows], tis_cap=3.0).stats
        micro_batches.append((mask[rows].sum(), stats))  # (its token count, its statistics)
        updates.append({"loss": torch.tensor(float(len(updates))), **combine([micro_batches[-1]])})
    step = engine.over_updates(updates, micro_batches)
    assert step["mismatch_ratio_max"].item() == pytest.approx(math.e, rel=1e-6)
    assert step["mismatch_ratio_min"].item() == 1.0
    assert step["is_ess"].item() == pytest.approx((63 + math.e) ** 2 / (64 * (63 + math.e ** 2)), rel=1e-12)
    assert step["tis_clip_frac"].item() == 0 and step["loss"].item() == 1.5  # what is a mean stays one


def test_ppos_step_logs_the_mismatch_as_the_whole_batchs_token_mean():
    """Two minibatches of 4 and 2 tokens (one row each), one token of the second with pi_train / pi_rollout = e:
    its k3 is e - 2, so the batch's token mean is (e - 2) / 6 = 0.11971, not the minibatches' mean (0 + (e - 2) / 2)
    / 2 = 0.17957. Over two epochs the same."""
    from lab import engine
    from support.helpers import combine
    old_logp, mask = torch.zeros(2, 4, dtype=F64), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=F64)
    rollout_logp = old_logp.clone()
    rollout_logp[1, 0] = -1.0
    for epochs in (1, 2):
        updates, micro_batches = [], []
        for _ in range(epochs):
            for row in (0, 1):
                rows = slice(row, row + 1)
                stats = corrections.rollout_correction(old_logp[rows].clone(), old_logp[rows], rollout_logp[rows],
                                                       torch.ones(1, dtype=F64), mask[rows]).stats
                micro_batches.append((mask[rows].sum(), stats))
                updates.append({"loss": torch.tensor(0.0), **combine([(1.0, stats)])})
        step = engine.over_updates(updates, micro_batches)
        assert step["mismatch_k3"].item() == pytest.approx((math.e - 2) / 6, rel=1e-12)


def test_tis_clip_frac_counts_at_the_level_the_weight_is_applied():
    """Token ratios 1.5 and 1.5, cap 2: no token is capped, but the sequence's ratio 2.25 is."""
    old_logp = torch.zeros(1, 2, dtype=F64)
    rollout_logp = old_logp - math.log(1.5)
    for level, capped in (("token", 0.0), ("sequence", 1.0)):
        stats = corrections.rollout_correction(old_logp.clone(), old_logp, rollout_logp, torch.ones(1, dtype=F64),
                                               torch.ones(1, 2), tis_cap=2.0, tis_level=level).stats
        assert stats["tis_clip_frac"].value() == capped


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (4, 1.0), (4, 0.8), (1, 1.0), (0, 0.999)])
def test_sampling_mask_matches_the_transformers_warpers(top_k, top_p):
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = logits[0, 5]  # a tie, kept on both sides of the k-th value
    expected = logits
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(common.sampling_mask(logits, top_k, top_p), expected)


@pytest.mark.parametrize("path", [common, models], ids=["common", "fast"])
def test_token_logprobs_with_top_k_and_top_p_are_the_samplers_processed_scores(path):
    """generate(output_scores=True) returns the scores after temperature, top-k and top-p: the
    distribution each token was drawn from. token_logprobs (the definition and the fast path) must score
    that one, not the full softmax."""
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tok, ["1+2=", "123+456=", "99*9="], "cpu")
    torch.manual_seed(0)
    T, top_k, top_p = 0.8, 6, 0.7
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=T, top_k=top_k,
                         top_p=top_p, max_new_tokens=5, num_return_sequences=4, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, return_dict_in_generate=True, output_scores=True)
    completion = out.sequences[:, prompt_ids.shape[1]:]
    mask = common.completion_mask(completion, tok.eos_token_id).bool()
    sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    sampled = sampled.gather(-1, completion[..., None]).squeeze(-1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(4, 0), mask.long()], 1)
    logp, entropy = path.token_logprobs(model, out.sequences, attention_mask, completion.shape[1], T,
                                        with_entropy=True, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(logp[mask], sampled[mask], atol=1e-4, rtol=0)
    full = path.token_logprobs(model, out.sequences, attention_mask, completion.shape[1], T)
    assert (logp[mask] - full[mask]).max() > 0.05  # the mask matters: renormalising raises each log-prob
    assert torch.isfinite(entropy).all() and (entropy[mask] <= torch.log(torch.tensor(top_k)) + 1e-5).all()


def test_rollout_model_is_a_low_precision_copy_that_follows_the_trainer():
    cfg = grpo.Config(rollout_dtype="bfloat16")
    policy = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    rollout_model = sampling.load_rollout_model(cfg, policy)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in rollout_model.parameters())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    sampling.sync_rollout_model(rollout_model, policy)
    for target, source in zip(rollout_model.parameters(), policy.parameters()):
        assert torch.equal(target, source.detach().to(torch.bfloat16))
    assert sampling.load_rollout_model(grpo.Config(), policy) is None  # float32 = the trainer samples


@pytest.mark.parametrize("kwargs, flag", [
    ({"rollout_dtype": "int8"}, "--rollout_dtype"),
    ({"tis_cap": 2.0}, "--tis_cap"),  # no rollout copy: nothing to correct
    ({"rollout_dtype": "bfloat16", "tis_cap": 0.5}, "--tis_cap"),
    ({"geo_mask_delta": 0.1}, "--geo_mask_delta"),  # on-policy: nothing to mask
    ({"geo_mask_delta": -0.1, "num_epochs": 2}, "--geo_mask_delta"),
    ({"kl_estimator": "k4"}, "--kl_estimator"),
    ({"dual_clip_c": 0.5}, "--dual_clip_c"),
])
def test_bad_stability_flags_raise_a_value_error_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        grpo.Config(**kwargs)
    grpo.Config(geo_mask_delta=0.1, num_epochs=2)  # several updates per batch: off-policy, allowed


STABILITY_FLAGS = ["--rollout_dtype", "bfloat16", "--tis_cap", "2", "--geo_mask_delta", "0.001", "--top_k", "8",
                   "--top_p", "0.95"]


@pytest.mark.parametrize("module, extra", [
    (grpo, ["--num_epochs", "2", "--kl_estimator", "k2", "--kl_is_weight", "True", "--dual_clip_c", "3"]),
    (dapo, ["--dual_clip_c", "3"]),
    (rloo, []),
])
def test_group_methods_run_with_a_bfloat16_sampler_and_log_the_mismatch(module, extra, tmp_path, monkeypatch):
    name = module.__name__.replace(".", "/")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--num_steps", "1", "--batch_size", "16", "--num_generations", "4",
                                      *STABILITY_FLAGS, *extra, "--save_model", "False", "--output_dir", str(tmp_path)])
    module.main()
    row = read_metrics(tmp_path / "metrics.jsonl")[1]
    # a real mismatch: bf16 weights give other log-probs than the fp32 trainer's, in both directions
    assert 0 < row["train/mismatch_k3"] < 0.05
    assert row["train/mismatch_ratio_min"] < 1 < row["train/mismatch_ratio_max"]
    assert 0 <= row["train/tis_clip_frac"] <= 1 and 0 <= row["train/geo_masked_frac"] <= 1


def test_stability_benchmark_smoke_run_writes_the_table(tmp_path):
    """bench/stability.py, which makes docs/stability.md's tables: one step, one seed; the float32 run logs no
    mismatch metrics (the trainer samples) and its row reads 0 and 1."""
    import json
    import os
    import subprocess

    from conftest import ROOT

    cmd = [sys.executable, "bench/stability.py", "--steps", "1", "--seeds", "0", "--variants", "float32",
           "bfloat16", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| bfloat16 | 0.416 → " in (tmp_path / "results.md").read_text()
    results = json.loads((tmp_path / "results.json").read_text())
    (run,) = results["bfloat16"]
    assert run["k3"] > 0 and run["ratio_min"] < 1 < run["ratio_max"]
    (run,) = results["float32"]
    assert (run["k3"], run["ratio_min"], run["ratio_max"], run["tis_clip"], run["masked"]) == (0, 1, 1, 0, 0)
