"""Exploration budgets (docs/algorithms.md, "Exploration budgets"): the knapsack value and allocation against brute
force, the group baselines by group id against the fixed-G ones, TreePO's advantage on hand-built trees, the
sampler, and runs of the three group methods with --budget knapsack."""
import itertools
import math
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

import dapo  # noqa: E402
import exploration  # noqa: E402
import grpo  # noqa: E402
import rloo  # noqa: E402
from conftest import launch_two_processes, run_main  # noqa: E402
from lab import grpo as lab_grpo  # noqa: E402  (the lab's Config: --budget and --sampler)
from exploration import knapsack_allocation, knapsack_value  # noqa: E402
from lab import budget, tree
from support import tasks  # noqa: E402
from support.run import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
EPS = 1e-6


# ---------------------------------------------------------------- the knapsack

def test_knapsack_value_is_the_chance_of_a_mixed_group_times_p_one_minus_p_squared():
    # p = 1/2, n = 2: a mixed pair with chance 1/2, information 1/2 * 1/4
    assert knapsack_value(2, 0.5) == 0.0625
    # p = 0.9, n = 3: 1 - 0.729 - 0.001 = 0.27, times 0.9 * 0.01
    assert math.isclose(knapsack_value(3, 0.9), 0.27 * 0.009, rel_tol=1e-12)
    # all right or all wrong: no n gives a gradient
    assert knapsack_value(7, 0.0) == 0 and knapsack_value(7, 1.0) == 0


def brute_force_best(rates, budget, min_n, max_n):
    """The largest sum_i V(n_i, p_i) over every allocation with n_i in [min_n, max_n] summing to budget."""
    sizes = range(min_n, max_n + 1)
    return max(sum(knapsack_value(n, p) for n, p in zip(alloc, rates))
               for alloc in itertools.product(sizes, repeat=len(rates)) if sum(alloc) == budget)


@pytest.mark.parametrize("seed", range(30))
def test_knapsack_allocation_reaches_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    P, min_n = rng.randint(1, 4), rng.randint(1, 2)
    max_n = rng.randint(min_n + 1, 7)
    rates = [rng.choice([rng.random(), rng.randint(1, 7) / 8]) for _ in range(P)]  # in (0, 1): all useful
    budget = rng.randint(P * min_n, P * max_n)
    alloc = knapsack_allocation(rates, budget, min_n, max_n)
    assert sum(alloc) == budget and all(min_n <= n <= max_n for n in alloc)
    value = sum(knapsack_value(n, p) for n, p in zip(alloc, rates))
    assert math.isclose(value, brute_force_best(rates, budget, min_n, max_n), rel_tol=1e-12, abs_tol=1e-15)


def test_knapsack_gives_the_hard_but_not_hopeless_prompt_the_samples():
    # budget 8, n in [2, 6]: V(n, 0.5) = (1 - 2 / 2^n) / 8 grows far more than V(n, 0.9) = 0.009 (1 - 0.9^n - 0.1^n):
    # (6, 2) gives 0.12109 + 0.00162 = 0.12271, (5, 3) 0.11719 + 0.00243 = 0.11962, (4, 4) 0.10938 + 0.00309
    assert knapsack_allocation([0.5, 0.9], 8, 2, 6) == [6, 2]
    assert knapsack_allocation([0.9, 0.5], 8, 2, 6) == [2, 6]


def test_unseen_prompts_get_the_uniform_share_and_all_equal_ones_the_minimum():
    assert knapsack_allocation([math.nan] * 4, 32, 2, 16) == [8, 8, 8, 8]
    # unseen: 8; all wrong and all right: 2; without the fallback the p = 1/2 prompt takes the rest (20) up to
    # max_n = 16, and the 4 left go to the all-wrong prompt, where a first success would be found
    assert knapsack_allocation([0.0, 1.0, 0.5, math.nan], 32, 2, 16, fallback=False) == [6, 2, 16, 8]
    # nothing useful: the all-wrong ones in turn up to max_n, then the unseen, then the all-right
    assert knapsack_allocation([0.0, 1.0, 0.0], 12, 2, 5) == [5, 2, 5]
    assert knapsack_allocation([1.0, math.nan, 0.0], 15, 2, 5) == [5, 5, 5]
    assert knapsack_allocation([1.0, math.nan, 1.0], 12, 2, 5) == [4, 5, 3]


