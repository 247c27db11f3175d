"""The two tiers run the same algorithm: each lesson file (grpo.py ...) and its lab file (lab/grpo.py) with no lab
feature on give the same run over 5 steps, every metric of metrics.jsonl bit for bit (a metric only one tier logs
fails, unless LAB_ONLY names it) and the same final weights, in one process, and in two processes (DDP on CPU) with
micro-batches; and with the flags that change the update: several epochs, GSPO's sequence ratio, no reference,
top-k / top-p sampling, LoRA. opd.py has no lab twin: distillation's teacher scores what the student samples, and
none of the lab's samplers (stale, an inference engine, trees) has been made to carry a teacher."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import ROOT, launch_two_processes, run_main

ALGORITHMS = ("remax", "rloo", "grpo", "dapo", "ppo", "reinforce_pp")
# five steps of a small batch each (PPO's step is num_epochs x num_mini_batches = 4 optimizer steps)
ARGS = {"ppo": ["--num_steps", "5", "--batch_size", "16", "--num_mini_batches", "2", "--num_epochs", "2"]}
SMALL = ["--num_steps", "5", "--batch_size", "16"]
# rows per micro-batch: two or more per update (the group methods': whole groups; REINFORCE++ needs none, its
# advantages are the whole batch's before the update)
MICRO = {"remax": "4", "ppo": "4", "reinforce_pp": "4"}


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# what the lab's engine measures and the lesson does not: its sampler's work and the step's phases
LAB_ONLY = {"train/decoded_per_completion", "train/effective_samples", "train/generated", "train/group_size_max",
            "train/group_size_min", "train/group_size_std", "train/staleness"}
# flags that change the update, each run by both tiers
VARIANTS = [("grpo", ["--num_epochs", "2"]),
            ("grpo", ["--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4"]),
            ("grpo", ["--lora_r", "4"]),
            ("remax", ["--beta", "0", "--top_k", "5"]),
            ("rloo", ["--top_p", "0.9", "--temperature", "1.2"])]


def run_in_process(script, args, out_dir):
    """`python script args --output_dir out_dir`, in this process (conftest.run_main)."""
    run_main([script, *args, "--output_dir", out_dir])


def run_both(name, args, tmp_path):
    """The lesson's run and the lab's, one after the other in this process."""
    for script, tier in ((f"{name}.py", "lesson"), (f"lab/{name}.py", "lab")):
        run_in_process(script, args, tmp_path / tier)


def assert_same_run(lesson, lab):
    rows, lab_rows = metrics(lesson), metrics(lab)
    assert [r["step"] for r in rows] == [r["step"] for r in lab_rows]
    for row, lab_row in zip(rows, lab_rows):
        keys = {k for k in row if not k.startswith("time/")}
        lab_keys = {k for k in lab_row if not k.startswith("time/")} - LAB_ONLY
        assert keys == lab_keys, (row["step"], keys ^ lab_keys)
        assert len(keys) >= 8 and "train/loss" in keys or row["step"] == 0
        assert {k: row[k] for k in keys} == {k: lab_row[k] for k in keys}, row["step"]
    name = "adapter_model.safetensors" if os.path.exists(os.path.join(lesson, "final", "adapter_config.json")) else \
        "model.safetensors"  # under --lora_r, the adapter
    weights, lab_weights = (load_file(os.path.join(d, "final", name)) for d in (lesson, lab))
    assert weights.keys() == lab_weights.keys()
    assert all(weights[k].equal(lab_weights[k]) for k in weights)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_lesson_and_the_lab_give_the_same_run(name, tmp_path):
    run_both(name, ARGS.get(name, SMALL), tmp_path)
    assert_same_run(tmp_path / "lesson", tmp_path / "lab")


@pytest.mark.parametrize("name, flags", VARIANTS, ids=[" ".join([n, *f[:2]]) for n, f in VARIANTS])
def test_the_lesson_and_the_lab_give_the_same_run_with_the_flags_that_change_the_update(name, flags, tmp_path):
    run_both(name, ["--num_steps", "3", "--batch_size", "16", *flags], tmp_path)
    assert_same_run(tmp_path / "lesson", tmp_path / "lab")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_lesson_and_the_lab_give_the_same_run_in_two_processes_with_micro_batches(name, tmp_path):
    """Each tier's replicas end with the same weights (launch_two_processes checks it), and the tiers agree, with
    the update in two or more micro-batches on each process."""
    args = [*ARGS.get(name, SMALL), "--micro_batch_size", MICRO.get(name, "8")]
    args += ["--scale_rewards", "batch"] if name == "grpo" else []  # the std over every process's rewards
    launch_two_processes(f"{name}.py", args, tmp_path / "lesson")
    launch_two_processes(f"lab/{name}.py", args, tmp_path / "lab")
    assert_same_run(tmp_path / "lesson", tmp_path / "lab")


def test_a_lesson_file_has_no_lab_flag():
    out = subprocess.run([sys.executable, "grpo.py", "--rollout_dtype", "bfloat16"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode != 0 and out.stderr.startswith("error: --rollout_dtype is a flag of lab/grpo.py (the lab), "
                                                         "not of grpo.py (the lesson)")


def test_a_lesson_run_resumed_from_its_checkpoint_continues_the_same_run(tmp_path, capsys):
    """grpo.py stopped at step 2 (--save_steps 2) and resumed to step 4 trains as the run of 4 steps does: the
    checkpoint holds the weights, the optimizer, every rank's random state and the prompt order."""
    args = ["--batch_size", "16", "--num_generations", "4", "--save_steps", "2"]
    run_in_process("grpo.py", [*args, "--num_steps", "4"], tmp_path / "whole")
    run_in_process("grpo.py", [*args, "--num_steps", "2"], tmp_path / "parts")
    capsys.readouterr()
    run_in_process("grpo.py", [*args, "--num_steps", "4", "--resume_from", "latest"], tmp_path / "parts")
    assert "resumed from" in capsys.readouterr().out
    rows, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "parts")
    assert [r["step"] for r in rows] == [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for row, other in zip(rows, resumed):
        train = [k for k in row if k.startswith("train/")]
        assert {k: row[k] for k in train} == {k: other[k] for k in train}, row["step"]
    weights, other = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("whole", "parts"))
    assert all(weights[k].equal(other[k]) for k in weights)
