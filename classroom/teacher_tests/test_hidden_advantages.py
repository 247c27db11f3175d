"""Hidden tests of the advantages, GAE and DAPO's reward shaping: random groups and batches, properties
only (each group on its own, a sample's own reward out of its baseline, padding holding NaN)."""
import pytest
import torch

import dapo
import grpo
import ppo
import rloo
import vapo
from teacher_tests.batches import F64, GARBAGE, close, generator, lengths, padded, prefix_mask, widened


@pytest.mark.parametrize("K", [2, 3, 5])
def test_rloo_advantage_of_random_groups_leaves_each_sample_out_of_its_own_baseline(K):
    g = generator(21 + K)
    rewards = torch.randn(4 * K, dtype=F64, generator=g)
    adv = rloo.rloo_advantages(rewards, K)
    assert isinstance(adv, torch.Tensor) and adv.dtype == F64 and adv.shape == rewards.shape
    close(adv.view(-1, K).sum(1), torch.zeros(4))  # sum_i (r_i - mean of the others) = 0
    i = int(torch.randint(0, 4 * K, (1,), generator=g))
    moved = rewards.clone()
    moved[i] += 1.5
    delta = rloo.rloo_advantages(moved, K) - adv
    close(delta[i], 1.5)  # the baseline of sample i does not see r_i
    group = torch.arange(4 * K) // K == i // K
    close(delta[~group], torch.zeros(int((~group).sum())))  # other prompts are untouched
    others = group.clone()
    others[i] = False
    close(delta[others], torch.full((K - 1,), -1.5 / (K - 1)))  # r_i is one of K - 1 in the others' baselines