def test_the_fallback_gives_what_a_useful_prompt_cannot_use_to_the_all_wrong_ones_first():
    # p = 1/2 can use 2 + floor(ln 0.1 / ln 0.5) = 2 + floor(3.32) = 5 samples; the 64 - 5 - 7 x 2 = 45 beyond go to
    # the 7 all-wrong prompts in turn (6 each, 3 of them one more); without the fallback the knapsack takes 32
    rates = [0.5, 0, 0, 0, 0, 0, 0, 0]
    assert knapsack_allocation(rates, 64, 2, 32) == [5, 9, 9, 9, 8, 8, 8, 8]
    assert knapsack_allocation(rates, 64, 2, 32, fallback=False) == [32, 5, 5, 5, 5, 4, 4, 4]
    # the all-wrong prompt fills to max_n = 16 (14 of the 15 beyond); the one it cannot take goes back to the
    # knapsack, none is lost: the p = 1/2 prompt gets 5 + 1
    assert knapsack_allocation([0.0, 1.0, 0.5, math.nan], 32, 2, 16) == [16, 2, 6, 8]
    # no all-wrong prompt: the fallback has nowhere to send the budget and the knapsack spends it as before
    assert knapsack_allocation([0.5, 1.0], 20, 2, 16) == knapsack_allocation([0.5, 1.0], 20, 2, 16, fallback=False)
    rng = random.Random(0)
    for _ in range(200):  # every budget spent, within the bounds
        rates = [rng.choice([0.0, 1.0, math.nan, rng.random()]) for _ in range(rng.randint(1, 6))]
        budget = rng.randint(2 * len(rates), 12 * len(rates))
        alloc = knapsack_allocation(rates, budget, 2, 12)
        assert sum(alloc) == budget and all(2 <= n <= 12 for n in alloc)


def test_an_allocation_that_cannot_fit_the_bounds_is_refused():
    with pytest.raises(ValueError, match="cannot give 4 prompts"):
        knapsack_allocation([0.5] * 4, 7, 2, 8)
    with pytest.raises(ValueError, match="cannot give 4 prompts"):
        knapsack_allocation([0.5] * 4, 33, 2, 8)


# ---------------------------------------------------------------- groups of different sizes

def test_group_ids_start_a_group_where_the_example_object_changes():
    a, b = {"prompt": "1+1="}, {"prompt": "2+2="}
    again = dict(a)  # the same prompt drawn twice: two groups
    assert exploration.group_ids([a, a, b, b, b, again, again]).tolist() == [0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_by_group_id_equals_grpo_advantages_when_every_group_has_g_rows(scale_rewards):
    G, P = 4, 6
    ids = torch.arange(P).repeat_interleave(G)
    for rewards in (torch.randn(P * G, generator=torch.Generator().manual_seed(0)),
                    torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 2, 2, 2, 2, 0, 1, 0, 1])):
        expected = grpo.grpo_advantages(rewards, G, scale_rewards)
        torch.testing.assert_close(exploration.grpo_advantages_by_group(rewards, ids, scale_rewards), expected)
        torch.testing.assert_close(dapo.grpo_advantages(rewards, G, scale_rewards), expected)  # dapo.py's copy


def test_rloo_and_dapos_filter_by_group_id_equal_theirs_when_every_group_has_g_rows():
    G, P = 3, 5
    ids = torch.arange(P).repeat_interleave(G)
    rewards = torch.randn(P * G, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(exploration.rloo_advantages_by_group(rewards, ids), rloo.rloo_advantages(rewards, G))
    correct = torch.tensor([1.0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 0])
    assert (~exploration.all_equal(correct, ids)).tolist() == \
        dapo.dynamic_sampling_filter(correct, G).tolist() == [True, False, False, True, True]


def test_group_baselines_of_groups_of_two_three_and_one():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=F64)
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    # group 0: mean 1/2, Bessel std sqrt(1/2); group 1: mean 2/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = sqrt(1/3);
    # the group of one has no baseline: 0
    s0, s1 = math.sqrt(0.5), math.sqrt(1 / 3)
    expected = [0.5 / (s0 + EPS), -0.5 / (s0 + EPS), 1 / 3 / (s1 + EPS), 1 / 3 / (s1 + EPS), -2 / 3 / (s1 + EPS), 0]
    torch.testing.assert_close(exploration.grpo_advantages_by_group(rewards, ids), torch.tensor(expected, dtype=F64))
    torch.testing.assert_close(exploration.grpo_advantages_by_group(rewards, ids, "none"),
                               torch.tensor([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 0], dtype=F64))
    # leave-one-out: the other member; the mean of the other two
    torch.testing.assert_close(exploration.rloo_advantages_by_group(rewards, ids),
                               torch.tensor([1.0, -1.0, 0.5, 0.5, -1.0, 0.0], dtype=F64))
    assert exploration.all_equal(rewards, ids).tolist() == [False, False, True]


