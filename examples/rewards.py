"""Two reward functions to give a training script with --reward_fn FILE.py:NAME (docs/your_task.md).

A reward function is called as TRL's GRPOTrainer calls one, with keywords, each a list with one value per
completion: prompts (the dataset's prompt, before any chat template), completions (decoded text),
completion_ids, every other column of the dataset, and trainer_state. It returns one float per completion, or
None where it does not apply (None adds nothing to the reward and is left out of the function's logged mean,
train/reward/<name>). Its values are added to the rule reward, each function weighted by --reward_weights.

    python lab/grpo.py --dataset my_data.jsonl --reward_fn examples/rewards.py:format_reward \\
        --reward_fn examples/rewards.py:length_reward --reward_weights 0.5 0.1 \\
        --system_prompt "Reason inside <think></think>, then give the answer inside <answer></answer>."
"""
import re

# DeepSeek-R1's output format: the reasoning in <think> tags, then the answer in <answer> tags
THINK_THEN_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
MAX_CHARS = 400  # length_reward reaches -1 at this many characters


def format_reward(prompts, completions, **columns):
    """1.0 for a completion that is '<think>...</think><answer>...</answer>' and nothing else, else 0.0.
    With --answer_check number the rule reward still reads the last number, the one inside <answer>."""
    return [1.0 if THINK_THEN_ANSWER.fullmatch(completion) else 0.0 for completion in completions]


def length_reward(prompts, completions, **columns):
    """-len(completion) / MAX_CHARS, at least -1: a linear length penalty. Weigh it small beside the
    correctness reward (--reward_weights 0.1): it should break ties between right answers, not make a short
    wrong answer beat a long right one."""
    return [-min(len(completion), MAX_CHARS) / MAX_CHARS for completion in completions]
