"""Checkpoints: atomic writes that survive kill -9, retention (--save_total_limit), --resume_from
latest, what a checkpoint records and the resumes it refuses, files damaged after they were written,
non-finite weights and logits, and fp16 loss-scale overflows."""
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from lab import config as lab_config
from lab.checkpointer import MAX_SKIPPED_STEPS, Checkpointer
from support import config, models, run, tasks
from conftest import ROOT, free_port, run_main

CHAOS_ARGS = ["--num_steps", "6", "--batch_size", "2", "--max_new_tokens", "4", "--eval_every", "100000",
              "--save_steps", "1", "--save_model", "False"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SLOW_CHECKPOINTS = str(ROOT / "tests" / "slow_checkpoints.py")


def config_class(script):
    """The lab's Config of a script (lab/<script>.py): the one the runs below are launched with."""
    return importlib.import_module(f"lab.{script}").Config


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def progressed(path, since, step):
    """metrics.jsonl, rewritten after `since` (a resumed run drops the rows past its checkpoint),
    has a row after `step`."""
    try:
        return os.stat(path).st_mtime > since and max(r["step"] for r in run.read_metrics(path)) > step
    except (OSError, ValueError):
        return False


@contextmanager
def uninterrupted(cmd):
    """Runs cmd to the end while the block runs, and checks that it succeeded."""
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe nobody reads while the block runs
        with subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err) as proc:
            yield
        err.seek(0)
        assert proc.returncode == 0, err.read()[-3000:]


def chaos(cmd, out_dir, kills, seed):
    """Run cmd + --resume_from latest `kills` times, each SIGKILLed (the whole process group: every
    rank at once), then once to the end. cmd runs the script through tests/slow_checkpoints.py, which
    holds every checkpoint write open for half a second: the first kill lands inside a write (a seeded
    0-250 ms after a tmp-checkpoint-N folder appears), the others at a seeded random moment after
    the run has logged a step of its own. Returns how many partial folders each kill left."""
    rng, partial_left = random.Random(seed), []
    for kill in range(kills):
        latest = run.list_checkpoints(out_dir)[0]
        resumed_at = run.checkpoint_step(latest[-1]) if latest else -1
        err_file = open(out_dir.parent / "killed.err", "w+")  # a file, not a pipe nobody reads while it runs
        proc = subprocess.Popen(cmd + ["--resume_from", "latest"], cwd=ROOT, env=ENV, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err_file)
        started, deadline = time.time(), time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if run.list_checkpoints(out_dir)[1] if kill == 0 else progressed(out_dir / "metrics.jsonl", started,
                                                                             resumed_at):
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.25) if kill == 0 else rng.uniform(0.0, 0.8))  # a step + save: ~0.8 s
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        err_file.seek(0)
        err = err_file.read()
        err_file.close()
        assert "Traceback" not in err, err[-3000:]
        partial_left.append(len(run.list_checkpoints(out_dir)[1]))
    last = subprocess.run(cmd + ["--resume_from", "latest"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert last.returncode == 0, last.stderr[-3000:]
    return partial_left


def test_runs_killed_at_random_moments_resume_to_the_uninterrupted_metrics(tmp_path):
    cmd = [sys.executable, "lab/remax.py", *CHAOS_ARGS]
    with uninterrupted(cmd + ["--output_dir", str(tmp_path / "full")]):  # runs beside the killed ones
        slow = [sys.executable, SLOW_CHECKPOINTS, "lab/remax.py", *CHAOS_ARGS]
        partial_left = chaos(slow + ["--output_dir", str(tmp_path / "chaos")], tmp_path / "chaos", kills=3, seed=0)
    assert partial_left[0] >= 1  # the kill inside a save left a tmp-checkpoint-N that the resume skipped
    expected = comparable(run.read_metrics(tmp_path / "full" / "metrics.jsonl"))
    assert [r["step"] for r in expected] == list(range(7))
    assert comparable(run.read_metrics(tmp_path / "chaos" / "metrics.jsonl")) == expected
    # --save_total_limit 2 (the default) and no partial folder left behind
    assert sorted(p.name for p in (tmp_path / "chaos").iterdir() if "checkpoint" in p.name) == \
        ["checkpoint-5", "checkpoint-6"]


def test_two_process_run_killed_and_resumed_matches_the_uninterrupted_one(tmp_path):
    def launch(out_dir, *script):
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--main_process_port", str(free_port()), *script, *CHAOS_ARGS, "--num_steps", "3",
                "--output_dir", str(out_dir)]

    with uninterrupted(launch(tmp_path / "full", "lab/remax.py")):
        assert chaos(launch(tmp_path / "chaos", SLOW_CHECKPOINTS, "lab/remax.py"), tmp_path / "chaos", kills=1, seed=1)[0] >= 1
    expected = comparable(run.read_metrics(tmp_path / "full" / "metrics.jsonl"))
    assert [r["step"] for r in expected] == list(range(4))
    assert comparable(run.read_metrics(tmp_path / "chaos" / "metrics.jsonl")) == expected
    ckpt = tmp_path / "chaos" / "checkpoint-3"
    for name in ("sampler_rank0.json", "sampler_rank1.json", "random_states_0.pkl", "random_states_1.pkl"):
        assert (ckpt / name).exists(), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["script"], state["world_size"], state["config"]["batch_size"]) == ("lab/remax.py", 2, 2)
    summary = json.loads((tmp_path / "chaos" / "summary.json").read_text())
    assert summary["num_processes"] == 2 and len(set(summary["replica_weight_checksums"])) == 1