def test_group_metrics_count_zero_std_groups_effective_rows_and_sizes():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    adv = exploration.grpo_advantages_by_group(rewards, ids)
    metrics = exploration.group_metrics(rewards, adv, ids)
    assert metrics["train/frac_zero_std_groups"].item() == pytest.approx(2 / 3)
    assert metrics["train/effective_samples"].item() == 3  # the mixed group's rows
    assert (metrics["train/group_size_min"].item(), metrics["train/group_size_max"].item()) == (2, 3)


# ---------------------------------------------------------------- TreePO

def test_tree_advantage_averages_the_leafs_advantage_in_each_ancestors_subtree():
    # root -> A (leaves 0, 1), B (leaves 2, 3); rewards 1, 0, 0, 0
    # root: mean 1/4 -> 3/4, -1/4, -1/4, -1/4; A: mean 1/2 -> 1/2, -1/2; B: mean 0 -> 0, 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    ancestors = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 2]])
    torch.testing.assert_close(exploration.tree_advantages(rewards, ancestors),
                               torch.tensor([0.625, -0.375, -0.125, -0.125], dtype=F64))
    # standardised in each sub-group: root std 1/2 (Bessel); A std sqrt(1/2); B all equal: 0
    s = math.sqrt(0.5)
    expected = [(0.75 / (0.5 + EPS) + 0.5 / (s + EPS)) / 2, (-0.25 / (0.5 + EPS) - 0.5 / (s + EPS)) / 2,
                -0.25 / (0.5 + EPS) / 2, -0.25 / (0.5 + EPS) / 2]
    torch.testing.assert_close(exploration.tree_advantages(rewards, ancestors, "group"),
                               torch.tensor(expected, dtype=F64))


def test_a_leaf_that_ended_early_averages_over_its_fewer_ancestors():
    # root -> A (ended after its first segment: a leaf), B -> leaves 1, 2; rewards 1, 0, 1
    # leaf A: root only: 1 - 2/3 = 1/3; leaves 1, 2: root (-2/3, 1/3) and B (mean 1/2: -1/2, 1/2)
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    ancestors = torch.tensor([[0, -1], [0, 2], [0, 2]])
    torch.testing.assert_close(exploration.tree_advantages(rewards, ancestors),
                               torch.tensor([1 / 3, (-2 / 3 - 0.5) / 2, (1 / 3 + 0.5) / 2], dtype=F64))


def test_a_tree_of_depth_one_is_grpos_group():
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(2))
    ancestors = torch.arange(3).repeat_interleave(4)[:, None]
    torch.testing.assert_close(exploration.tree_advantages(rewards, ancestors, "group"),
                               grpo.grpo_advantages(rewards, 4))


class ScriptedCache:
    """Each row's path (the copy it is at each fork: a reorder with repeated rows) and its tokens so far."""

    def __init__(self, n):
        self.paths, self.lengths = [()] * n, [0] * n

    def reorder_cache(self, index):
        index, copies = index.tolist(), {}
        fork = len(set(index)) < len(index)
        paths = []
        for i in index:
            copies[i] = copies.get(i, -1) + 1
            paths.append(self.paths[i] + (copies[i],) if fork else self.paths[i])
        self.paths, self.lengths = paths, [self.lengths[i] for i in index]


