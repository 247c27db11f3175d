"""Every bad input is a clear error naming the flag (or column), raised before any model is
loaded: configs are validated while the command line is parsed (config.parse_config)."""
import importlib
import json
import os
import subprocess
import sys

import pytest

from lab import config as lab_config
from support import config
from conftest import ROOT, free_port

BAD_INPUTS = [  # (script, arguments, what the message must name)
    ("grpo", ["--num_generations", "1"], "--num_generations"),
    ("rloo", ["--num_generations", "1"], "--num_generations"),
    ("grpo", ["--batch_size", "10", "--num_generations", "4"], "--batch_size"),
    ("dapo", ["--epsilon_low", "0.2", "--epsilon_high", "0.1"], "--epsilon_high"),
    ("remax", ["--learning_rate", "0"], "--learning_rate"),
    ("remax", ["--num_steps", "0"], "--num_steps"),
    ("remax", ["--max_new_tokens", "0"], "--max_new_tokens"),
    ("remax", ["--temperature", "-1"], "--temperature"),
    ("remax", ["--beta", "-0.1"], "--beta"),
    ("grpo", ["--beta", "-1"], "--beta"),
    ("grpo", ["--loss_agg", "sum"], "--loss_agg"),
    ("grpo", ["--scale_rewards", "global"], "--scale_rewards"),
    ("ppo", ["--batch_size", "64", "--num_mini_batches", "3"], "--num_mini_batches"),
    ("ppo", ["--adaptive_kl", "--beta", "0"], "--adaptive_kl"),
    ("remax", ["--top_p", "0"], "--top_p"),
    ("grpo", ["--keep_routing", "r4"], "--keep_routing"),
    ("remax", ["--keep_routing", "r2"], "--keep_routing r2"),  # one update per batch: no pi_old pass to replay
    ("grpo", ["--keep_routing", "r2"], "--num_epochs"),
    ("grpo", ["--rollout_dtype", "bfloat16", "--tis_level", "sequence"], "--tis_cap"),
    ("grpo", ["--tis_veto", "0.5"], "--rollout_dtype"),
    ("rloo", ["--rollout_lag", "1", "--tis_veto", "1.5"], "--tis_veto"),
    ("remax", ["--dataset", "data.csv"], "--dataset"),
    ("remax", ["--dataset", "no_such_file.jsonl"], "--dataset"),
    ("remax", ["--torch_dtype", "int8"], "--torch_dtype"),
    ("remax", ["--resume_from", "/no/such/checkpoint"], "--resume_from"),
    ("remax", ["--rule_reward_weight", "0"], "--reward_model"),
    ("remax", ["--lora_r", "-1"], "--lora_r"),
    ("remax", ["--report_to", "mlflow"], "--report_to"),
    ("remax", ["--reward_scales", "random"], "--reward_scales"),
    ("remax", ["--baseline", "mean"], "--baseline"),
    ("remax", ["--top_k", "-1"], "--top_k"),
    ("rloo", ["--tis_cap", "2"], "--tis_cap"),
    ("dapo", ["--geo_mask_delta", "0.1"], "--geo_mask_delta"),
    ("grpo", ["--rollout_dtype", "fp8"], "--rollout_dtype"),
    ("ppo", ["--lam_critic", "2"], "--lam_critic"),
    ("remax", ["--output_dir", "README.md"], "--output_dir"),
    ("remax", ["--output_dir", "README.md/run"], "--output_dir"),
    ("remax", ["--save_total_limit", "-1"], "--save_total_limit"),
    ("remax", ["--resume_from", "README.md"], "--resume_from"),
    ("remax", ["--micro_batch_size", "-1"], "--micro_batch_size"),
    ("grpo", ["--generation_batch_size", "-2"], "--generation_batch_size"),
    ("rloo", ["--micro_batch_size", "4", "--num_generations", "8"], "--micro_batch_size"),
    ("remax", ["--answer_check", "regex"], "--answer_check"),
    ("grpo", ["--system_prompt", "Be brief."], "--system_prompt"),
    ("remax", ["--reward_fn", "no_such_file.py:f"], "--reward_fn"),
    ("dapo", ["--reward_fn", "examples/rewards.py:no_such_function"], "--reward_fn"),
    ("ppo", ["--reward_weights", "0.5"], "--reward_weights"),
]


@pytest.mark.parametrize("script, args, flag", BAD_INPUTS, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD_INPUTS])
def test_bad_config_names_the_flag(script, args, flag):
    module = importlib.import_module(f"lab.{script}")  # the lab's Config: every flag
    with pytest.raises(SystemExit) as e:
        config.parse_config(module.Config, args)
    assert flag in str(e.value), str(e.value)
    assert str(e.value).startswith("error: ")