def in_process(capsys, script, *args):
    """`python script args` as this process's call of the script's main() (sys.argv patched): its exit status,
    stdout and stderr as a CompletedProcess would hold them (a SystemExit with a message: status 1, the message
    as stderr's last line, as Python prints it). An exception other than SystemExit fails the test with its
    traceback. The runs here need no process of their own: one cost ~13 s of start-up against ~2 s of run."""
    capsys.readouterr()
    code = 0
    try:
        run_main([script, *args])
    except SystemExit as stopped:
        code = stopped.code
    out, err = capsys.readouterr()
    if isinstance(code, str):
        code, err = 1, err + code + "\n"
    return subprocess.CompletedProcess([script, *args], code or 0, out, err)


@pytest.fixture(scope="module")
def parts():
    """A CPU accelerator with the embedded policy prepared, its tokenizer and a prompt sampler."""
    from accelerate import Accelerator

    cfg = lab_config.LabConfig()
    accelerator = Accelerator(cpu=True)
    policy = accelerator.prepare(models.load_model(cfg))
    sampler = tasks.PromptSampler([{"prompt": "12+3="}, {"prompt": "7*8="}], 1, 0)
    return accelerator, policy, models.load_tokenizer(cfg), sampler


def checkpointer(parts, out_dir, **flags):
    accelerator, policy, tokenizer, sampler = parts
    return Checkpointer(lab_config.LabConfig(output_dir=str(out_dir), **flags), accelerator, sampler)


