"""Reward functions given by flag (--reward_fn FILE.py:NAME, --reward_weights) and datasets that say what
they hold: the two shipped examples, the weighted sum with the rule reward, the per-function means, the
dataset columns a function receives, one clear error for every bad function or row, and a run that trains
the embedded model on a reward function alone."""
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoTokenizer

from lab import config as lab_config
from lab import tasks
from support import config
from support.run import read_metrics
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import rewards  # noqa: E402  (examples/rewards.py)

CPU = Accelerator(cpu=True)
EXAMPLES = [{"prompt": "12+3=", "answer": "15", "family": "add_2x1"},
            {"prompt": "7*8=", "answer": "56", "family": "mul_2x1"}]


def reward_file(tmp_path, body, name="my_rewards.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def reward_fn(*specs, **flags):
    return tasks.make_reward_fn(lab_config.LabConfig(reward_fn=list(specs), **flags), CPU)


def test_format_reward_is_one_for_think_then_answer_only():
    completions = ["<think>12 + 3 is 15</think> <answer>15</answer>", "<think>x</think>\n<answer>15</answer>\n",
                   "<answer>15</answer>", "<think>x</think><answer>15</answer> and more", "15"]
    assert rewards.format_reward(["12+3="] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_length_reward_falls_linearly_to_minus_one():
    completions = ["", "x" * 100, "x" * rewards.MAX_CHARS, "x" * (3 * rewards.MAX_CHARS)]
    assert rewards.length_reward([""] * 4, completions) == [0.0, -100 / rewards.MAX_CHARS, -1.0, -1.0]


def test_reward_functions_are_weighted_and_summed_with_the_rule_reward():
    fn = reward_fn("examples/rewards.py:format_reward", "examples/rewards.py:length_reward",
                   reward_weights=[0.5, 2.0], rule_reward_weight=3.0)
    completions = ["15", "<think>7 eights</think><answer>56</answer>"]
    rewards_, correct, stats = fn(EXAMPLES, completions)
    length = [-len(c) / rewards.MAX_CHARS for c in completions]
    expected = [3.0 * 1 + 0.5 * 0.0 + 2.0 * length[0], 3.0 * 0 + 0.5 * 1.0 + 2.0 * length[1]]
    torch.testing.assert_close(rewards_, torch.tensor(expected), rtol=0, atol=1e-6)
    assert correct.tolist() == [1.0, 0.0]  # the rule check alone: '<think>...' is not exactly '56'
    assert stats.keys() == {"train/reward/format_reward", "train/reward/length_reward"}
    assert stats["train/reward/format_reward"] == 0.5
    assert stats["train/reward/length_reward"] == pytest.approx(sum(length) / 2)


def test_none_adds_nothing_and_is_left_out_of_the_mean_and_columns_arrive_as_lists(tmp_path):
    path = reward_file(tmp_path, "def by_family(prompts, completions, answer, family, **columns):\n"
                                 "    assert prompts == ['12+3=', '7*8='] and answer == ['15', '56']\n"
                                 "    return [2.0 if f == 'add_2x1' else None for f in family]\n")
    rewards_, _, stats = reward_fn(f"{path}:by_family", rule_reward_weight=0.0)(EXAMPLES, ["1", "2"])
    assert rewards_.tolist() == [2.0, 0.0] and stats == {"train/reward/by_family": 2.0}


def test_a_function_that_applies_to_no_row_logs_nan(tmp_path):
    path = reward_file(tmp_path, "def never(prompts, completions, **columns):\n    return [None] * len(prompts)\n")
    rewards_, _, stats = reward_fn(f"{path}:never")(EXAMPLES, ["15", "0"])
    assert rewards_.tolist() == [1.0, 0.0] and torch.isnan(torch.tensor(stats["train/reward/never"]))


BAD_FUNCTIONS = [  # (body of f, what the error must say)
    ("return [1.0]", "returned 1 values for 2 completions"),
    ("return 1.0", "returned a float for 2 completions"),
    ("return [1.0, 'yes']", "returned str 'yes', not a number, at batch rows 2 of 2, counted from 1 (row 2's "
                            "completion: '0')"),
    ("return [float('nan'), 1.0]", "returned nan at batch rows 1 of 2, counted from 1 (row 1's completion: '15')"),
    ("return [1.0, 10**400]", "returned a number too large for a float (int) at batch rows 2 of 2, counted from 1"),
    ("import fractions\n    return [fractions.Fraction(10**400, 3), 1.0]", "returned a number too large for a float "
                                                                            "(Fraction) at batch rows 1 of 2"),
    ("return [1.0 / len(c) for c in completions]", "raised ZeroDivisionError: float division by zero on batch rows 2 "
                                                   "of 2, counted from 1 (row 2's completion: '')"),
    ("assert len(completions) == 1, 'one at a time'\n    return [0.0]", "raised AssertionError: one at a time on the "
                                                                       "batch of 2 (no row alone)"),
]


@pytest.mark.parametrize("body, message", BAD_FUNCTIONS, ids=[re.split(" at | on ", m)[0] for _, m in BAD_FUNCTIONS])
def test_a_bad_reward_function_is_one_error_naming_it_and_the_rows(tmp_path, body, message):
    path = reward_file(tmp_path, f"def f(prompts, completions, **columns):\n    {body}\n")
    with pytest.raises(SystemExit) as e:
        reward_fn(f"{path}:f")(EXAMPLES, ["15", "" if "len(c)" in body else "0"])
    assert str(e.value).startswith("error: --reward_fn f ") and message in str(e.value), str(e.value)
    assert "step not applied" in str(e.value)


def test_bad_reward_flags_are_errors_before_any_model_loads(tmp_path):
    good = reward_file(tmp_path, "def f(prompts, completions, **columns):\n    return [0.0] * len(prompts)\n")
    broken = reward_file(tmp_path, "import no_such_module_xyz\n", name="broken.py")
    remax = importlib.import_module("lab.remax").Config
    cases = [
        (["--reward_fn", "examples/rewards.py"], "give FILE.py:NAME"),
        (["--reward_fn", "no/such/file.py:f"], "no such file 'no/such/file.py'"),
        (["--reward_fn", "examples/rewards.py:fromat_reward"], "defines no function 'fromat_reward' (it defines "
                                                                "['format_reward', 'length_reward'])"),
        (["--reward_fn", f"{broken}:f"], "raised ModuleNotFoundError"),
        (["--reward_fn", f"{good}:f", "--reward_weights", "1", "2"], "--reward_weights has 2 values for 1"),
        (["--reward_fn", f"{good}:f", "--reward_fn", f"{tmp_path / 'my_rewards.py'}:f"], "two functions named 'f'"),
        (["--reward_weights", "1"], "--reward_weights has 1 values for 0"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            config.parse_config(remax, args)
        assert str(e.value).startswith("error: --reward_") and message in str(e.value), (args, str(e.value))


def test_the_flag_repeats_and_takes_several_values():
    remax = importlib.import_module("lab.remax").Config
    a, b = "examples/rewards.py:format_reward", "examples/rewards.py:length_reward"
    cfg = config.parse_config(remax, ["--reward_fn", a, "--reward_fn", b, "--reward_weights", "0.5", "--reward_weights",
                                      "0.1", "--rule_reward_weight", "0"])
    assert (cfg.reward_fn, cfg.reward_weights) == ([a, b], [0.5, 0.1])
    assert config.parse_config(remax, ["--reward_fn", a, b]).reward_fn == [a, b]


def test_a_reward_function_trains_the_embedded_model_on_its_own(tmp_path):
    """--rule_reward_weight 0: the gradient comes from the function alone (at step 1 the policy equals
    the reference, so the KL term adds no gradient)."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "lab/grpo.py", "--num_steps", "2", "--batch_size", "16", "--max_new_tokens", "4",
           "--eval_every", "100", "--save_model", "False", "--rule_reward_weight", "0",
           "--reward_fn", "examples/rewards.py:length_reward", "--output_dir", str(out_dir)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in read_metrics(out_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert -1 < r["train/reward/length_reward"] < 0
        assert r["train/reward"] == pytest.approx(r["train/reward/length_reward"], abs=1e-6)
    assert rows[0]["train/grad_norm"] > 0


# ---- datasets that say what they hold ----
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(tmp_path, rows, **flags):
    cfg = lab_config.LabConfig(dataset=write_jsonl(tmp_path / "d.jsonl", rows), eval_size=1, **flags)
    return tasks.load_task(cfg, AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL))


@pytest.mark.parametrize("rows, message", [
    ([{"question": "1+1=", "answer": "2"}, {"question": ["1+2="], "answer": "3"}, {"question": "2+2=", "answer": "4"}],
     "row 2: --prompt_column 'question' holds ['1+2=']; every prompt must be text"),
    ([{"question": "1+1=", "answer": "2"}, {"question": "  ", "answer": "3"}, {"question": "2+2=", "answer": "4"}],
     "row 2: --prompt_column 'question' holds empty text"),
    ([{"question": "Capital of France?", "answer": "Paris"}, {"question": "2+2=", "answer": "4"}],
     "row 1: --answer_column 'answer' holds 'Paris', in which --answer_check number finds no number. "
     "Give --answer_check exact"),
    ([{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": None}],
     "row 2: --answer_column 'answer' holds None, not text or a number"),  # row 2 is the held-out row
])
def test_a_row_the_task_cannot_use_is_an_error_naming_it(tmp_path, rows, message):
    with pytest.raises(SystemExit) as e:
        load(tmp_path, rows)
    assert str(e.value).startswith("error: --dataset ") and message in str(e.value), str(e.value)


def test_answer_check_exact_compares_the_text_and_number_the_final_number(tmp_path):
    rows = [{"question": "Capital of France?", "answer": " Paris "}, {"question": "Capital of Peru?", "answer": "Lima"}]
    train, held_out = load(tmp_path, rows, answer_check="exact")
    assert (train[0]["answer"], held_out[0]["answer"], train[0]["check"]) == ("Paris", "Lima", "exact")
    rewards_, correct = tasks.compute_rewards(train * 3, ["Paris", " Paris\n", "Paris, France"])
    assert correct.tolist() == [1.0, 1.0, 0.0]
    train, _ = load(tmp_path, [{"question": "q", "answer": 1234}, {"question": "r", "answer": "#### 1,000"}])
    assert train[0]["answer"] == "1234" and train[0]["row"] == {"question": "q", "answer": 1234}


def test_system_prompt_is_the_chat_templates_system_turn_or_text_before_the_prompt(tmp_path):
    from transformers import AutoTokenizer

    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)
    assert not tok.chat_template
    cfg = lab_config.LabConfig(dataset=write_jsonl(tmp_path / "d.jsonl", rows), eval_size=1, system_prompt="Be brief.")
    train, _ = tasks.load_task(cfg, tok)
    assert train[0]["prompt"] == "Be brief.\n\n1+1=" and train[0]["raw_prompt"] == "1+1="
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    train, _ = tasks.load_task(cfg, tok)
    assert train[0]["prompt"] == "<system>Be brief.<user>1+1=<assistant>"
    with pytest.raises(SystemExit, match="--system_prompt is for instruct models"):
        config.parse_config(importlib.import_module("lab.remax").Config, ["--system_prompt", "Be brief."])


@pytest.mark.parametrize("answer", [None, "  "])
def test_an_answer_no_check_reads_gives_advice_that_works(tmp_path, answer):
    """An answer that is missing (or blank) is read by neither check: the error does not send the user to the
    other check, and its advice, --answer_column '' with a reward function, loads the file."""
    rows = [{"question": "1+1=", "answer": answer}, {"question": "2+2=", "answer": "4"}]
    for check in ("number", "exact"):
        with pytest.raises(SystemExit) as e:
            load(tmp_path, rows, answer_check=check)
        assert "row 1: --answer_column 'answer' holds" in str(e.value) and "Give --answer_check" not in str(e.value)
        assert "Fill in or remove the row, or give --answer_column ''" in str(e.value), str(e.value)
    train, _ = load(tmp_path, rows, answer_column="", reward_fn=["examples/rewards.py:length_reward"])
    assert train[0]["answer"] is None