@pytest.mark.parametrize("module", [grpo, dapo], ids=["grpo", "dapo"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_advantage_of_random_groups_treats_each_group_on_its_own(scale_rewards, module):
    """dapo.py's copy is graded by the same properties."""
    grpo_advantages = module.grpo_advantages
    g, G = generator(31), 4
    rewards = torch.randn(5 * G, dtype=F64, generator=g)
    rewards[:G] = 0.7  # an all-equal group
    adv = grpo_advantages(rewards, G, scale_rewards)
    assert adv.dtype == F64 and adv.shape == rewards.shape
    assert adv[:G].tolist() == [0.0] * G
    close(adv.view(-1, G).sum(1), torch.zeros(5))
    shifted = rewards + torch.arange(5, dtype=F64).repeat_interleave(G) * 3.0  # a reward offset per prompt
    if scale_rewards == "batch":  # the batch std sees the offsets; a common shift and scale it does not
        close(grpo_advantages(2.0 * rewards - 1.0, G, scale_rewards), adv, 1e-5)
        assert (adv[G:] / (rewards[G:] - rewards[G:].view(-1, G).mean(1).repeat_interleave(G))).std() < 1e-9
    else:
        close(grpo_advantages(shifted, G, scale_rewards), adv, 1e-9)
    grouped = adv.view(-1, G)[1:]
    if scale_rewards == "group":
        close(grouped.std(1), torch.ones(4), 1e-5)  # Bessel's std 1 in every group (eps = 1e-6 aside)
        scaled = rewards * torch.tensor([1.0, 0.5, 2.0, 4.0, 10.0], dtype=F64).repeat_interleave(G)
        close(grpo_advantages(scaled, G, scale_rewards), adv, 1e-5)
    if scale_rewards == "none":
        moved = rewards.clone()
        moved[G + 1] += 1.0
        close(grpo_advantages(moved, G, "none")[G:2 * G] - adv[G:2 * G], torch.tensor([-0.25, 0.75, -0.25, -0.25],
                                                                                          dtype=F64))


@pytest.mark.parametrize("module", [grpo, dapo], ids=["grpo", "dapo"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_advantage_of_an_all_equal_float32_group_is_exactly_zero(scale_rewards, module):
    """In float32 the mean of seven 0.7s is not 0.7 (r - mean ~ 6e-8, ~0.06 after / (std + eps)): the
    group must still get exactly 0, in a batch whose other groups are mixed."""
    g = generator(32)
    rewards = torch.cat([torch.rand(7, generator=g), torch.full((7,), 0.7), torch.rand(14, generator=g)])
    adv = module.grpo_advantages(rewards, 7, scale_rewards)
    assert adv[7:14].tolist() == [0.0] * 7 and (adv[:7] != 0).all() and (adv[14:] != 0).all()


def test_dynamic_sampling_filter_keeps_exactly_the_mixed_groups_of_random_correctness():
    g, G = generator(41), 5
    kind = torch.randint(0, 3, (12,), generator=g)  # 0: all wrong, 1: all right, 2: mixed
    kind[:3] = torch.tensor([0, 1, 2])
    groups = []
    for k in kind.tolist():
        if k < 2:
            groups.append(torch.full((G,), float(k)))
        else:
            row = (torch.rand(G, generator=g) < 0.5).float()
            row[int(torch.randint(0, G, (1,), generator=g))] = 1 - row[0] if row.min() == row.max() else row[0]
            groups.append(row)
    correct = torch.cat(groups)
    keep = dapo.dynamic_sampling_filter(correct, G)
    assert keep.dtype == torch.bool and keep.tolist() == (kind == 2).tolist()


def test_overlong_penalty_of_every_length_is_zero_then_a_ramp_of_step_one_over_cache_then_minus_one():
    g = generator(51)
    max_len = int(torch.randint(8, 20, (1,), generator=g))
    cache_len = int(torch.randint(1, max_len - 2, (1,), generator=g))
    L = torch.arange(1, max_len + 4)
    pen = dapo.overlong_penalty(L, max_len, cache_len)
    assert pen.dtype.is_floating_point and pen.shape == L.shape
    start = max_len - cache_len
    assert (pen[L <= start] == 0).all() and (pen[L > max_len] == -1).all()
    ramp = pen[(L >= start) & (L <= max_len)]
    close(ramp[1:] - ramp[:-1], torch.full((cache_len,), -1.0 / cache_len), 1e-6)


@pytest.mark.parametrize("fill", GARBAGE)
def test_gae_of_a_padded_batch_with_one_lambda_per_row_treats_each_row_alone(fill):
    g, B, T, gamma = generator(61), 5, 7, 0.9
    n = lengths(B, T, g)
    mask = prefix_mask(n, T)
    rewards = torch.randn(B, T, dtype=F64, generator=g)
    values = torch.randn(B, T, dtype=F64, generator=g)
    lam = torch.rand(B, dtype=F64, generator=g)
    adv, ret = ppo.gae(padded(rewards, mask, fill), padded(values, mask, fill), mask, gamma, lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[mask == 0] == 0).all()
    wide = ppo.gae(widened(padded(rewards, mask, fill), 2, fill), widened(padded(values, mask, fill), 2, fill),
                   widened(mask, 2, 0), gamma, lam)
    close(wide[0][:, :T], adv)
    close(wide[1][:, :T][mask.bool()], ret[mask.bool()])
    for b in range(B):
        k = int(n[b])
        alone = ppo.gae(rewards[b:b + 1, :k], values[b:b + 1, :k], mask[b:b + 1, :k], gamma, float(lam[b]))
        close(alone[0][0], adv[b, :k])
        close(alone[1][0], ret[b, :k])
        close(ret[b, :k] - adv[b, :k], values[b, :k])  # R_t = A_t + V_t
        delta_last = rewards[b, k - 1] - values[b, k - 1]  # V after the last valid token is 0
        close(adv[b, k - 1], delta_last)


def test_gae_of_an_episode_skips_the_environments_tokens():
    """The environment's tokens between the model's are neither steps nor rewards: GAE over an episode's actions
    equals GAE over those actions laid end to end."""
    g, B, T, gamma, lam = generator(67), 5, 9, 0.9, 0.8
    mask = prefix_mask(lengths(B, T, g), T) * (torch.rand(B, T, generator=g) < 0.6).long()
    mask[:, 0] = 1
    rewards = padded(torch.randn(B, T, dtype=F64, generator=g), mask, float("nan"))
    values = padded(torch.randn(B, T, dtype=F64, generator=g), mask, float("nan"))
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    assert (adv[mask == 0] == 0).all()
    for b in range(B):
        acts = mask[b].bool()
        alone = ppo.gae(rewards[b:b + 1, acts], values[b:b + 1, acts], torch.ones(1, int(acts.sum())), gamma, lam)
        close(alone[0][0], adv[b, acts])
        close(alone[1][0], ret[b, acts])


def test_decoupled_gae_is_two_gaes_on_a_random_padded_batch():
    g, B, T = generator(71), 4, 6
    mask = prefix_mask(lengths(B, T, g), T)
    rewards = padded(torch.randn(B, T, dtype=F64, generator=g), mask, float("nan"))
    values = padded(torch.randn(B, T, dtype=F64, generator=g), mask, float("nan"))
    adv, ret = vapo.decoupled_gae(rewards, values, mask, 0.95, 0.6, 1.0)
    close(adv, ppo.gae(rewards, values, mask, 0.95, 0.6)[0])
    close(ret, ppo.gae(rewards, values, mask, 0.95, 1.0)[1])


def test_length_adaptive_lambda_of_random_lengths_gives_td_weights_alpha_times_length():
    g = generator(81)
    alpha = float(torch.rand(1, generator=g)) * 0.2 + 0.02
    L = torch.randint(1, 200, (50,), generator=g)
    lam = vapo.length_adaptive_lam(L, alpha)
    assert lam.dtype.is_floating_point and ((lam >= 0) & (lam < 1)).all()
    long = alpha * L > 1
    close(1 / (1 - lam[long].double()), alpha * L[long].double(), 1e-4)  # docs: 1 / (1 - lam) = alpha |y|
    assert (lam[~long] == 0).all()


def test_reinforce_pp_advantages_of_a_padded_batch_are_the_whitened_reward_to_go_of_every_valid_token():
    import reinforce_pp
    g = generator(95)
    n = lengths(6, 7, g)
    mask = prefix_mask(n, 7)
    kl = padded(torch.randn(6, 7, dtype=F64, generator=g), mask, float("nan"))
    rewards = torch.randn(6, dtype=F64, generator=g)
    adv = reinforce_pp.reinforce_pp_advantages(rewards, kl, mask, 0.3)
    assert adv.shape == (6, 7) and (adv[mask == 0] == 0).all()
    tokens = torch.tensor([float(rewards[i]) - 0.3 * float(kl[i, t:int(n[i])].sum())
                           for i in range(6) for t in range(int(n[i]))], dtype=F64)
    close(adv[mask.bool()], (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8), 1e-8)


def test_length_reward_of_random_groups_rewards_the_shortest_right_answer_and_never_a_wrong_one():
    import kimi
    g = generator(97)
    L = torch.randint(1, 40, (20,), generator=g)
    correct = (torch.rand(20, generator=g) < 0.5).long()
    reward = kimi.length_reward(L, correct, 5).view(4, 5)
    L, correct = L.view(4, 5).double(), correct.view(4, 5).bool()
    for row in range(4):
        lo, hi = L[row].min(), L[row].max()
        lam = 0.5 - (L[row] - lo) / (hi - lo) if hi > lo else torch.zeros(5, dtype=F64)
        close(reward[row], torch.where(correct[row], lam, lam.clamp(max=0)), 1e-6)
    assert (reward[~correct] <= 0).all()


def test_priority_weights_of_random_rates_are_probabilities_in_the_ratio_of_the_failures():
    import kimi
    g = generator(99)
    rates = torch.rand(12, dtype=F64, generator=g)
    rates[3] = 1.0
    weights = kimi.priority_weights(rates)
    close(weights.sum(), 1.0)
    assert weights[3] == 0 and (weights >= 0).all()
    close(weights[0] / weights[1], (1 - rates[0]) / (1 - rates[1]), 1e-9)
    close(kimi.priority_weights(torch.ones(3, dtype=F64)), torch.full((3,), 1 / 3, dtype=F64))