class ScriptedModel(torch.nn.Module):
    """A model whose next token is script(path, t) for a row at its t-th completion token (certain: one-hot
    logits); it counts the completion tokens it decodes (the forwards of one token per row)."""

    def __init__(self, script, vocab=10):
        super().__init__()
        self.script, self.vocab, self.decoded = script, vocab, 0
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, position_ids, cache=None, use_cache=True, logits_to_keep=1):
        if cache is None:  # the prompt's pass
            cache = ScriptedCache(len(input_ids))
            return SimpleNamespace(logits=torch.zeros(len(input_ids), 1, self.vocab), cache=cache)
        self.decoded += len(input_ids)
        logits = torch.full((len(input_ids), 1, self.vocab), -1e9)
        for row, (path, t) in enumerate(zip(cache.paths, cache.lengths)):
            logits[row, 0, self.script(path, t)] = 0.0
        cache.lengths = [t + 1 for t in cache.lengths]
        return SimpleNamespace(logits=logits, cache=cache)


TREE_CFG = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6, segment_len=2, branching=2, depth=2)
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)


def scripted_tree(script, num_prompts=2):
    model = ScriptedModel(script)
    prompt_ids, prompt_mask = torch.tensor([[5, 6, 7]] * num_prompts), torch.ones(num_prompts, 3, dtype=torch.long)
    ids, decoded = tree.tree_generate(model, TOKENIZER, prompt_ids, prompt_mask, TREE_CFG, num_samples=4)
    return ids, decoded, model.decoded


def test_the_tree_sampler_forks_shares_prefixes_and_hands_an_early_leafs_share_to_its_relatives():
    """G = 4 = 2^2, segments of 2 tokens: the root forks into copies 0 and 1; copy 1 ends after its first segment
    (3, EOS), so copy 0 grows its 2 leaves and the 1 copy 1 would have grown: 3 children at the last fork, each
    writing its copy number + 2 and then EOS."""
    def script(path, t):
        if path == (1,) and t == 1 or len(path) == 2 and t == 3:
            return 1  # EOS
        return 2 + path[-1]
    ids, decoded, counted = scripted_tree(script)
    group = [[2, 2, 2, 1], [2, 2, 3, 1], [2, 2, 4, 1], [3, 1, 0, 0]]
    assert ids.tolist() == group + group
    # per prompt: 2 branches x 2 tokens, then 3 x 2: 10 tokens, against 4 + 4 + 4 + 2 = 14 decoded one by one
    assert decoded == counted == 2 * 10
    mask = torch.tensor([[1, 1, 1, 1]] * 3 + [[1, 1, 0, 0]])
    ancestors = exploration.tree_ancestors(torch.cat([ids[:4]] * 1), mask.sum(1), torch.zeros(4, dtype=torch.long),
                                           segment_len=2, depth=2)
    assert ancestors.tolist() == [[0, 0], [0, 0], [0, 0], [0, -1]]  # the (2, 2) node holds the three long leaves
    # rewards 1, 0, 0 below (2, 2) and 1 for (3, EOS): root mean 1/2, node mean 1/3
    adv = exploration.tree_advantages(torch.tensor([1.0, 0, 0, 1], dtype=F64), ancestors)
    torch.testing.assert_close(adv, torch.tensor([(0.5 + 2 / 3) / 2, (-0.5 - 1 / 3) / 2, (-0.5 - 1 / 3) / 2, 0.5],
                                                 dtype=F64))


def test_a_tree_whose_branches_all_end_early_is_filled_from_the_prompt():
    ids, decoded, counted = scripted_tree(lambda path, t: 1 if t == 1 else 2 + path[-1], num_prompts=1)
    assert ids.tolist() == [[2, 1], [3, 1], [2, 1], [3, 1]]  # the tree's 2 leaves, then 2 more from the prompt
    assert decoded == counted == 8


