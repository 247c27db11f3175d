"""--async_rollouts K (docs/async.md): a sampler process runs at most K optimizer steps ahead of the learner, the
log-probs of its draws are the behaviour log-probs, it scores the reference, and neither process outlives the
other."""
import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, launch_two_processes
from lab import dapo, grpo, ppo, remax, rloo  # the lab's loops: --async_rollouts is theirs
from lab import async_sampling
from support.run import read_metrics

FLAGS = ["--batch_size", "32", "--num_generations", "4", "--learning_rate", "1e-3", "--eval_every", "100",
         "--save_model", "False"]


def run(out_dir, *flags, steps=4):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["lab/grpo.py", "--num_steps", str(steps), *FLAGS, *flags, "--output_dir", str(out_dir)])
        grpo.main()
    return read_metrics(out_dir / "metrics.jsonl")[1:]


def assert_at_most_one_step_stale(rows):
    """K = 1: step 1's batch is the initial weights'; every later batch at most one step stale, and the sampler ran
    ahead at least once (a batch sampled while the learner trained on the one before it, its tokens' log-probs then
    off the learner's). A batch may be 0 steps stale: a sampler process the machine scheduled late picks up the
    request after the learner published, and samples with the newest weights, as it should."""
    staleness = [r["train/staleness_max"] for r in rows]
    assert staleness[0] == 0 and rows[0]["train/mismatch_k3"] < 1e-10
    assert set(staleness[1:]) <= {0, 1} and 1 in staleness[1:], staleness
    assert all(r["train/mismatch_k3"] > 0 for r in rows[1:] if r["train/staleness_max"] == 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    return {"sync": run(out / "sync", steps=1), "K=1": run(out / "k1", "--async_rollouts", "1"),
            "K=2": run(out / "k2", "--async_rollouts", "2", "--tis_cap", "2", "--m2po_tau", "0.04")}


def test_the_first_batch_is_the_synchronous_runs_and_the_sampler_scores_it_as_the_learner_does(runs):
    """Step 1: the sampler holds the initial weights and the learner's seed: the same completions, the same update
    (the reference's log-probs, scored in the sampler process, as the learner's own: the same KL), and the log-probs
    of its draws are the learner's scoring of them to rounding (models.generate's, tests/test_fast.py: 1e-5)."""
    for key in ("train/reward", "train/loss", "train/grad_norm", "train/kl_k3"):
        assert runs["K=1"][0][key] == runs["sync"][0][key], key
    assert runs["K=1"][0]["train/mismatch_k3"] < 1e-10
    assert runs["K=1"][0]["train/mismatch_ratio_min"] == pytest.approx(1, abs=1e-5)
    assert runs["K=1"][0]["train/mismatch_ratio_max"] == pytest.approx(1, abs=1e-5)


def test_the_reference_log_probs_from_the_sampler_process_are_the_learners_scoring(tmp_path, monkeypatch):
    """With a KL term the learner holds no reference: the sampler process scores each batch with it. At every step
    its log-probs equal those of a reference loaded in the learner scoring the same rollout (observed: equal)."""
    from support import models
    from lab import engine
    reference_logprobs, differences = engine.Trainer.reference_logprobs, []

    def checked(trainer, ref_model, rollout):
        assert ref_model is None and rollout.ref_logp is not None
        mine = trainer._logprobs(models.load_model(trainer.cfg, trainable=False), rollout, False)
        differences.append(float((mine - rollout.ref_logp)[rollout.mask.bool()].abs().max()))
        return reference_logprobs(trainer, ref_model, rollout)
    monkeypatch.setattr(engine.Trainer, "reference_logprobs", checked)
    rows = run(tmp_path, "--async_rollouts", "1", steps=3)
    assert len(differences) == 3 and max(differences) <= 1e-6
    assert rows[-1]["train/kl_k3"] > 0  # the policy has moved from the reference


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
    monkeypatch.setattr(sys, "argv", ["lab/rloo.py", "--num_steps", "3", *FLAGS, "--async_rollouts", "1", "--m2po_tau",
                                      "0.04", "--output_dir", str(tmp_path)])
    rloo.main()
    rows = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert_at_most_one_step_stale(rows)
    assert all("train/m2po_masked_frac" in r for r in rows)


@pytest.mark.parametrize("module, flags", [
    (dapo, ["--batch_size", "32", "--num_generations", "4"]),
    (remax, ["--batch_size", "16", "--tis_cap", "2"]),
    (ppo, ["--batch_size", "16", "--num_epochs", "1", "--num_mini_batches", "2", "--m2po_tau", "0.04"]),
])
def test_every_loop_takes_its_rollouts_from_the_sampler_process_at_most_k_steps_stale(tmp_path, monkeypatch, module,
                                                                                       flags):
    """DAPO asks for a batch per round of dynamic sampling, ReMax's batches carry the greedy completions decoded with
    the same weights, PPO's critic stays in the learner; the sampler's log-probs are the behaviour policy."""
    monkeypatch.setattr(sys, "argv", [module.__name__.replace(".", "/") + ".py", "--num_steps", "3", "--learning_rate", "1e-3",
                                      "--eval_every", "100", "--save_model", "False", "--async_rollouts", "1", *flags,
                                      "--output_dir", str(tmp_path)])
    module.main()
    rows = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert_at_most_one_step_stale(rows)
    if module is remax:  # the greedy decode came from the sampler process too, and its reward is the baseline
        assert all("train/greedy_reward" in r and r["train/tis_clip_frac"] >= 0 for r in rows)
    if module is dapo:  # as many rounds as dynamic sampling needed, each batch's version bounded
        assert all(r["train/sampling_rounds"] >= 1 for r in rows)


def test_under_lora_the_learner_publishes_only_the_adapters_and_the_reference_is_the_samplers_base(
        tmp_path, monkeypatch):
    """--lora_r: the sampler process builds the same adapter and receives only its weights after each step (fewer
    than a tenth of the model's here); its reference is its own policy with the adapter off, as the learner's
    would be. Step 1 is the synchronous LoRA run's (the sampler seeds after its adapter's random init): the same
    completions, reward, loss and gradient."""
    from support import models
    published, publish = [], async_sampling.AsyncRolloutSampler.publish
    monkeypatch.setattr(async_sampling.AsyncRolloutSampler, "publish", lambda self, version: published.append(
        (self.names, sum(w.numel() for w in self.weights))) or publish(self, version))
    lora = ["--lora_r", "4", "--learning_rate", "1e-2"]
    sync = run(tmp_path / "sync", *lora, steps=1)
    rows = run(tmp_path / "async", *lora, "--async_rollouts", "1", steps=3)
    names, size = published[0]
    assert names and all(".lora_" in name for name in names) and len(published) == 3  # versions 0, 1, 2
    assert size < models.load_model(grpo.Config(), trainable=False).num_parameters() / 10
    for key in ("train/reward", "train/completion_len", "train/loss", "train/grad_norm"):
        assert rows[0][key] == sync[0][key], key
    assert_at_most_one_step_stale(rows)
    assert rows[-1]["train/kl_k3"] > 0


@pytest.mark.parametrize("flags, what", [
    ({"rollout_lag": 2}, "--rollout_lag"),
    ({"budget": "knapsack"}, "--budget"),
    ({"sampler": "tree"}, "--sampler"),
])
def test_what_the_sampler_process_does_not_support_is_refused_in_one_line_before_any_model_loads(flags, what):
    with pytest.raises(SystemExit, match=f"--async_rollouts does not run with .*{what}"):
        async_sampling.check(grpo.Config(async_rollouts=1, **flags))


REWARDS = """import os


def length(completions, **kwargs):
    with open(os.path.join(os.path.dirname(__file__), "pids"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return [len(c) / 10 for c in completions]


def broken(completions, **kwargs):
    raise ValueError("no reward today")
"""


def test_the_sampler_process_computes_the_rewards_with_the_learners_reward_function(tmp_path):
    """The rule reward and a --reward_fn function run in the sampler process, beside its sampling (their seconds:
    time/sampler_reward_s), and the learner trains on what it sends; a reward that fails there stops the learner
    with the one line the learner's own reward would print."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = run(tmp_path / "run", "--async_rollouts", "1", "--reward_fn", f"{tmp_path}/rewards.py:length", steps=2)
    calls = collections.Counter((tmp_path / "pids").read_text().split())
    assert calls.pop(str(os.getpid())) == 1  # the learner's trial call, before any model loads
    assert list(calls.values()) == [2]  # a batch per step, rewarded in the sampler process
    assert all(r["train/reward/length"] > 0 and r["time/sampler_reward_s"] > 0 for r in rows)
    with pytest.raises(SystemExit) as stopped:
        run(tmp_path / "broken", "--async_rollouts", "1", "--reward_fn", f"{tmp_path}/rewards.py:broken", steps=2)
    assert str(stopped.value.code).startswith("error: --reward_fn broken raised ValueError: no reward today on ")


def processes_marked(mark):
    """The live processes (not zombies) whose environment holds ASYNC_TEST_MARK=mark: a run's and its children's."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            marked = f"ASYNC_TEST_MARK={mark}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if marked and int(pid) != os.getpid() and not gone(pid):
            found.append(int(pid))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
@pytest.mark.parametrize("script", ["lab/grpo.py", "lab/dapo.py"])
def test_under_ddp_each_rank_has_its_own_sampler_process_and_none_outlives_the_run(tmp_path, monkeypatch, script):
    """Two learner processes (gloo), each with a sampler process of its own: the replicas stay identical, every rank
    takes as many batches per step (DAPO: as many rounds), each at most K steps stale, and no process is left."""
    monkeypatch.setenv("ASYNC_TEST_MARK", str(tmp_path))
    launch_two_processes(script, ["--num_steps", "3", "--batch_size", "8", "--num_generations", "4", "--eval_every",
                                  "100", "--async_rollouts", "1"], tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert_at_most_one_step_stale(rows)
    deadline = time.time() + 10
    while left := processes_marked(tmp_path):
        assert time.time() < deadline, [open(f"/proc/{pid}/cmdline").read() for pid in left]
        time.sleep(0.05)


def test_a_resumed_run_trains_on_the_prompts_of_the_run_it_continues_from_the_checkpoints_weights(tmp_path,
                                                                                                   monkeypatch):
    """--resume_from: the batches asked for ahead are not in the checkpoint, but the prompt sampler's state before
    them is, so the resumed run draws them again: steps 3 and 4 train on the prompts of an uninterrupted run's, in
    order. Its sampler process starts from the checkpoint's weights: its first batch has their version (staleness
    0)."""
    from lab import engine
    taken, rollout = collections.defaultdict(list), engine.Trainer.rollout

    def recorded(trainer, prompts, greedy=False):
        out = rollout(trainer, prompts, greedy)
        taken[trainer.cfg.output_dir].append(out.prompts)
        return out
    monkeypatch.setattr(engine.Trainer, "rollout", recorded)
    run(tmp_path / "whole", "--async_rollouts", "2", "--save_steps", "2", steps=4)  # saved with batches 3, 4 ahead
    run(tmp_path / "resumed", "--async_rollouts", "2", "--resume_from", str(tmp_path / "whole/checkpoint-2"), steps=4)
    whole, resumed = taken[str(tmp_path / "whole")], taken[str(tmp_path / "resumed")]
    assert len(whole) == 4 and len(resumed) == 2 and whole[2] != whole[3]
    assert resumed == whole[2:]
    rows = [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "train/staleness_max" in r]
    assert [(r["step"], r["train/staleness_max"]) for r in rows] == [(3, 0), (4, 1)]


def sampling_that_fails(*args):
    """The sampler process's target in the next test: serve, with a sampling that raises."""
    from lab import decode

    def broken(*_, **__):
        raise RuntimeError("the sampling broke")
    decode.generate = broken  # serve reads it when it starts
    async_sampling.serve(*args)


def test_an_exception_in_the_sampler_process_stops_the_learner_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(async_sampling, "serve", sampling_that_fails)
    with pytest.raises(SystemExit) as stopped:
        run(tmp_path, "--async_rollouts", "1", steps=2)
    assert stopped.value.code == "error: the sampler process failed: RuntimeError: the sampling broke (in broken)"


def start(tmp_path, **popen):
    """grpo.py --async_rollouts 1 in a process of its own, once its sampler has sent a batch: (learner, sampler pid)."""
    learner = subprocess.Popen([sys.executable, "lab/grpo.py", "--async_rollouts", "1", "--num_steps", "100000",
                                "--batch_size", "8", "--num_generations", "2", "--eval_every", "100000",
                                "--save_model", "False", "--output_dir", str(tmp_path)], cwd=ROOT, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)
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


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_ctrl_c_saves_a_checkpoint_ends_the_learner_and_leaves_no_sampler_behind(tmp_path):
    """Ctrl-C in a terminal signals the whole process group: the sampler ignores it, the learner saves and ends."""
    learner, sampler = start(tmp_path, start_new_session=True)
    os.killpg(learner.pid, signal.SIGINT)
    _, stderr = learner.communicate(timeout=120)
    assert learner.returncode == 0, stderr[-2000:]
    assert list(tmp_path.glob("checkpoint-*/trainer_state.json"))
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


def test_async_gpu_benchmark_runs_its_code_path_on_cpu_with_a_tiny_model(tmp_path):
    """bench/async_gpu.py, which a single-GPU machine runs (synchronous against K = 1 on a 0.5B-shaped model): here
    --allow_cpu, a 2-layer model of the same family, 2 steps each."""
    out = (tmp_path / "async_gpu").with_suffix(".md")
    cmd = [sys.executable, "bench/async_gpu.py", "--allow_cpu", "--steps", "2", "--batch_size", "4",
           "--max_new_tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split(" | ")[0] for line in out.read_text().splitlines() if line.startswith("| ")][1:] == [
        "| synchronous", "| K = 1"]
    sync, k1 = json.loads(out.with_suffix(".json").read_text())
    assert sync["staleness"] == 0 and k1["staleness"] == 1 and k1["sampler_s"] > 0 and sync["timed_steps"] == 1
