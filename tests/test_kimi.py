"""Kimi k1.5 (docs/algorithms.md#kimi-k15): the length reward over a prompt's samples, prioritised sampling's
weights, and the lab's --length_penalty flag."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

from kimi import length_reward, priority_weights  # noqa: E402
from lab import grpo as lab_grpo  # noqa: E402


def test_length_reward_is_lambda_for_a_right_answer_and_min_zero_lambda_for_a_wrong_one_within_each_group():
    lengths = torch.tensor([2, 4, 6, 4, 3, 3, 3, 3, 1, 5, 5, 5])
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0])
    reward = length_reward(lengths, correct, group_size=4)
    # group 1: lam = 0.5 - (len - 2) / 4 = 0.5, 0, -0.5, 0: right 0.5, 0; wrong min(0, -0.5), min(0, 0)
    # group 2: all lengths equal: 0 for all; group 3: lam 0.5, -0.5, -0.5, -0.5: the short wrong answer gets 0
    expected = [0.5, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert reward.tolist() == expected


def test_length_reward_ranges_from_half_for_the_shortest_to_minus_half_for_the_longest_right_answer():
    lengths = torch.tensor([10, 20, 30, 40, 50])
    reward = length_reward(lengths, torch.ones(5), group_size=5)
    torch.testing.assert_close(reward, torch.tensor([0.5, 0.25, 0.0, -0.25, -0.5]))


def test_priority_weights_are_proportional_to_one_minus_the_success_rate():
    weights = priority_weights(torch.tensor([0.0, 0.5, 1.0, 0.75]))
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.5, 0.0, 0.25], dtype=torch.float64) / 1.75)
    # every prompt solved: nothing to prefer, uniform
    assert priority_weights(torch.ones(4)).tolist() == [0.25] * 4


def test_length_penalty_needs_each_prompts_samples_in_one_group():
    with pytest.raises(ValueError, match="--length_penalty"):
        lab_grpo.Config(length_penalty=0.1, budget="knapsack")
    with pytest.raises(ValueError, match="--length_penalty"):
        lab_grpo.Config(length_penalty=-1.0)


def test_prioritised_prompts_draw_by_one_minus_the_success_rate_and_never_a_solved_prompt_while_others_remain():
    from lab.priority import PrioritisedPrompts
    rates = {"a": 1.0, "b": 1.0, "c": 0.5}  # d, e, f: no rate yet, s = 0
    examples = [{"prompt": p} for p in "abcdef"]
    prompts = PrioritisedPrompts(examples, 3, seed=0, rate=lambda p: rates.get(p, float("nan")))
    torch.testing.assert_close(prompts.weights(), torch.tensor([0, 0, 0.5, 1, 1, 1], dtype=torch.float64) / 3.5)
    for _ in range(20):
        batch = [ex["prompt"] for ex in prompts.next()]
        assert len(set(batch)) == 3 and not {"a", "b"} & set(batch)
    state = prompts.state_dict()  # a resumed run draws what the run would have drawn
    following = [prompts.next() for _ in range(3)]
    prompts.load_state_dict(state)
    assert [prompts.next() for _ in range(3)] == following


def test_prompt_sampling_priority_draws_by_the_knapsacks_success_rates():
    """--prompt_sampling priority: budget.BudgetSampler draws with the success rates it keeps for the knapsack;
    with all but 4 of 40 prompts solved (8 right answers each), a step's 4 prompts are those 4."""
    from lab import budget
    from support import tasks
    examples = tasks.arithmetic_examples(40, seed=0, held_out=False)
    sampler = budget.BudgetSampler(examples, lab_grpo.Config(batch_size=16, num_generations=4,
                                                             prompt_sampling="priority"))
    unsolved = {ex["prompt"] for ex in examples[:4]}
    for ex in examples[4:]:
        sampler.rates.record(ex["prompt"], [1] * 8)
    for _ in range(3):
        batch, num_samples = sampler.next()
        assert {ex["prompt"] for ex in batch} == unsolved and num_samples == 4