def test_tree_ancestors_merge_equal_siblings_and_drop_nodes_that_do_not_split():
    ids = torch.tensor([[4, 4, 5], [4, 4, 6], [4, 4, 7], [4, 4, 8], [4, 5, 5], [4, 5, 6], [3, 1, 0], [3, 3, 1]])
    lengths = torch.tensor([3, 3, 3, 3, 3, 3, 2, 3])
    groups = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0])
    # after 1 token: (4) holds 6 leaves, (3) 2 leaves; after 2: (4, 4) 4 leaves, (4, 5) 2, (3, 3) 1 (not a split)
    ancestors = exploration.tree_ancestors(ids, lengths, groups, segment_len=1, depth=3)
    a, c = ancestors[0, 1].item(), ancestors[6, 1].item()
    b, d = ancestors[0, 2].item(), ancestors[4, 2].item()
    assert ancestors.tolist() == [[0, a, b]] * 4 + [[0, a, d]] * 2 + [[0, c, -1], [0, c, -1]]
    assert len({a, c}) == 2 and len({b, d}) == 2


# ---------------------------------------------------------------- the sampler

def sampler_config(**flags):
    return lab_grpo.Config(batch_size=16, num_generations=4, **flags)


def test_the_uniform_sampler_draws_the_prompt_samplers_prompts_with_g_samples_each():
    examples = tasks.arithmetic_examples(40, seed=0, held_out=False)
    plain, ours = tasks.PromptSampler(examples, 4, 0), budget.BudgetSampler(examples, sampler_config())
    for _ in range(15):
        batch, num_samples = ours.next()
        assert num_samples == 4 and batch == plain.next()


def test_a_success_rate_is_trusted_after_8_answers_and_reads_the_latest_16_across_visits():
    rates = budget.SuccessRates()
    rates.record("1+1=", [0, 0])
    assert math.isnan(rates.rate("1+1=")) and math.isnan(rates.rate("2+2="))  # 2 answers, and none: not trusted
    rates.record("1+1=", [1] * 6)
    assert rates.rate("1+1=") == 6 / 8
    rates.record("1+1=", [1] * 10)  # 18 answers: the two first wrong ones fall out of the latest 16
    assert rates.rate("1+1=") == 1.0
    again = budget.SuccessRates()
    again.load_state_dict(rates.state_dict())
    assert again.answers == rates.answers


def test_the_knapsack_sampler_allocates_from_each_prompts_answers_across_visits():
    examples = tasks.arithmetic_examples(4, seed=0, held_out=False)
    sampler = budget.BudgetSampler(examples, sampler_config(budget="knapsack", min_n=2, max_n=8))
    # outcomes per prompt: all wrong, all right, 2 of 4, 1 of 4
    outcomes = dict(zip([ex["prompt"] for ex in examples], [[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 1, 0, 0]]))
    for visit in range(2):  # 4 answers a visit: a prompt is trusted after two
        batch, num_samples = sampler.next()  # not trusted yet: 4 each
        assert num_samples == 1 and len(batch) == 16
        groups = exploration.group_ids(batch)
        assert torch.bincount(groups).tolist() == [4, 4, 4, 4]
        correct = torch.tensor([float(r) for ex in batch[::4] for r in outcomes[ex["prompt"]]])
        groups_back, subgroups = sampler.record(SimpleNamespace(examples=batch), correct)
        assert groups_back.tolist() == groups.tolist() and subgroups.tolist() == groups.tolist()
    rates = {prompt: sum(rights) / 4 for prompt, rights in outcomes.items()}
    assert {prompt: sampler.rates.rate(prompt) for prompt in outcomes} == rates
    batch, _ = sampler.next()  # the next epoch: the same 4 prompts, in another order
    prompts = [ex["prompt"] for ex in batch]
    order = list(dict.fromkeys(prompts))
    sizes = {p: prompts.count(p) for p in order}
    assert list(sizes.values()) == knapsack_allocation([rates[p] for p in order], 16, 2, 8)
    # all right and all wrong: 2 each; 1/2 and 1/4 can use 2 + 3 and 2 + 8 (more than the 12 left): no fallback,
    # they share 12, at most 8 each: V(5, 1/2) + V(7, 1/4) = 0.11719 + 0.12185 = 0.23903 beats (4, 8): 0.10938 +
    # 0.12655 = 0.23592 and (6, 6): 0.12109 + 0.11556 = 0.23666
    assert {rates[p]: n for p, n in sizes.items()} == {0.0: 2, 1.0: 2, 0.5: 5, 0.25: 7}
    state = sampler.state_dict()
    again = budget.BudgetSampler(examples, sampler_config(budget="knapsack", min_n=2, max_n=8))
    again.load_state_dict(state)
    assert again.rates.answers == sampler.rates.answers and again.next() == sampler.next()


