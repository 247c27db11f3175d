"""What a newcomer meets in the first hour: a flag of the lab given to the lesson, a negative number, a micro-batch
larger than the batch, a model folder without its tokenizer, prompts the tokenizer cannot read, a Hub name with no
network. Each is one `error:` line (or, for prompts that lose characters, one warning) before any model loads."""
import os
import shutil
import sys

import pytest

import grpo
from lab import dapo as lab_dapo, remax as lab_remax
from support import config, models


def parse(config_class, args, script):
    """config.parse_config as `python script args` runs it; the SystemExit's message."""
    argv0 = sys.argv[0]
    sys.argv[0] = os.path.join(config.ROOT, script)
    try:
        with pytest.raises(SystemExit) as e:
            config.parse_config(config_class, args)
    finally:
        sys.argv[0] = argv0
    return str(e.value)


@pytest.mark.parametrize("args, said", [
    (["--learning_rate", "-1e-4"], "error: --learning_rate must be > 0 (got -0.0001)"),  # not "expected one argument"
    (["--top_p", "-0.5"], "error: --top_p must be in (0, 1]"),
    (["--beta", "-inf"], "error: --beta must be >= 0"),
    (["--micro_batch_size", "128"], "error: --micro_batch_size (128) is larger than --batch_size (64)"),
])
def test_a_negative_value_and_a_micro_batch_larger_than_the_batch_are_one_line_naming_the_flag(args, said):
    assert parse(grpo.Config, args, "grpo.py").startswith(said)
    assert parse(lab_remax.Config, args + ["--beta", "0"] * ("--beta" not in args), "lab/remax.py").startswith(said)


@pytest.mark.parametrize("script, flag", [("grpo.py", "--prompt_column"), ("grpo.py", "--answer_check"),
                                          ("grpo.py", "--generation_batch_size"), ("dapo.py", "--dynamic_sampling_metric"),
                                          ("remax.py", "--rule_reward_weight"), ("ppo.py", "--value_pretrain_steps")])
def test_a_lab_flag_given_to_the_lesson_names_the_lab_script_that_has_it(script, flag):
    lesson = __import__(script[:-3]).Config
    said = parse(lesson, [flag, "1"], script)
    assert said.startswith(f"error: {flag} is a flag of lab/{script} (the lab), not of {script}"), said


def test_a_flag_neither_tier_has_is_still_unknown_with_its_closest_flag():
    assert parse(grpo.Config, ["--num_stepz", "3"], "grpo.py") == "error: unknown flag --num_stepz; did you mean --num_steps?"
    assert "unknown flag --prompt_columnn; did you mean --prompt_column?" in parse(lab_dapo.Config, ["--prompt_columnn",
                                                                                                     "q"], "lab/dapo.py")


def embedded_tokenizer():
    return models.load_tokenizer(config.TrainConfig())


def test_a_prompt_that_encodes_to_no_token_is_an_error_line():
    cfg = config.TrainConfig()
    with pytest.raises(SystemExit, match=r"^error: --model_name_or_path .*encodes the prompt 'abc' to no token"):
        models.check_prompts_tokenize(embedded_tokenizer(), [{"prompt": "12+7="}, {"prompt": "abc"}], cfg)


def test_a_model_folder_without_the_tokenizer_s_files_is_an_error_line_not_a_crash_at_eval(tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(config.EMBEDDED_MODEL, name), tmp_path / name)
    cfg = config.TrainConfig(model_name_or_path=str(tmp_path))
    tokenizer = models.load_tokenizer(cfg)  # transformers builds an empty one
    with pytest.raises(SystemExit, match="Does the folder hold the tokenizer's files"):
        models.check_prompts_tokenize(tokenizer, [{"prompt": "12+7="}], cfg)


def test_prompts_that_lose_characters_to_the_tokenizer_give_one_warning(capsys):
    cfg, tokenizer = config.TrainConfig(), embedded_tokenizer()
    models.check_prompts_tokenize(tokenizer, [{"prompt": "12+7="}, {"prompt": "3*4="}], cfg)
    assert capsys.readouterr().err == ""  # the arithmetic task reads whole
    models.check_prompts_tokenize(tokenizer, [{"prompt": "Tom has 16 eggs and gets 35 more."}, {"prompt": "1+1="}],
                                  cfg)
    err = capsys.readouterr().err
    assert err.startswith("warning: 1 of 2 prompts lose characters") and "reads '1635'" in err
    assert err.count("\n") == 1


def test_a_hub_name_that_cannot_be_fetched_is_one_line(monkeypatch):
    """HF_HUB_OFFLINE unset and the name in no cache: one short request (CI has no Hub: it cannot be reached; with
    a network the name is not there), not the loaders' minute of retries and their traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(SystemExit, match=r"^error: --model_name_or_path 'nobody-here/no-such-model-0x5a' .*(cannot be "
                                         r"reached|no such model on the Hub)"):
        models.check_model_path("nobody-here/no-such-model-0x5a")


def test_the_console_marks_where_it_cut_a_long_prompt_or_completion():
    from support.run import shortened
    prompt = "Tom has 16 eggs and gets 35 more. " * 3 + "How many eggs?"
    assert shortened(prompt, 60, keep="end") == "..." + prompt[-57:] and len(shortened(prompt, 60, keep="end")) == 60
    assert shortened(prompt, 60) == prompt[:57] + "..."
    assert shortened("12+7=", 60, keep="end") == "12+7="  # short: whole, no mark


def test_a_new_critic_head_says_its_load_report_is_expected(capfd):
    import ppo
    ppo.ValueModel(config.EMBEDDED_MODEL)
    err = capfd.readouterr().err
    assert "note: the critic's value head `score` is new" in err and "expected (docs/ppo.md)" in err


def test_a_data_error_in_a_lesson_script_names_the_lab_script_that_has_the_flags_it_advises():
    message = ("error: --dataset 'd.jsonl' row 1: --answer_column 'answer' holds 'Paris', in which --answer_check "
               "number finds no number. Give --answer_check exact")
    argv0 = sys.argv[0]
    try:
        sys.argv[0] = os.path.join(config.ROOT, "grpo.py")
        said = config.where_the_flags_are(message)
        sys.argv[0] = os.path.join(config.ROOT, "lab", "grpo.py")
        assert config.where_the_flags_are(message) == message  # the lab's script has them
    finally:
        sys.argv[0] = argv0
    assert said == message + " (--answer_column, --answer_check: flags of lab/grpo.py (the lab), not of grpo.py)"
