"""Kimi k1.5 (docs/algorithms.md#kimi-k15): the length reward over a prompt's samples, prioritised sampling's
weights, curriculum sampling's window, and the lab's --length_penalty, --prompt_sampling and --difficulty_column."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

from kimi import curriculum_weights, length_reward, priority_weights  # noqa: E402
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


def test_length_reward_of_lengths_closer_than_one_is_the_same_formula():
    """Non-integer lengths whose spread is below 1: [0.2, 0.4, 0.6] is [2, 4, 6] scaled, so 0.5, 0, -0.5 (a spread
    clamped to at least 1 would give 0.5, 0.3, 0.1)."""
    reward = length_reward(torch.tensor([0.2, 0.4, 0.6]), torch.ones(3), group_size=3)
    torch.testing.assert_close(reward, torch.tensor([0.5, 0.0, -0.5]))


@pytest.mark.parametrize("rate", [float("nan"), -0.1, 1.5])
def test_priority_weights_refuse_a_rate_that_is_not_a_probability(rate):
    with pytest.raises(ValueError, match="success rate .* at prompt 1"):
        priority_weights(torch.tensor([0.5, rate, 0.0]))


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


def test_curriculum_weights_are_uniform_over_a_window_of_the_sorted_prompts_moving_from_easiest_to_hardest():
    difficulty = torch.tensor([3, 1, 2, 1])  # sorted, ties in order: indices 1, 3, 2, 0
    # 1 prompt a draw, 2 draws: w = max(1, ceil(4 / 2)) = 2, start = t (4 - 2) // 1: the two 1s, then the 2 and the 3
    assert curriculum_weights(difficulty, 0, 2, 1).tolist() == [0, 0.5, 0, 0.5]
    assert curriculum_weights(difficulty, 1, 2, 1).tolist() == [0.5, 0, 0.5, 0]
    assert curriculum_weights(difficulty, 7, 2, 1).tolist() == [0.5, 0, 0.5, 0]  # past the last draw: the hardest
    assert curriculum_weights(difficulty, 0, 1, 1).tolist() == [0.25] * 4  # one draw: every prompt
    # ties keep the given order: [1, 1, 1, 0] sorts to indices 3, 0, 1, 2; w = 1, start = t (4 - 1) // 3 = t
    assert [curriculum_weights(torch.tensor([1, 1, 1, 0]), t, 4, 1).argmax().item() for t in range(4)] == [3, 0, 1, 2]
    # 7 prompts (difficulty = index), 2 a draw, 3 draws: w = max(2, ceil(7 / 3)) = 3, start = t (7 - 3) // 2 = 2 t
    windows = [curriculum_weights(torch.arange(7.0), t, 3, 2).nonzero().flatten().tolist() for t in range(3)]
    assert windows == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    # 10 prompts, 2 a draw, 5 draws: w = 2, start = t 8 // 4 = 2 t: disjoint windows, each drawn whole
    windows = [curriculum_weights(torch.arange(10.0, 0, -1), t, 5, 2).nonzero().flatten().tolist() for t in range(5)]
    assert windows == [[8, 9], [6, 7], [4, 5], [2, 3], [0, 1]]


def curriculum_examples():
    """12 examples in three levels of 4 (the level in the dataset row's 'level' column), hardest first."""
    return [{"prompt": f"p{i}", "row": {"level": 2 - i // 4}} for i in range(12)]


def test_curriculum_prompts_draw_the_easy_level_first_then_harder_and_resume_where_they_were():
    from lab.priority import CurriculumPrompts
    prompts = CurriculumPrompts(curriculum_examples(), 2, seed=0, column="level", num_draws=3)
    # w = max(2, ceil(12 / 3)) = 4 = one level, start = 4 t: level 0, then 1, then 2 (and 2 from then on)
    levels = [sorted({ex["row"]["level"] for ex in prompts.next()}) for _ in range(4)]
    assert levels == [[0], [1], [2], [2]]
    state = prompts.state_dict()
    following = [prompts.next() for _ in range(3)]
    resumed = CurriculumPrompts(curriculum_examples(), 2, seed=0, column="level", num_draws=3)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(3)] == following


def test_prompt_sampling_curriculum_needs_a_difficulty_column_that_the_dataset_holds_as_numbers(tmp_path):
    from lab import budget, priority
    from support import tasks
    with pytest.raises(ValueError, match="--difficulty_column"):
        lab_grpo.Config(prompt_sampling="curriculum")
    with pytest.raises(ValueError, match="--difficulty_column"):
        lab_grpo.Config(difficulty_column="level")
    cfg = lab_grpo.Config(prompt_sampling="curriculum", difficulty_column="level", batch_size=8, num_generations=4,
                          num_steps=3)
    with pytest.raises(SystemExit, match="has no column --difficulty_column 'level'"):
        priority.check_difficulty(cfg, tasks.arithmetic_examples(4, seed=0, held_out=False))
    with pytest.raises(SystemExit, match="row 2: --difficulty_column 'level' holds 'x', not a number"):
        priority.check_difficulty(cfg, [{"prompt": "a", "row": {"level": 1}}, {"prompt": "b", "row": {"level": "x"}}])
    priority.check_difficulty(cfg, curriculum_examples())  # numbers: no error
    data = tmp_path / "levels.jsonl"  # a local file's column reaches the check through its rows
    data.write_text("".join(f'{{"question": "{i}+1=", "answer": "{i + 1}", "level": {i % 3}}}\n' for i in range(4)))
    train, _ = tasks.load_task(lab_grpo.Config(dataset=str(data), eval_size=1))
    priority.check_difficulty(cfg, train)
    with pytest.raises(SystemExit, match=r"has no column --difficulty_column 'lvl'; its columns are \['answer', 'lev"):
        priority.check_difficulty(lab_grpo.Config(prompt_sampling="curriculum", difficulty_column="lvl"), train)
    sampler = budget.BudgetSampler(curriculum_examples(), cfg)  # 2 prompts a step, 4 samples each
    assert [sorted({ex["row"]["level"] for ex in sampler.next()[0]}) for _ in range(3)] == [[0], [1], [2]]
