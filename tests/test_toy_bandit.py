"""Tests for toy_bandit.py: one test per property in docs/algorithms.md (baselines and the toy bandit)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toy_bandit as tb  # noqa: E402

NAMES = ["none", "mean", "greedy", "optimal"]
B_GRID = np.linspace(-3.0, 3.0, 60_001)  # step 1e-4, independent of the b* under test


def two_arm_variances(p, r1, r0, bernoulli=False):
    return {n: tb.gradient_variance(p, r1, r0, b, bernoulli) for n, b in tb.two_arm_baselines(p, r1, r0).items()}


def softmax_variances(theta, r, bernoulli=False):
    return {n: tb.softmax_gradient_variance(theta, r, b, bernoulli) for n, b in tb.softmax_baselines(theta, r).items()}


# ---------------------------------------------------------------- check values (docs/algorithms.md)

@pytest.mark.parametrize("r1, r0, p, expected", [
    (1.0, 0.0, 0.9, [0.0009, 0.0576, 0.0729, 0.0]),
    (2.0, 1.0, 0.7, [0.3549, 0.0336, 0.1029, 0.0]),
    # p < 1/2: greedy picks action 0 (b = r0 = 0), the same variance as none; b* = 0.7, mean 0.3
    (1.0, 0.0, 0.3, [0.1029, 0.0336, 0.1029, 0.0]),
])
def test_two_arm_check_values(r1, r0, p, expected):
    var = two_arm_variances(p, r1, r0)
    np.testing.assert_allclose([var[n] for n in NAMES], expected, rtol=0, atol=1e-4)


def test_mean_baseline_is_4x_none_for_symmetric_rewards():
    p = np.array([0.01, 0.1, 0.3, 0.49, 0.51, 0.7, 0.9, 0.99])
    var = two_arm_variances(p, 1.0, -1.0)
    np.testing.assert_allclose(var["mean"] / var["none"], 4.0, rtol=1e-9)


def test_k_arm_check_values():
    var = softmax_variances([0.5, 0.0, -0.3], [1.0, 0.4, 0.0])
    np.testing.assert_allclose([var[n] for n in NAMES], [0.1726, 0.0565, 0.2291, 0.0424], rtol=0, atol=1e-4)


def test_dayan_mean_baseline_is_worse_than_none_exactly_for_p_above_two_thirds():
    p = np.linspace(0.01, 0.99, 99)
    var = two_arm_variances(p, 1.0, 0.0)
    np.testing.assert_array_equal(var["mean"] > var["none"], p > 2 / 3)


def test_greedy_beats_none_for_rewards_2_1_and_loses_for_rewards_1_0_once_p_above_half():
    p = np.linspace(0.01, 0.99, 99)
    var = two_arm_variances(p, 2.0, 1.0)
    assert (var["greedy"] < var["none"]).all()
    near_converged = two_arm_variances(0.999, 2.0, 1.0)
    assert near_converged["greedy"] / near_converged["none"] > 0.99  # the gain vanishes as p -> 1
    var = two_arm_variances(p, 1.0, 0.0)
    np.testing.assert_array_equal(var["greedy"] > var["none"] * (1 + 1e-12), p > 0.5)


def test_two_arm_baselines_of_an_array_of_p_are_arrays_like_p():
    p = np.array([[0.2, 0.5], [0.7, 0.9]])
    baselines = tb.two_arm_baselines(p, 1.0, 0.0)
    assert all(np.shape(b) == p.shape for b in baselines.values())
    np.testing.assert_array_equal(baselines["none"], np.zeros((2, 2)))


def test_greedy_tie_break_goes_to_lowest_index():
    assert tb.two_arm_baselines(0.5, 1.0, 0.0)["greedy"] == 0.0
    assert tb.two_arm_baselines(0.5 + 1e-9, 1.0, 0.0)["greedy"] == 1.0
    assert tb.softmax_baselines([0.0, 0.0, -1.0], [0.2, 0.7, 0.0])["greedy"] == 0.2
    assert tb.softmax_baselines([-1.0, 2.0, 0.5], [0.1, 0.9, 0.3])["greedy"] == 0.9  # the likeliest arm is arm 1
    # at the tie both choices give the same variance, so the choice only fixes b
    assert tb.gradient_variance(0.5, 1, 0, 1.0) == pytest.approx(tb.gradient_variance(0.5, 1, 0, 0.0))


# ---------------------------------------------------------------- the optimal baseline

@pytest.mark.parametrize("p, r1, r0, bernoulli, b_star, curvature, floor", [
    # curvature E[s^2] = 0.09, b* = E[r s^2] / E[s^2] = 0.1 by hand; deterministic rewards: b* leaves no variance
    (0.9, 1.0, 0.0, False, 0.1, 0.09, 0.0),
    # curvature 0.21, b* = 0.45 by hand; the Bernoulli noise stays: 0.04095, worked out by hand
    (0.7, 0.8, 0.3, True, 0.45, 0.21, 0.04095),
    # curvature 0.21, b* = 1.54 by hand
    (0.3, 2.5, -0.7, False, 1.54, 0.21, 0.0),
])
def test_two_arm_variance_is_a_parabola_in_b_around_b_star(p, r1, r0, bernoulli, b_star, curvature, floor):
    b = np.linspace(-2, 2, 41)
    np.testing.assert_allclose(tb.gradient_variance(p, r1, r0, b, bernoulli),
                               floor + curvature * (b - b_star) ** 2, rtol=1e-10, atol=1e-14)
    rng = np.random.default_rng(1)  # any p: a parabola in b (constant second differences)
    p = rng.uniform(0.01, 0.99, (50, 1))
    second = np.diff(tb.gradient_variance(p, r1, r0, np.linspace(-2, 2, 9), bernoulli), 2, axis=-1)
    np.testing.assert_allclose(second, np.broadcast_to(second[:, :1], second.shape), rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("r, bernoulli, floor", [
    # uniform pi over 4 arms: ||s(a)||^2 = 3/4 for every arm, W = 3/4, b* = E[r] = 0.375;
    # E||g||^2 = 0.75 * 0.25 * sum_a (r_a - 0.375)^2 = 0.12890625, ||grad J||^2 = 0.04296875
    ([1.0, 0.5, 0.0, 0.0], False, 0.0859375),
    # Bernoulli: arm 1 adds 0.25 * 0.75 * 0.5 * 0.5 = 0.046875
    ([1.0, 0.5, 0.0, 0.0], True, 0.1328125),
])
def test_k_arm_variance_is_a_parabola_in_b_around_b_star(r, bernoulli, floor):
    b = np.linspace(-2, 2, 41)
    np.testing.assert_allclose(tb.softmax_gradient_variance(np.zeros(4), r, b, bernoulli),
                               floor + 0.75 * (b - 0.375) ** 2, rtol=1e-10)
    second = np.diff(tb.softmax_gradient_variance([0.3, -1.0, 0.8, 0.1], r, np.linspace(-2, 2, 9), bernoulli), 2)
    np.testing.assert_allclose(second, second[0], rtol=1e-9)


@pytest.mark.parametrize("p, r1, r0, bernoulli", [
    (0.9, 1.0, 0.0, False), (0.7, 2.0, 1.0, False), (0.2, -0.5, 1.5, False), (0.6, 0.8, 0.3, True)])
def test_optimal_baseline_is_argmin_of_variance(p, r1, r0, bernoulli):
    b_best = B_GRID[np.argmin(tb.gradient_variance(p, r1, r0, B_GRID, bernoulli))]
    assert abs(b_best - tb.optimal_baseline(p, r1, r0)) <= 1e-4


@pytest.mark.parametrize("theta, r, bernoulli", [
    ([0.5, 0.0, -0.3], [1.0, 0.4, 0.0], False), ([2.0, -1.0, 0.0, 0.5], [0.1, 0.9, 0.4, 0.7], True)])
def test_k_arm_optimal_baseline_is_argmin_of_variance(theta, r, bernoulli):
    b_best = B_GRID[np.argmin(tb.softmax_gradient_variance(theta, r, B_GRID, bernoulli))]
    assert abs(b_best - tb.softmax_optimal_baseline(theta, r)) <= 1e-4


def test_optimal_baseline_with_zero_mean_reward():
    # E[r] = 0: the misprinted formula E[r ||s||^2] / E[r] is undefined; the right one is not.
    # p = 3/4, r = (1, -3): E[r] = 0.75 - 0.75 = 0, and b* = E[r s^2] / E[s^2] = -2 by hand
    assert tb.two_arm_baselines(0.75, 1.0, -3.0)["mean"] == 0.0
    assert tb.optimal_baseline(0.75, 1.0, -3.0) == pytest.approx(-2.0, abs=1e-12)
    b_best = B_GRID[np.argmin(tb.gradient_variance(0.75, 1.0, -3.0, B_GRID))]
    assert abs(b_best - -2.0) <= 1e-4
    theta = np.array([1.0, -0.5, 0.2])
    r = np.array([1.0, 0.0, -2.0])
    r = r - tb.softmax(theta) @ r  # now E[r] = 0
    assert abs(tb.softmax(theta) @ r) < 1e-12
    b_star = tb.softmax_optimal_baseline(theta, r)
    assert np.isfinite(b_star) and abs(b_star) > 1e-3
    assert abs(B_GRID[np.argmin(tb.softmax_gradient_variance(theta, r, B_GRID))] - b_star) <= 1e-4


def test_optimal_baseline_is_shift_and_scale_equivariant():
    theta, r = [0.4, -0.2, 1.1], np.array([0.3, 1.0, -0.5])
    b_star = tb.softmax_optimal_baseline(theta, r)
    assert tb.softmax_optimal_baseline(theta, 3.0 * r + 2.0) == pytest.approx(3.0 * b_star + 2.0)
    assert tb.optimal_baseline(0.3, 3.0 * 1.5 + 2.0, 3.0 * -0.5 + 2.0) == pytest.approx(
        3.0 * tb.optimal_baseline(0.3, 1.5, -0.5) + 2.0)


# ---------------------------------------------------------------- Monte Carlo

def test_closed_form_matches_monte_carlo():
    rng, n = np.random.default_rng(0), 200_000
    cases = [
        (lambda b: tb.sample_two_arm_gradients(0.9, 1, 0, b, n, rng),
         lambda b: tb.gradient_variance(0.9, 1, 0, b), tb.two_arm_baselines(0.9, 1, 0)),
        (lambda b: tb.sample_two_arm_gradients(0.3, 2, 1, b, n, rng),
         lambda b: tb.gradient_variance(0.3, 2, 1, b), tb.two_arm_baselines(0.3, 2, 1)),
        (lambda b: tb.sample_two_arm_gradients(0.7, 0.8, 0.3, b, n, rng, bernoulli=True),
         lambda b: tb.gradient_variance(0.7, 0.8, 0.3, b, bernoulli=True), tb.two_arm_baselines(0.7, 0.8, 0.3)),
        (lambda b: tb.sample_softmax_gradients([0.5, 0, -0.3], [1, 0.4, 0], b, n, rng),
         lambda b: tb.softmax_gradient_variance([0.5, 0, -0.3], [1, 0.4, 0], b),
         tb.softmax_baselines([0.5, 0, -0.3], [1, 0.4, 0])),
        (lambda b: tb.sample_softmax_gradients([1, 0, -1, 0.5], [0.9, 0.5, 0.1, 0.3], b, n, rng, bernoulli=True),
         lambda b: tb.softmax_gradient_variance([1, 0, -1, 0.5], [0.9, 0.5, 0.1, 0.3], b, bernoulli=True),
         tb.softmax_baselines([1, 0, -1, 0.5], [0.9, 0.5, 0.1, 0.3])),
    ]
    for sample, exact, baselines in cases:
        for name, b in baselines.items():
            mc, se = tb.mc_variance(sample(float(b)))
            if abs(exact(b)) < 1e-12:  # deterministic rewards with b*: the estimator is constant
                assert name == "optimal" and abs(mc) < 1e-12
            else:
                assert abs(mc - exact(b)) <= 4 * se, (name, mc, se, exact(b))


# ---------------------------------------------------------------- group estimators

def test_group_advantages_hand_computed_values():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 4.0, 2.0]])
    # RLOO: 1 - 0, 0 - 1/3; 2 - 10/3, 4 - 8/3. Mean incl. self: 1 - 1/4, 0 - 1/4; 2 - 3, 4 - 3
    np.testing.assert_allclose(tb.rloo_advantages(rewards),
                               [[1.0, -1 / 3, -1 / 3, -1 / 3], [-4 / 3, 4 / 3, 4 / 3, -4 / 3]], rtol=1e-12)
    np.testing.assert_allclose(tb.mean_advantages(rewards), [[0.75, -0.25, -0.25, -0.25], [-1.0, 1.0, 1.0, -1.0]])
    # GRPO, by hand: [1, 0, 0, 0] has mean 1/4 and std (ddof 1) 1/2; [2, 4, 4, 2] mean 3, std sqrt(4/3)
    s2 = np.sqrt(4 / 3)
    expected = np.array([[0.75, -0.25, -0.25, -0.25], [-1.0, 1.0, 1.0, -1.0]]) / np.array([[0.5 + 1e-6], [s2 + 1e-6]])
    np.testing.assert_allclose(tb.grpo_advantages(np.array([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 4.0, 2.0]])), expected,
                               rtol=1e-12)


def test_grpo_all_equal_group_gets_zero_advantage():
    rewards = np.array([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = tb.grpo_advantages(rewards)
    assert (adv[:2] == 0.0).all() and (adv[2] != 0.0).all()


@pytest.mark.parametrize("bernoulli", [False, True])
def test_rloo_is_unbiased_by_enumeration(bernoulli):
    r1, r0 = (0.8, 0.3) if bernoulli else (2.0, 1.0)
    for K in [2, 3, 5]:
        for p in [0.1, 0.5, 0.77]:
            assert tb.group_bias_ratio(p, r1, r0, tb.rloo_advantages, K, bernoulli) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("bernoulli", [False, True])
def test_mean_baseline_bias_is_k_minus_1_over_k(bernoulli):
    r1, r0 = (0.8, 0.3) if bernoulli else (1.0, 0.0)
    for K in [2, 3, 5]:
        for p in [0.1, 0.5, 0.77]:
            ratio = tb.group_bias_ratio(p, r1, r0, tb.mean_advantages, K, bernoulli)
            assert ratio == pytest.approx((K - 1) / K, abs=1e-12)


def test_grpo_bias_ratio_depends_on_p():
    for K in [4, 5, 8]:
        ratio = [tb.group_bias_ratio(p, 1.0, 0.0, tb.grpo_advantages, K) for p in (0.05, 0.5, 0.95)]
        assert ratio[0] > ratio[1] + 0.05 and ratio[2] > ratio[1] + 0.05, (K, ratio)  # extremes upweighted
    ratio = [tb.group_bias_ratio(p, 0.8, 0.3, tb.grpo_advantages, 4, bernoulli=True) for p in (0.5, 0.9)]
    assert abs(ratio[0] - ratio[1]) > 0.01


@pytest.mark.parametrize("K", [2, 3])
def test_grpo_bias_ratio_is_constant_for_groups_of_two_or_three(K):
    # binary rewards: a mixed group with n successes has std sqrt(n(K-n) / (K(K-1))), the same
    # for every mixed group when K <= 3, so the difficulty bias needs K >= 4
    ratio = [tb.group_bias_ratio(p, 1.0, 0.0, tb.grpo_advantages, K) for p in (0.05, 0.3, 0.5, 0.9)]
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-9)


def test_rloo_variance_by_enumeration_matches_monte_carlo():
    p, r1, r0, K, n = 0.8, 2.0, 1.0, 4, 100_000
    rng = np.random.default_rng(2)
    action1 = rng.random((n, K)) < p
    g = (tb.rloo_advantages(np.where(action1, r1, r0)) * np.where(action1, 1 - p, -p)).mean(1)
    mc, se = tb.mc_variance(g)
    assert abs(tb.group_gradient_moments(p, r1, r0, tb.rloo_advantages, K)[1] - mc) <= 4 * se


# ---------------------------------------------------------------- the script

def test_import_does_no_work(tmp_path):
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                          "import toy_bandit; print('matplotlib' in sys.modules)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and list(tmp_path.iterdir()) == []


def test_main_writes_figures(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "toy_bandit.py"), "--out", str(tmp_path / "figs"),
                          "--n-mc", "2000"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ["variance_vs_p.png", "group_bias_vs_p.png"]:
        png = tmp_path / "figs" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "0.0576" in out.stdout and "0.1726" in out.stdout
