"""The real task: GSM8K, MATH and MATH-500 rows in their published shapes, from local files, read by the code that
reads a Hub dataset; gold answers math-verify cannot parse counted and reported once; the R1-Zero prompt; R1's format
reward beside the verified accuracy, each logged; pass@k and mean@k (the unbiased estimator against brute-force
enumeration); a two-step run of lab/grpo.py on a MATH-500 file with all of it."""
import importlib.util
import itertools
import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from conftest import run_main
from lab.pass_at_k import pass_at_k, reported
from lab import config as lab_config
from lab import tasks
from support import config
from support.run import read_metrics

# the published columns, with rows of the same kind
GSM8K = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                      "How many clips did Natalia sell altogether in April and May?",
          "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                    "altogether in April and May.\n#### 72"},
         {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
                      "much did she earn?",
          "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
                    "$<<0.2*50=10>>10.\n#### 10"}]
MATH = [{"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
         "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
        {"problem": "Simplify $\\sqrt{8}$.", "level": "Level 2", "type": "Algebra",
         "solution": "$\\sqrt{8} = \\sqrt{4 \\cdot 2} = \\boxed{2\\sqrt{2}}$."}]
MATH_500 = [{"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
             "solution": "We have that $r = 3$ and $\\theta = \\frac{\\pi}{2}$, so the polar coordinates are "
                         "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
             "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
             "unique_id": "test/precalculus/807.json"},
            {"problem": "What is $1+2$?", "solution": "$1+2=\\boxed{3}$.", "answer": "3", "subject": "Prealgebra",
             "level": 1, "unique_id": "test/prealgebra/1.json"}]


def write(path, rows):
    if str(path).endswith(".parquet"):
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)


@pytest.mark.parametrize("shape, rows, flags, golds", [
    ("gsm8k.jsonl", GSM8K, {}, ["72", "10"]),
    ("math.jsonl", MATH, dict(prompt_column="problem", answer_column="solution"), ["\\frac{3}{4}", "2\\sqrt{2}"]),
    ("math500.parquet", MATH_500, dict(prompt_column="problem"), ["\\left( 3, \\frac{\\pi}{2} \\right)", "3"]),
    ("generic.parquet", [{"q": "2+2?", "gold": 4.0, "source": "a"}, {"q": "1/2 as a decimal?", "gold": 0.5,
                                                                       "source": "b"}],
     dict(prompt_column="q", answer_column="gold"), ["4.0", "0.5"]),  # a column of numbers: parquet's float64
])
def test_the_published_shapes_load_from_local_files_with_their_gold_answers(tmp_path, tokenizer, shape, rows, flags,
                                                                            golds):
    pytest.importorskip("math_verify")
    cfg = lab_config.LabConfig(dataset=write(tmp_path / shape, rows), eval_size=1, answer_check="math", **flags)
    train, held_out = tasks.load_task(cfg, tokenizer)
    assert [ex["answer"] for ex in train + held_out] == golds
    assert train[0]["raw_prompt"] == rows[0][cfg.prompt_column] and train[0]["check"] == "math"
    assert set(train[0]["row"]) == set(rows[0])  # every column reaches the reward functions


def test_rows_whose_gold_math_verify_cannot_parse_are_counted_and_reported_once(tmp_path, tokenizer, capsys):
    pytest.importorskip("math_verify")
    rows = [MATH[0], {**MATH[1], "solution": "no box here: \\boxed{"}, {**MATH[1], "solution": ""}, MATH[1], MATH[0]]
    cfg = lab_config.LabConfig(dataset=write(tmp_path / "math.jsonl", rows), eval_size=1, answer_check="math",
                             prompt_column="problem", answer_column="solution")
    train, held_out = tasks.load_task(cfg, tokenizer)
    assert len(train) == 2 and len(held_out) == 1
    warnings = [line for line in capsys.readouterr().out.splitlines() if "math-verify cannot parse" in line]
    assert len(warnings) == 1 and "left out 2 train rows" in warnings[0] and "(rows 2, 3)" in warnings[0]


