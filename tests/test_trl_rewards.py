"""Reward functions written for TRL's GRPOTrainer run here unchanged: TRL's documented examples (written out below
from TRL's docs, not imported from TRL) receive the keywords TRL passes (prompts, completions, completion_ids,
trainer_state and every column but the prompt's), conversational completions as messages, None where a function
does not apply, and `async def` functions awaited; two short runs train on them, one on a conversational
dataset. A function whose parameters cannot take those keywords stops the run before any model loads."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from accelerate import Accelerator
from transformers import AutoTokenizer

from lab import config as lab_config
from lab import tasks
from support import config
from support.reward_functions import Completion, reward_kwargs, trainer_state
from support.run import read_metrics
from conftest import ROOT

CPU = Accelerator(cpu=True)

# TRL's documented reward functions (its GRPO Trainer page, "Using a custom reward function", and the quick
# start's reward_len), one per name
TRL_EXAMPLES = r'''
import asyncio
import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def reward_token_count(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def reward_char_count(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def conversational_length_reward(prompts, completions, **kwargs):
    """Reward function that gives higher scores to longer completion content."""
    completion_contents = [completion[0]["content"] for completion in completions]
    return [float(len(content)) for content in completion_contents]


def boxed_reward(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if completion.strip() == str(eval(prompt.rstrip("="))) else -1.0)
        else:
            rewards.append(None)  # Return None for non-math tasks
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


def curriculum_reward(completions, trainer_state, **kwargs):
    # reads the trainer's progress, as a curriculum does
    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]
'''
STANDARD = ["reward_len", "reward_token_count", "reward_char_count", "boxed_reward", "math_reward_func",
            "async_reward_func", "curriculum_reward"]
CONVERSATIONAL = ["format_reward_func", "conversational_length_reward", "async_reward_func", "curriculum_reward"]
ROWS = [{"prompt": "12+3=", "ground_truth": "15", "task": "math"},
        {"prompt": "7*8=", "ground_truth": "56", "task": "code"}]


@pytest.fixture
def examples_file(tmp_path):
    path = tmp_path / "trl_examples.py"
    path.write_text(TRL_EXAMPLES)
    return str(path)


def reward_fn(examples_file, names, **flags):
    cfg = lab_config.LabConfig(reward_fn=[f"{examples_file}:{name}" for name in names], rule_reward_weight=0.0,
                             **flags)
    return tasks.make_reward_fn(cfg, CPU)


def test_trls_examples_get_trls_keywords_and_give_their_documented_values(examples_file):
    examples = [{"prompt": r["prompt"], "answer": None, "family": "all", "row": r} for r in ROWS]
    completions = [Completion("15", [4, 8, 1]), Completion(r"\boxed{5}", [16, 1])]
    trainer_state().global_step = 50
    fn = reward_fn(examples_file, STANDARD, num_steps=200)
    rewards, _, stats = fn(examples, completions)
    assert stats == {"train/reward/reward_len": (-18 - 11) / 2, "train/reward/reward_token_count": 2.5,
                     "train/reward/reward_char_count": 5.5, "train/reward/boxed_reward": 0.0,
                     "train/reward/math_reward_func": 1.0,  # 12+3 = 15; the code row is None, left out
                     "train/reward/async_reward_func": 1.0, "train/reward/curriculum_reward": 0.25}
    assert rewards.tolist() == [-18 + 3 + 2 + 0 + 1 + 1 + 0.25, -11 + 2 + 9 + 0 + 0 + 1 + 0.25]


def test_a_conversation_gets_its_messages_and_completions_as_assistant_messages():
    cfg = lab_config.LabConfig()
    prompt = [{"role": "user", "content": "12+3="}]
    examples = [{"prompt": "12+3=", "raw_prompt": prompt, "answer": None, "family": "all",
                 "row": {"prompt": prompt, "task": "math"}}]
    kwargs = reward_kwargs(cfg, examples, [Completion("<think>1</think><answer>15</answer>", [4, 1])])
    assert kwargs["prompts"] == [prompt] and kwargs["task"] == ["math"] and "prompt" not in kwargs
    assert kwargs["completions"] == [[{"role": "assistant", "content": "<think>1</think><answer>15</answer>"}]]
    assert kwargs["completion_ids"] == [[4, 1]] and kwargs["trainer_state"] is trainer_state()


def chat_model(folder):
    """The embedded model with a chat template that writes each message's content (its character-level tokenizer
    knows no other characters)."""
    shutil.copytree(config.EMBEDDED_MODEL, folder, ignore=shutil.ignore_patterns("*.py", "*.json.log"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    return str(folder)


def train(tmp_path, rows, names, *args):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trl_examples.py").write_text(TRL_EXAMPLES)
    cmd = [sys.executable, "lab/grpo.py", "--num_steps", "2", "--batch_size", "16", "--num_generations", "4",
           "--max_new_tokens", "4", "--eval_every", "100", "--eval_size", "4", "--save_model", "False",
           "--dataset", str(data), "--prompt_column", "prompt", "--answer_column", "", "--rule_reward_weight", "0",
           "--output_dir", str(tmp_path / "run"), *args]
    for name in names:
        cmd += ["--reward_fn", f"{tmp_path / 'trl_examples.py'}:{name}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def sums(n):
    return [(f"{a}+{b}=", str(a + b)) for a, b in zip(range(10, 10 + n), range(1, 1 + n))]


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_trls_examples_train_unchanged(tmp_path, kind):
    if kind == "standard":
        rows = [{"prompt": p, "ground_truth": a, "task": ["code", "math"][i % 2]} for i, (p, a) in enumerate(sums(12))]
        out, names = train(tmp_path, rows, STANDARD), STANDARD
    else:
        rows = [{"prompt": [{"role": "user", "content": p}], "ground_truth": a} for p, a in sums(12)]
        out, names = train(tmp_path, rows, CONVERSATIONAL, "--model_name_or_path", chat_model(tmp_path / "m")), \
            CONVERSATIONAL
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for name in names:
        assert all(f"train/reward/{name}" in r for r in steps), name
    assert [r["train/reward/curriculum_reward"] for r in steps] == [0 / 2, 1 / 2]  # global_step: the steps done
    assert steps[0]["train/grad_norm"] > 0


def test_a_function_whose_parameters_cannot_take_the_keywords_stops_before_any_model_loads(tmp_path):
    (tmp_path / "old.py").write_text("def positional(prompt, completion):\n    return [0.0] * len(completion)\n")
    cmd = [sys.executable, "lab/remax.py", "--reward_fn", f"{tmp_path / 'old.py'}:positional", "--output_dir",
           str(tmp_path / "run")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1 and not (tmp_path / "run" / "metrics.jsonl").exists()  # no eval 0: no model loaded
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: --reward_fn positional cannot be called as a reward function is"), error
    assert "def positional(completions, **kwargs)" in error, error


def test_a_function_that_fails_on_the_first_rows_stops_before_any_model_loads(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def half(completions, **kwargs):\n    return [1.0] * (len(completions) // 2)\n")
    with pytest.raises(SystemExit, match=r"^error: --reward_fn half returned 2 values for 4 completions: .* tried "
                                         "before any model loads on the first 4 train rows"):
        tasks.load_task(lab_config.LabConfig(reward_fn=[f"{path}:half"]))
    cfg = lab_config.LabConfig(reward_fn=["examples/rewards.py:format_reward"])  # ours pass: the check is silent
    assert len(tasks.load_task(cfg)[0]) == 20_000