# ---------------------------------------------------------------- flags and runs

@pytest.mark.parametrize("script, args, flag", [
    ("grpo", ["--budget", "knapsack", "--min_n", "9"], "--min_n"),  # 8 prompts x 9 > 64: the budget is too small
    ("dapo", ["--budget", "knapsack", "--max_n", "4"], "--max_n"),  # 8 prompts x 4 < 64
    ("rloo", ["--min_n", "2"], "--budget knapsack"),  # a bound of a uniform budget
    ("grpo", ["--budget", "knapsack", "--min_n", "1"], "--min_n"),
    ("grpo", ["--budget", "greedy"], "--budget"),
    ("rloo", ["--budget", "knapsack", "--micro_batch_size", "16"], "--micro_batch_size 0"),
    ("grpo", ["--sampler", "tree", "--depth", "2"], "--num_generations"),  # 2^2 leaves cannot fill a group of 8
    ("dapo", ["--sampler", "tree", "--budget", "knapsack"], "use one of them"),
    ("rloo", ["--segment_len", "2"], "--sampler tree"),
    ("grpo", ["--sampler", "tree", "--segment_len", "4", "--max_new_tokens", "8"], "--max_new_tokens"),
])
def test_a_bad_budget_is_one_error_line_naming_the_flag(script, args, flag):
    out = subprocess.run([sys.executable, f"lab/{script}.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.startswith("error: ") and flag in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def run_lab_in_process(name, *args):
    """`python lab/<name>.py args` as this process's call of its main() (sys.argv patched): the runs need no process
    of their own. A failure raises here."""
    run_main([f"lab/{name}.py", *args])


def test_the_three_group_methods_train_with_knapsack_groups_of_different_sizes(tmp_path):
    """A pool of 16 prompts and 8 per step: from the third step on every prompt has its 8 answers (one visit),
    and the mixed ones take samples from the rest."""
    for name in ("grpo", "rloo", "dapo"):
        run_lab_in_process(name, "--budget", "knapsack", "--train_size", "16", "--num_steps", "6", "--eval_every", "6",
                           "--log_rollouts", "0", "--save_model", "False", "--output_dir", tmp_path / name)
        rows = [row for row in read_metrics(tmp_path / name / "metrics.jsonl") if "train/group_size_max" in row]
        assert len(rows) == 6
        assert rows[0]["train/group_size_min"] == rows[0]["train/group_size_max"] == 8  # unseen: G each
        assert any(row["train/group_size_max"] > 8 for row in rows[2:]), name
        assert all(0 <= row["train/effective_samples"] <= 64 for row in rows)


def test_the_three_group_methods_train_on_trees_and_decode_fewer_tokens_than_they_keep(tmp_path):
    for name in ("grpo", "rloo", "dapo"):
        run_lab_in_process(name, "--sampler", "tree", "--num_steps", "3", "--eval_every", "3", "--log_rollouts", "0",
                           "--save_model", "False", "--output_dir", tmp_path / name)
        rows = [row for row in read_metrics(tmp_path / name / "metrics.jsonl") if "train/group_size_max" in row]
        assert len(rows) == 3 and all(row["train/group_size_max"] == 8 for row in rows)
        # forks at tokens 0, 1 and 2: the first two tokens of 8 leaves are decoded by 2 and 4 branches
        assert all(row["train/decoded_per_completion"] < row["train/completion_len"] for row in rows), name


def test_two_processes_allocate_their_own_batches_and_step_together(tmp_path):
    """Each process allocates its --batch_size over its own prompts: both hold batch_size rows, the batch-std
    advantage sees every process's groups by distinct ids, and the replicas stay identical."""
    launch_two_processes("lab/grpo.py", ["--budget", "knapsack", "--train_size", "8", "--num_steps", "4", "--eval_every",
                                     "4", "--batch_size", "8", "--num_generations", "4", "--max_n", "6",
                                     "--scale_rewards", "batch"], tmp_path)
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "train/group_size_max" in row]
    assert len(rows) == 4 and rows[0]["train/group_size_max"] == 4