def test_retention_keeps_the_newest_complete_checkpoints_and_latest_skips_partial_ones(parts, tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    _, policy, tokenizer, _ = parts
    ckpt = checkpointer(parts, tmp_path, save_total_limit=2)
    for step in (1, 2, 3):
        ckpt.save(step, policy, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    (tmp_path / "tmp-checkpoint-4").mkdir()  # killed while writing step 4
    (tmp_path / "checkpoint-5").mkdir()  # killed while replacing checkpoint-5: no trainer_state.json
    cfg = config.parse_config(config_class("remax"), ["--output_dir", str(tmp_path), "--resume_from", "latest"])
    assert run.find_checkpoint(cfg, world_size=1) == (str(tmp_path / "checkpoint-3"), None)
    err = capsys.readouterr().err
    assert "warning: ignoring partial checkpoints" in err and "tmp-checkpoint-4" in err and "checkpoint-5" in err
    ckpt.save(4, policy, tokenizer)  # deletes the partial folders and checkpoint-2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    keep_all = checkpointer(parts, tmp_path, save_total_limit=0)
    keep_all.save(5, policy, tokenizer)
    keep_all.save(6, policy, tokenizer)
    assert len(run.list_checkpoints(tmp_path)[0]) == 4


def test_resume_latest_without_a_checkpoint_starts_at_step_zero(tmp_path, capsys):
    cfg = config.parse_config(config_class("remax"), ["--output_dir", str(tmp_path), "--resume_from", "latest"])
    assert run.find_checkpoint(cfg, world_size=1, script="remax.py") == ("", None)
    assert "starting at step 0" in capsys.readouterr().err


def write_checkpoint(out_dir, script, cfg, world_size=1, step=3):
    """A checkpoint folder with only the trainer_state.json Checkpointer.save writes (which records no
    other file): enough for the checks of find_checkpoint."""
    path = out_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps(run.trainer_state(cfg, step, world_size, script)))
    return path


def test_resume_refuses_another_scripts_checkpoint(tmp_path, monkeypatch):
    grpo_cfg = config.parse_config(config_class("grpo"), ["--output_dir", str(tmp_path / "g")])
    path = write_checkpoint(tmp_path / "g", "grpo.py", grpo_cfg)
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    cfg = config.parse_config(config_class("ppo"), ["--output_dir", str(tmp_path / "p"), "--resume_from", str(path)])
    _, error = run.find_checkpoint(cfg, world_size=1)
    assert error.startswith("error: --resume_from") and "written by grpo.py, not ppo.py" in error


def test_resume_refuses_step_changing_flags_and_notes_harmless_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    Config = config_class("grpo")
    path = write_checkpoint(tmp_path, "grpo.py", config.parse_config(Config, ["--output_dir", str(tmp_path)]))
    cfg = config.parse_config(Config, ["--output_dir", str(tmp_path / "new"), "--resume_from", str(path),
                                       "--num_generations", "4", "--learning_rate", "1e-5"])
    _, error = run.find_checkpoint(cfg, world_size=1)
    assert "--num_generations (8 there, 4 here)" in error and "--learning_rate" in error
    assert "--num_steps" not in error
    cfg = config.parse_config(Config, ["--output_dir", str(tmp_path), "--resume_from", "latest", "--num_steps", "900",
                                       "--save_steps", "10"])
    assert run.find_checkpoint(cfg, world_size=1) == (str(path), None)
    assert "note: resuming" in capsys.readouterr().err


def test_resume_with_another_world_size_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    Config = config_class("remax")
    path = write_checkpoint(tmp_path, "remax.py", config.parse_config(Config, ["--output_dir", str(tmp_path)]),
                            world_size=2)
    cfg = config.parse_config(Config, ["--output_dir", str(tmp_path), "--resume_from", str(path)])
    _, error = run.find_checkpoint(cfg, world_size=1)
    assert "written by 2 processes and this run has 1: launch it with --num_processes 2" in error


def test_output_dir_with_checkpoints_or_another_scripts_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    Config = config_class("remax")
    write_checkpoint(tmp_path, "remax.py", config.parse_config(Config, ["--output_dir", str(tmp_path)]))
    _, error = run.find_checkpoint(config.parse_config(Config, ["--output_dir", str(tmp_path)]), world_size=1)
    assert error.startswith("error: --output_dir")
    assert "holds checkpoints of an earlier run (newest checkpoint-3)" in error
    monkeypatch.setattr(sys, "argv", ["rloo.py"])
    cfg = config.parse_config(config_class("rloo"), ["--output_dir", str(tmp_path), "--resume_from", "latest"])
    assert "written by remax.py, not rloo.py" in run.find_checkpoint(cfg, world_size=1)[1]


def test_a_run_without_checkpoints_is_written_over_by_its_script_only(parts, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    cfg = config.parse_config(config_class("remax"), ["--output_dir", str(tmp_path)])
    run.MetricLogger(cfg, parts[0]).log(0, {"eval/accuracy": 0.5})  # writes config.json naming remax.py
    assert config.parse_config(config_class("remax"), ["--output_dir", str(tmp_path)]).output_dir == str(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    with pytest.raises(SystemExit, match="error: --output_dir .* holds a run of remax.py: give grpo.py another"):
        config.parse_config(config_class("grpo"), ["--output_dir", str(tmp_path)])


def test_unwritable_output_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # tests may run as root, who can write anywhere
    with pytest.raises(SystemExit, match="error: --output_dir .* is not writable"):
        config.parse_config(config_class("remax"), ["--output_dir", str(tmp_path / "run")])


def test_fp16_overflow_skips_steps_and_stops_after_max_skipped_steps(parts, tmp_path, monkeypatch):
    """With a GradScaler an inf gradient norm is a skipped step (optimizer.step() skips it and lowers
    the scale); MAX_SKIPPED_STEPS in a row stop the run, a finite step in between resets the count."""
    accelerator, policy, tokenizer, _ = parts
    monkeypatch.setattr(accelerator, "scaler", torch.amp.GradScaler("cpu"))
    ckpt = checkpointer(parts, tmp_path)
    loss, inf, limit = torch.tensor(0.5), torch.tensor(float("inf")), MAX_SKIPPED_STEPS
    for step in range(1, limit):
        ckpt.check_finite(step, loss, inf, policy, tokenizer)
    ckpt.check_finite(limit, loss, torch.tensor(1.0), policy, tokenizer)
    for step in range(limit + 1, 2 * limit):
        ckpt.check_finite(step, loss, inf, policy, tokenizer)
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit, match=f"error: {limit} steps in a row .* overflowed the fp16"):
        ckpt.check_finite(2 * limit, loss, inf, policy, tokenizer)
    assert (tmp_path / f"checkpoint-{2 * limit - 1}" / "trainer_state.json").exists()
    with pytest.raises(SystemExit, match="non-finite loss"):  # a NaN loss is no overflow: it stops at once
        checkpointer(parts, tmp_path).check_finite(3, torch.tensor(float("nan")), inf, policy, tokenizer)


def test_non_finite_logits_after_an_update_stop_and_name_the_last_good_checkpoint(parts, tmp_path):
    accelerator, policy, tokenizer, _ = parts
    ckpt = checkpointer(parts, tmp_path, save_steps=1)
    assert ckpt.step_end(1, policy, tokenizer) is False
    assert (tmp_path / "checkpoint-1").exists()
    with broken_weights(accelerator.unwrap_model(policy)):
        with pytest.raises(SystemExit, match="step 2 made the policy's weights or logits non-finite.*checkpoint-1"):
            ckpt.step_end(2, policy, tokenizer)
    assert not (tmp_path / "checkpoint-2").exists()  # the broken weights are not saved


@contextmanager
def broken_weights(model):
    """The embedded policy's weights as an update with a huge learning rate can leave them, inside the block:
    every one finite, yet the MLP's activations overflow float32 (gate * up ~ 1e40) and the logits are NaN."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        mlp = model.model.layers[0].mlp
        mlp.gate_proj.weight.mul_(1e20)
        mlp.up_proj.weight.mul_(1e20)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    try:
        yield
    finally:
        model.load_state_dict(saved)


@contextmanager
def counted_forwards(model):
    """The list that gets one entry per forward call of the model inside the block."""
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_weights_are_checked_only_before_a_save(parts, tmp_path):
    """The probe (a forward pass over a training prompt) runs at the steps a checkpoint follows, and at the
    last step (the final model follows); at the others step_end runs no forward pass and saves nothing.
    Broken weights are then found by the next sampling or the next loss."""
    accelerator, policy, tokenizer, _ = parts
    model = accelerator.unwrap_model(policy)
    ckpt = checkpointer(parts, tmp_path, save_steps=2, num_steps=5)
    with counted_forwards(model) as forwards:
        assert ckpt.step_end(1, policy, tokenizer) is False
        assert forwards == [] and not list(tmp_path.iterdir())
        assert ckpt.step_end(2, policy, tokenizer) is False
        assert len(forwards) == 1 and (tmp_path / "checkpoint-2").exists()
        with broken_weights(model):  # between saves nothing looks at the weights
            assert ckpt.step_end(3, policy, tokenizer) is False
        assert len(forwards) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
        assert ckpt.step_end(5, policy, tokenizer) is False  # the last step: checked, no checkpoint
        assert len(forwards) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_broken_weights_at_the_last_step_stop_the_run_before_the_final_model(parts, tmp_path):
    """No checkpoint is due at the last step, yet the final model follows it: broken weights stop the run
    there (the final model is never written) and nothing is saved."""
    accelerator, policy, tokenizer, _ = parts
    ckpt = checkpointer(parts, tmp_path, num_steps=3)
    with broken_weights(accelerator.unwrap_model(policy)):
        with pytest.raises(SystemExit, match="step 3 made the policy's weights or logits non-finite.*no checkpoint "
                                             "was saved before it"):
            ckpt.step_end(3, policy, tokenizer)
    assert not list(tmp_path.iterdir())


def test_a_non_finite_loss_after_an_unchecked_broken_update_saves_nothing(parts, tmp_path):
    """A NaN loss at step 4 saves the weights before its update as the last good state, unless the update of
    step 3 (after which no save checked them) broke them: then nothing is saved and the error names the
    newest checkpoint before it, as for broken weights found anywhere else."""
    accelerator, policy, tokenizer, _ = parts
    ckpt = checkpointer(parts, tmp_path, save_steps=2)
    assert ckpt.step_end(2, policy, tokenizer) is False
    assert ckpt.step_end(3, policy, tokenizer) is False
    with broken_weights(accelerator.unwrap_model(policy)):
        with pytest.raises(SystemExit, match="step 3 made the policy's weights or logits non-finite.*checkpoint-2"):
            ckpt.check_finite(4, torch.tensor(float("nan")), torch.tensor(1.0), policy, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    with pytest.raises(SystemExit, match="non-finite loss.*the last good state is in .*checkpoint-3"):
        ckpt.check_finite(4, torch.tensor(float("nan")), torch.tensor(1.0), policy, tokenizer)  # sound weights


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_is_found_even_where_the_probe_logits_stay_finite(parts, bad, monkeypatch):
    """One non-finite entry in one weight, with the probe's forward pass made to return finite logits
    (as it does when the broken entry is one no probe prompt reads): the weight test alone must see it."""
    accelerator, policy, tokenizer, _ = parts
    model = accelerator.unwrap_model(policy)
    weight = model.model.layers[1].mlp.up_proj.weight
    saved = weight.detach().clone()
    monkeypatch.setattr(model, "forward", lambda **kwargs: SimpleNamespace(logits=torch.zeros(1, 1, 3)))
    assert run.finite_weights_and_logits(model, tokenizer, ["12+3="])
    with torch.no_grad():
        weight[5, 7] = bad
    try:
        assert not run.finite_weights_and_logits(model, tokenizer, ["12+3="])
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_a_checkpoint_records_the_size_and_checksum_of_every_file(parts, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    path = checkpointer(parts, tmp_path).save(1, parts[1], parts[2])
    files = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(path)) for p in (tmp_path / "checkpoint-1").rglob("*") if p.is_file())
    assert sorted(files) == [name for name in on_disk if name != "trainer_state.json"]
    assert {"model.safetensors", "model/model.safetensors", "sampler_rank0.json"} <= set(files)
    record = files["model/model.safetensors"]
    assert record["bytes"] == os.path.getsize(os.path.join(path, "model", "model.safetensors"))
    assert record["sha256"] == run.sha256(os.path.join(path, "model", "model.safetensors"))
    assert run.verify_checkpoint(path) is None


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "has 100 bytes, {size} were written"),
    (lambda f: f.unlink(), "is missing"),
    (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]), "differs from the file written "
                                                                                  "(SHA-256 mismatch)"),
], ids=["truncated", "missing", "one bit flipped"])
def test_a_damaged_file_is_named(parts, tmp_path, monkeypatch, damage, message):
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    path = checkpointer(parts, tmp_path).save(1, parts[1], parts[2])
    file = tmp_path / "checkpoint-1" / "model" / "model.safetensors"
    size = file.stat().st_size
    damage(file)
    assert run.verify_checkpoint(path) == f"{file} {message.format(size=size)}"
    cfg = config.parse_config(config_class("remax"), ["--output_dir", str(tmp_path), "--resume_from", path])
    _, error = run.find_checkpoint(cfg, world_size=1)
    assert error == f"error: --resume_from {path!r} is damaged: {file} {message.format(size=size)}. Give another " \
                    "checkpoint (--resume_from latest skips damaged ones)."


def test_damaged_checkpoints_are_an_error_by_path_and_skipped_by_latest(tmp_path, capsys):
    """A real run's checkpoints: a missing optimizer.bin given by path is one error line naming it, not a
    FileNotFoundError; a truncated model.safetensors (accelerate's copy of the weights, a SafetensorError
    when loaded) in the newest checkpoint makes --resume_from latest resume from the one before."""
    out_dir = tmp_path / "run"
    cmd = ["lab/remax.py", *CHAOS_ARGS, "--num_steps", "2", "--output_dir", str(out_dir)]
    first = in_process(capsys, *cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = out_dir / "checkpoint-2"
    (newest / "optimizer.bin").rename(tmp_path / "optimizer.bin")
    out = in_process(capsys, *cmd, "--resume_from", str(newest))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"error: --resume_from {str(newest)!r} is damaged: " \
        f"{newest / 'optimizer.bin'} is missing. Give another checkpoint (--resume_from latest skips damaged ones)."
    (tmp_path / "optimizer.bin").rename(newest / "optimizer.bin")
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4])
    out = in_process(capsys, *cmd[:-4], "--num_steps", "3", "--output_dir", str(out_dir), "--resume_from", "latest")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"warning: --resume_from latest: skipping the damaged checkpoint-2: {weights} has 4 bytes" in out.stderr
    assert f"resumed from {out_dir / 'checkpoint-1'} at step 1" in out.stdout
    assert [r["step"] for r in run.read_metrics(out_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert run.verify_checkpoint(newest) is None  # written again by the resumed run


# A pickle that, once loaded, writes a file: what a crafted checkpoint's custom_checkpoint_0.pkl held.
PAYLOAD = "import os, pickle\nclass P:\n    def __reduce__(self):\n        return os.system, ('touch {sentinel}',)\n" \
          "open({file!r}, 'wb').write(pickle.dumps(P()))\n"


@pytest.mark.parametrize("script", ["ppo.py", "lab/ppo.py"])
def test_ppos_kl_controller_is_saved_as_json_and_a_resume_runs_no_pickle(tmp_path, script, capsys):
    """The KL controller (registered with accelerate) is saved as plain JSON, not a pickle, and restored from it; a
    checkpoint given a pickle where accelerate keeps registered objects, its checksums rewritten to verify, is refused
    with one line and the pickle never runs (accelerate loads them with weights_only=False); a state that is not the
    controller's is one line too."""
    out_dir = tmp_path / "run"
    cmd = [script, "--num_steps", "2", "--batch_size", "4", "--num_mini_batches", "2",
           "--max_new_tokens", "4", "--eval_every", "100000", "--save_steps", "1", "--adaptive_kl", "True",
           "--output_dir", str(out_dir)]
    first = in_process(capsys, *cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    last = out_dir / "checkpoint-2"
    betas = [json.loads(line)["train/beta"] for line in open(out_dir / "metrics.jsonl") if "train/beta" in line]
    assert sorted(p.name for p in last.glob("custom_*")) == ["custom_state_0.json"]
    assert json.loads((last / "custom_state_0.json").read_text())["value"] != betas[0]  # moved by step 2's update
    if script == "ppo.py":  # (the lab's saves and loads through the same functions)
        resumed = in_process(capsys, *cmd, "--resume_from", str(out_dir / "checkpoint-1"), "--output_dir",
                             str(tmp_path / "resumed"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        again = [json.loads(line)["train/beta"] for line in open(tmp_path / "resumed" / "metrics.jsonl")
                 if "train/beta" in line]
        assert again[-1] == betas[-1]  # step 2 starts from step 1's coefficient, restored
    sentinel = tmp_path / "sentinel"
    crafted = last / "custom_checkpoint_0.pkl"
    subprocess.run([sys.executable, "-c", PAYLOAD.format(sentinel=sentinel, file=str(crafted))], check=True)
    state = json.loads((last / "trainer_state.json").read_text())
    (last / "trainer_state.json").write_text(json.dumps({**state, "files": run.file_records(last)}))
    refused = in_process(capsys, *cmd, "--resume_from", str(last))
    assert not sentinel.exists()
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1].startswith(
        f"error: --resume_from {str(last)!r} holds custom_checkpoint_0.pkl"), refused.stderr[-3000:]
    if script != "ppo.py":
        return
    crafted.unlink()
    (last / "custom_state_0.json").write_text('{"value": "0.1"}')
    (last / "trainer_state.json").write_text(json.dumps({**state, "files": run.file_records(last)}))
    refused = in_process(capsys, *cmd, "--resume_from", str(last))
    assert refused.stderr.strip().splitlines()[-1].startswith(f"error: --resume_from {str(last)!r}: ") and \
        "is not the state of AdaptiveKLController" in refused.stderr, refused.stderr[-3000:]