def test_r1_zero_template_wraps_the_question_without_the_chat_template(tmp_path, tokenizer):
    cfg = lab_config.LabConfig(dataset=write(tmp_path / "g.jsonl", GSM8K), eval_size=1, prompt_template="r1_zero")
    train, _ = tasks.load_task(cfg, tokenizer)
    assert train[0]["prompt"].startswith("A conversation between User and Assistant.")
    assert train[0]["prompt"].endswith(f"User: {GSM8K[0]['question']}. Assistant:")
    assert train[0]["raw_prompt"] == GSM8K[0]["question"]


def test_flags_of_the_real_task_are_checked_before_any_model_loads():
    with pytest.raises(ValueError, match="--prompt_template r1_zero is for --dataset gsm8k or a file"):
        lab_config.LabConfig(prompt_template="r1_zero")
    if importlib.util.find_spec("math_verify"):
        with pytest.raises(ValueError, match="--answer_check math is for --dataset gsm8k or a file"):
            lab_config.LabConfig(answer_check="math", dataset="tool_arithmetic")
    with pytest.raises(ValueError, match="--prompt_template must be chat or r1_zero"):
        lab_config.LabConfig(prompt_template="r1")
    with pytest.raises(ValueError, match="--eval_samples must be >= 0"):
        lab_config.LabConfig(eval_samples=-1)


def test_the_reward_adds_r1s_format_term_and_logs_each_share(tmp_path):
    """reward = rule_reward_weight x verified accuracy + format_reward_weight x format, with
    train/reward/accuracy and train/reward/format their unweighted means."""
    pytest.importorskip("math_verify")
    cfg = lab_config.LabConfig(dataset=write(tmp_path / "g.jsonl", GSM8K), answer_check="math",
                             format_reward_weight=0.5)
    score = tasks.reward_scorer(cfg, "cpu")
    examples = [{"prompt": "p", "answer": "\\frac{3}{4}", "check": "math"}] * 4
    completions = ["<think>a</think> <answer>0.75</answer>", "<think>a</think> <answer>1</answer>",
                   "\\boxed{3/4}", "no answer"]
    rewards, correct, stats, error = score(examples, completions)
    assert error is None and rewards.tolist() == [1.5, 0.5, 1.0, 0.0] and correct.tolist() == [1, 0, 1, 0]
    assert stats == {"train/reward/accuracy": 0.5, "train/reward/format": 0.5, "train/answer_timeouts": 0}


def test_the_arithmetic_task_keeps_its_exact_integer_reward():
    cfg = lab_config.LabConfig()
    examples = [{"prompt": "12+3=", "answer": "15", "family": "add_2x1"}] * 3
    rewards, correct, stats, error = tasks.reward_scorer(cfg, "cpu")(examples, ["15", "15.0", "3/4"])
    assert rewards.tolist() == [1.0, 0.0, 0.0] and stats == {} and error is None