def test_at_least_fifteen_distinct_bad_inputs():
    assert len({(s, tuple(a)) for s, a, _ in BAD_INPUTS}) >= 15


def run(args, tmp_path, env=None):
    return subprocess.run([sys.executable, "lab/remax.py", "--output_dir", str(tmp_path / "run"), *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_unknown_hub_model_offline_says_so(tmp_path):
    out = run(["--model_name_or_path", "nobody/no-such-model-xyz"], tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0 and "--model_name_or_path" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert "Traceback" not in out.stderr


def test_folder_that_is_not_a_model_is_refused(tmp_path):
    out = run(["--model_name_or_path", str(tmp_path)], tmp_path)
    assert out.returncode != 0 and "config.json" in out.stderr and "Traceback" not in out.stderr


def test_an_empty_prompt_is_an_error_naming_the_dataset_and_the_row(tmp_path):
    path = tmp_path / "empty.jsonl"
    rows = [{"question": "1+1=", "answer": "#### 2"}, {"question": "  ", "answer": "#### 1"}, {"question": "2+2=",
                                                                                                 "answer": "4"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = run(["--dataset", str(path), "--eval_size", "1"], tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"error: --dataset {str(path)!r} row 2: --prompt_column " \
                                                  "'question' holds empty text; every prompt must be text, or a " \
                                                  "list of {'role': ..., 'content': ...} messages."


def test_no_answers_without_reward_model_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(SystemExit, match="--answer_column '' .* needs a --reward_fn or --reward_model"):
        config.parse_config(importlib.import_module("lab.remax").Config, ["--dataset", str(path), "--answer_column", ""])


@pytest.mark.parametrize("save_steps", ["1", "0"], ids=["checked_before_the_save", "found_by_the_next_sampling"])
def test_a_learning_rate_that_breaks_the_weights_stops_with_an_error(tmp_path, save_steps):
    """AdamW moves every weight by about --learning_rate: 1e30 leaves finite weights whose logits
    overflow. With a checkpoint due after the update the check before the save finds them; without one
    (and 3 steps before the last) the next sampling meets them, as a RuntimeError. Either way the run
    stops with the same error line and saves nothing. Every reward is non-zero but for a wrong add_3x3
    answer (--reward_scales hetero, no baseline), so the first update has a gradient: with 0/1 rewards and
    the greedy baseline every advantage of a small batch can be 0, and a zero gradient moves no weight at
    any learning rate."""
    out = run(["--learning_rate", "1e30", "--num_steps", "4", "--batch_size", "4", "--max_new_tokens", "4",
               "--reward_scales", "hetero", "--baseline", "none", "--eval_every", "100000", "--save_steps",
               save_steps, "--save_model", "False"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert ("error: the update of step 1 made the policy's weights or logits non-finite (its loss and gradient "
            "norm were finite); no checkpoint was saved before it") in out.stderr and "--learning_rate" in out.stderr
    assert not [p for p in (tmp_path / "run").iterdir() if "checkpoint" in p.name]


DEEPSPEED_ZERO3 = {  # what `accelerate launch --config_file configs/zero3.yaml` sets, on CPU
    "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1",
    "ACCELERATE_GRADIENT_CLIPPING": "1.0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,offload_optimizer_device,offload_param_device,"
                                   "gradient_accumulation_steps,gradient_clipping,zero3_init_flag,zero3_save_16bit_model"}


TWO_PROCESS_FAILURES = {  # what breaks at step 1: (flags, the start of the error line)
    "non_finite_loss": (["--reward_fn", "{tmp_path}/huge.py:huge", "--baseline", "none", "--adv_clip", "0"],
                        "error: non-finite loss"),
    "broken_weights": (["--learning_rate", "1e30", "--reward_scales", "hetero", "--baseline", "none"],
                       "error: the update of step 1 made the policy's weights or logits non-finite")}


@pytest.mark.parametrize("failure", list(TWO_PROCESS_FAILURES))
@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_a_failure_ends_every_rank_of_a_two_process_run_with_exit_code_1(tmp_path, backend, failure):
    """Rewards of 3e38 with no baseline and no advantage clip overflow the loss at step 1; a learning rate of
    1e30 breaks the weights at step 1, which the sampling of step 2 meets on every rank. Either way every rank
    stops with exit code 1, and the main process prints the error line (once: the ranks agree on it). Under
    ZeRO-3 a rank that left the interpreter with its process group open could end by SIGABRT ("terminate
    called without an active exception", exit code -6); helpers.close_process_group closes it at exit and
    leaves before the interpreter's teardown. The two
    ranks are started as torchrun starts them (its environment variables), not under a launcher: a launcher
    stops the other ranks (SIGTERM) as soon as one has failed, which hides the exit code each would have had."""
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    (tmp_path / "huge.py").write_text("def huge(prompts, completions, **columns):\n"
                                      "    return [3e38] * len(completions)\n")
    flags, error = TWO_PROCESS_FAILURES[failure]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", **(DEEPSPEED_ZERO3 if backend == "zero3" else {})}
    cmd = [sys.executable, "lab/remax.py", *[flag.format(tmp_path=tmp_path) for flag in flags],
           "--num_steps", "3", "--batch_size", "4", "--max_new_tokens", "4", "--eval_every", "100000",
           "--save_model", "False", "--output_dir", str(tmp_path / "run")]
    logs = [open(tmp_path / f"rank{rank}.err", "w+") for rank in (0, 1)]
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.DEVNULL, stderr=logs[rank]) for rank in (0, 1)]
    try:  # alone about a minute; a machine at load 10 runs it several times slower
        codes = [rank.wait(timeout=1200) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    errs = [(log.seek(0), log.read())[1] for log in logs]
    assert codes == [1, 1], [err[-2000:] for err in errs]
    for err in errs:
        assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    assert errs[0].strip().splitlines()[-1].startswith(error), errs[0][-3000:]
    assert "error:" not in errs[1], errs[1][-3000:]


def test_a_rank_leaves_with_its_output_flushed_and_its_own_exit_code():
    """helpers.leave_run: one process returns; with several, what was printed (buffered, to a pipe) is flushed
    and the process ends at once with the code given, running no line after it and no exit handler."""
    script = ("import atexit, sys\n"
              "from support import helpers\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "helpers.leave_run(1)\n"
              "print('one process returns', end=' ')\n"
              "sys.stderr.write('to stderr')\n"
              "helpers.leave_run(2, code=int(sys.argv[1]))\n"
              "print('not reached')\n")
    for code in (0, 1):
        out = subprocess.run([sys.executable, "-c", script, str(code)], cwd=ROOT, capture_output=True, text=True)
        assert (out.returncode, out.stdout, out.stderr) == (code, "one process returns ", "to stderr")


# A JSON Lines file's lines the datasets library reads with a traceback that names neither file nor line
BAD_LINES = [
    (b'{"question": "caf\xe9 1+1=", "answer": "2"}\n', "not UTF-8 (byte 0xe9 at byte 18 of the line; latin-1?): save "
                                                       "the file as UTF-8."),
    (b'{"question": "1+1=", "answer": 2\n', "not JSON (Expecting ',' delimiter at character 34)."),
    (b'["1+1=", "2"]\n', "a JSON list, not an object of columns."),
]


@pytest.mark.parametrize("line, said", BAD_LINES, ids=["latin-1", "malformed", "not_an_object"])
def test_a_bad_line_of_a_jsonl_file_is_one_error_naming_the_file_and_the_line(tmp_path, line, said):
    path = tmp_path / "data.jsonl"
    good = b'{"question": "2+2=", "answer": "4"}\n'
    path.write_bytes(good + good + line + good)
    out = run(["--dataset", str(path), "--eval_size", "1"], tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"error: --dataset {str(path)!r} line 3: {said}"


def test_an_empty_jsonl_file_is_one_error_before_any_model_loads(tmp_path):
    from support import tasks

    path = tmp_path / "empty.jsonl"
    for text in ("", "\n  \n"):
        path.write_text(text)
        with pytest.raises(SystemExit) as stopped:
            tasks.load_task(lab_config.LabConfig(dataset=str(path)))  # no model yet: the data are loaded first
        assert stopped.value.code == f"error: --dataset {str(path)!r} holds no rows: each line of a .jsonl file is " \
                                     "one JSON object."


def test_a_second_run_on_the_same_output_dir_stops_with_one_line(tmp_path):
    """Two runs given one --output_dir interleaved metrics.jsonl, and one deleted the other's tmp-checkpoint-N in
    the middle of its save: the first holds the folder's lock (taken with its Accelerator, before any model loads),
    the second stops, and the lock goes with the process that held it."""
    holder = ("import sys, time; sys.path.insert(0, sys.argv[1]); from types import SimpleNamespace; "
              "from support import helpers; helpers.make_accelerator(SimpleNamespace(report_to='none', "
              "output_dir=sys.argv[2])); print('holding', flush=True); time.sleep(120)")
    first = subprocess.Popen([sys.executable, "-c", holder, str(ROOT), str(tmp_path / "run")], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout.readline() == "holding\n"
        second = run(["--num_steps", "1"], tmp_path)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.strip().splitlines()[-1] == f"error: --output_dir {str(tmp_path / 'run')!r} is in use by " \
                                                     "another run (it holds the folder's lock): wait for it to end, " \
                                                     "or give another --output_dir."
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert run(["--num_steps", "1", "--batch_size", "2", "--max_new_tokens", "2", "--eval_every", "100000"],
               tmp_path).returncode == 0  # once the first has ended
