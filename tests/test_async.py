"""--async_rollouts K (docs/async.md): a sampler process runs at most K optimizer steps ahead of the learner, its
own scoring pass gives the behaviour log-probs, and neither process outlives the other."""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import dapo
import grpo
import ppo
import remax
import rloo
from conftest import ROOT
from support import async_sampling
from support.run import read_metrics

FLAGS = ["--batch_size", "32", "--num_generations", "4", "--learning_rate", "1e-3", "--eval_every", "100",
         "--save_model", "False"]


def run(out_dir, *flags, steps=4):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["grpo.py", "--num_steps", str(steps), *FLAGS, *flags, "--output_dir", str(out_dir)])
        grpo.main()
    return read_metrics(out_dir / "metrics.jsonl")[1:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    return {"sync": run(out / "sync", steps=1), "K=1": run(out / "k1", "--async_rollouts", "1"),
            "K=2": run(out / "k2", "--async_rollouts", "2", "--tis_cap", "2", "--m2po_tau", "0.04")}


def test_the_first_batch_is_the_synchronous_runs_and_the_sampler_scores_it_as_the_learner_does(runs):
    """Step 1: the sampler holds the initial weights and the learner's seed: the same completions, the same update,
    and its own scoring pass gives exactly the learner's log-probs."""
    for key in ("train/reward", "train/loss", "train/grad_norm"):
        assert runs["K=1"][0][key] == runs["sync"][0][key], key
    assert runs["K=1"][0]["train/mismatch_k3"] == 0
    assert runs["K=1"][0]["train/mismatch_ratio_min"] == runs["K=1"][0]["train/mismatch_ratio_max"] == 1


@pytest.mark.parametrize("k", [1, 2])
def test_the_sampler_runs_at_most_k_steps_ahead_and_its_staleness_shows_in_the_mismatch(runs, k):
    rows = runs[f"K={k}"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["train/staleness_max"] == 0
    # K = 1: the batch of step t is sampled while step t - 1 trains, with the weights after step t - 2
    assert all(1 <= r["train/staleness_mean"] == r["train/staleness_max"] <= k for r in rows[1:])
    assert all(r["train/mismatch_k3"] > 0 and r["train/mismatch_ratio_min"] < 1 < r["train/mismatch_ratio_max"]
               for r in rows[1:])
    # the tokens the sampler process decoded, counted on the learner's side: each completion's, up to its EOS
    assert all(r["train/decoded_per_completion"] == pytest.approx(r["train/completion_len"], rel=1e-6) for r in rows)
    if k == 2:  # the corrections act on the sampler process's log-probs
        assert max(r["train/m2po_masked_frac"] for r in rows) > 0 and rows[0]["train/m2po_masked_frac"] == 0


def test_rloo_takes_its_rollouts_from_the_sampler_process_too(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rloo.py", "--num_steps", "3", *FLAGS, "--async_rollouts", "1", "--m2po_tau",
                                      "0.04", "--output_dir", str(tmp_path)])
    rloo.main()
    rows = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert [r["train/staleness_max"] for r in rows] == [0, 1, 1] and rows[0]["train/mismatch_k3"] == 0
    assert all("train/m2po_masked_frac" in r for r in rows)


@pytest.mark.parametrize("module", [dapo, remax, ppo])
def test_a_script_whose_loop_the_sampler_process_does_not_serve_refuses_the_flag(module):
    with pytest.raises(ValueError, match="--async_rollouts"):
        module.Config(async_rollouts=1)
    rloo.Config(async_rollouts=1, tis_cap=2.0)  # one rollout per step, as GRPO: served; a stale sampler: TIS allowed


@pytest.mark.parametrize("flags, what", [
    ({"lora_r": 4}, "--lora_r"),
    ({"rollout_lag": 2}, "--rollout_lag"),
    ({"budget": "knapsack"}, "--budget"),
    ({"sampler": "tree"}, "--sampler"),
    ({}, "DDP"),
])
def test_what_the_sampler_process_does_not_support_is_refused_in_one_line_before_any_model_loads(flags, what):
    accelerator = SimpleNamespace(num_processes=2 if what == "DDP" else 1, state=SimpleNamespace(deepspeed_plugin=None))
    with pytest.raises(SystemExit, match=f"--async_rollouts does not run with .*{what}"):
        async_sampling.check(grpo.Config(async_rollouts=1, **flags), accelerator)


def start(tmp_path):
    """grpo.py --async_rollouts 1 in a process of its own, once its sampler has sent a batch: (learner, sampler pid)."""
    learner = subprocess.Popen([sys.executable, "grpo.py", "--async_rollouts", "1", "--num_steps", "100000",
                                "--batch_size", "8", "--num_generations", "2", "--eval_every", "100000",
                                "--save_model", "False", "--output_dir", str(tmp_path)], cwd=ROOT, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    while not (tmp_path / "metrics.jsonl").exists() or len(read_metrics(tmp_path / "metrics.jsonl")) < 3:
        assert learner.poll() is None and time.time() < deadline, learner.stderr.read()[-2000:]
        time.sleep(0.2)
    children = open(f"/proc/{learner.pid}/task/{learner.pid}/children").read().split()
    samplers = [int(pid) for pid in children if "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]
    assert len(samplers) == 1, children
    return learner, samplers[0]


def gone(pid):
    """The process has exited (or is a zombie its new parent has not reaped)."""
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_a_sampler_that_dies_stops_the_learner_with_one_line_naming_the_cause(tmp_path):
    learner, sampler = start(tmp_path)
    os.kill(sampler, signal.SIGKILL)
    _, stderr = learner.communicate(timeout=60)
    assert learner.returncode == 1
    assert stderr.strip().splitlines()[-1] == "error: the sampler process died (exit code -9) before sending its batch."


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_a_learner_killed_with_sigkill_leaves_no_sampler_behind(tmp_path):
    learner, sampler = start(tmp_path)
    learner.kill()
    learner.wait(timeout=10)
    deadline = time.time() + 10
    while not gone(sampler):
        assert time.time() < deadline, "the sampler outlived its learner by 10 s"
        time.sleep(0.05)


def test_async_benchmark_smoke_run_writes_one_row_per_variant(tmp_path):
    """bench/async.py, which makes docs/async.md's table: 2 steps, one seed."""
    cmd = [sys.executable, "bench/async.py", "--steps", "2", "--seeds", "0", "--variants", "synchronous", "K = 1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| sampling", "| synchronous", "| K = 1"]
    assert rows[1].split(" | ")[3] == "1.00×"  # the first row is the reference of the speed-up
    (sync,), (k1,) = json.loads((tmp_path / "results.json").read_text()).values()
    assert sync["staleness"] == 0 and k1["staleness"] == 1  # step 2: sampled while step 1 trained
    assert 0 <= k1["after"] <= 1 and k1["step_s"] > 0