def brute_force_pass_at_k(outcomes, k):
    """The fraction of the k-subsets of the n samples that hold a right one: what pass@k estimates, enumerated."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_right_sample(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        random.Random(n * 10 + c).shuffle(outcomes)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)  # pass@1 is the accuracy of one sample: mean@n


def test_pass_at_k_is_unbiased_for_fresh_samples():
    """Averaged over every way n samples can fall (each right with probability p), the estimate from n samples is
    1 - (1 - p)^k, the chance that k fresh samples hold a right one."""
    n, k, p = 6, 3, 0.3
    expected = sum(pass_at_k(n, c, k) * (p ** c) * ((1 - p) ** (n - c)) * len(list(itertools.combinations(range(n), c)))
                   for c in range(n + 1))
    assert expected == pytest.approx(1 - (1 - p) ** k, abs=1e-12)


def test_the_reported_pass_at_j_are_the_powers_of_two_and_k():
    assert reported(1) == [1] and reported(4) == [1, 2, 4] and reported(6) == [1, 2, 4, 6]


def run_in_process(argv):
    """`python *argv` in this process (conftest.run_main), in the main thread, where the math answers' time limit
    runs."""
    run_main(argv)


def test_lab_grpo_trains_on_a_math500_file_with_the_verified_reward_and_logs_pass_at_k(tmp_path):
    """Two steps of lab/grpo.py on a MATH-500-shaped file: --answer_check math, R1's format term and prompt,
    --eval_samples 2, logged at the start and the end; the training's draws are those of a run without
    --eval_samples (its sampling has its own random stream)."""
    pytest.importorskip("math_verify")
    data = write(tmp_path / "math500.jsonl", MATH_500 * 4)
    common = ["lab/grpo.py", "--dataset", data, "--prompt_column", "problem", "--answer_check", "math",
              "--prompt_template", "r1_zero", "--format_reward_weight", "0.5", "--num_steps", "2",
              "--batch_size", "4", "--num_generations", "2", "--max_new_tokens", "4", "--eval_size", "2",
              "--eval_every", "100", "--log_rollouts", "0", "--save_model", "False", "--max_prompt_length", "1000"]
    for name, extra in (("k", ["--eval_samples", "2"]), ("plain", [])):
        run_in_process([*common, *extra, "--output_dir", str(tmp_path / name)])
    rows, plain = read_metrics(tmp_path / "k" / "metrics.jsonl"), read_metrics(tmp_path / "plain" / "metrics.jsonl")
    evaluations = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    for r in evaluations:
        assert {"eval/pass@1", "eval/pass@2", "eval/mean@2"} <= r.keys()
        assert 0 <= r["eval/mean@2"] <= r["eval/pass@2"] <= 1 and r["eval/pass@1"] == r["eval/mean@2"]
    trained = [r for r in rows if "train/reward" in r]
    assert len(trained) == 2 and all({"train/reward/accuracy", "train/reward/format"} <= r.keys() for r in trained)
    assert [r["train/reward"] for r in trained] == [r["train/reward"] for r in plain if "train/reward" in r]
    assert torch.isfinite(torch.tensor([r["train/loss"] for r in trained])).all()


def test_a_lesson_file_takes_the_verified_reward_as_a_reward_function(tmp_path):
    """grpo.py keeps its flags: on a GSM8K-shaped file it takes accuracy_reward and format_reward with --reward_fn,
    each logged under its name."""
    pytest.importorskip("math_verify")
    run_in_process(["grpo.py", "--dataset", write(tmp_path / "gsm8k.jsonl", GSM8K * 3),
                    "--reward_fn", "lab/math_answers.py:accuracy_reward",
                    "--reward_fn", "lab/math_answers.py:format_reward",
                    "--num_steps", "2", "--batch_size", "4", "--num_generations", "2", "--max_new_tokens", "4",
                    "--eval_every", "100", "--output_dir", str(tmp_path / "run")])
    trained = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/reward" in r]
    assert len(trained) == 2
    assert all({"train/reward/accuracy_reward", "train/reward/format_reward"} <= r.keys() for r in trained)


def test_without_math_verify_the_flag_is_one_error_line_naming_the_install_step(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "math_verify" else
                        find_spec(name, *args))
    data = write(tmp_path / "g.jsonl", GSM8K)
    with pytest.raises(SystemExit, match=r"^error: --answer_check math checks answers with math-verify, which is not "
                                         r"installed: pip install -r requirements-math.txt$"):
        config.parse_config(lab_config.LabConfig, ["--dataset", data, "--answer_check", "math", "--output_dir",
                                                 str(tmp_path / "run")])


def test_the_sampler_process_checks_math_answers_in_its_main_thread(tmp_path):
    """--async_rollouts: the rewards are scored in the sampler process, whose main thread runs the time limit."""
    pytest.importorskip("math_verify")
    run_in_process(["lab/grpo.py", "--dataset", write(tmp_path / "m.jsonl", MATH_500 * 4), "--prompt_column",
                    "problem", "--answer_check", "math", "--format_reward_weight", "0.5", "--async_rollouts", "1",
                    "--num_steps", "2", "--batch_size", "4", "--num_generations", "2", "--max_new_tokens", "4",
                    "--eval_size", "2", "--eval_every", "100", "--log_rollouts", "0", "--save_model", "False",
                    "--output_dir", str(tmp_path / "run")])
    trained = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/reward" in r]
    assert len(trained) == 2 and all(r["train/answer_timeouts"] == 0 and "train/reward/format" in r for r in trained)
