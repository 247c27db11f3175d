"""Toy bandit: when does a baseline reduce the variance of REINFORCE, and when not?

Dayan (1991): the expected-reward baseline (Sutton's reinforcement comparison) is not the
variance-minimising one and can make the gradient noisier than no baseline at all. The
minimum-variance baseline is b* = E[r ||s||^2] / E[||s||^2] (Greensmith, Bartlett & Baxter,
2004; the survey seed misprints the denominator as E[r]). ReMax (Li et al., 2023) uses the
reward of the greedy (argmax) action instead. For a two-armed logistic bandit and a K-armed
softmax bandit this file computes the exact variance of the one-sample estimator
g = (r_a - b) s(a) for each baseline, checks it by Monte Carlo, and computes by exact
enumeration the bias of the group estimators (RLOO, mean incl. self, GRPO).
Math and check values: docs/algorithms.md (baselines and the toy bandit).

Conventions. "Variance" of a vector estimator is the trace of its covariance. The greedy action
breaks ties to the lowest action index (as np.argmax does): action 0 at p = 1/2 in the two-arm
bandit, where both choices give the same variance. With Bernoulli rewards every baseline is
computed from the success probabilities q (greedy: q of the argmax action). GRPO's std uses
Bessel's correction (ddof=1, as torch.std, TRL, verl) and eps = 1e-6 (verl); a group whose
rewards are all equal gets advantage 0.

    python toy_bandit.py          # prints the tables; writes variance_vs_p.png and
                                  # group_bias_vs_p.png to toy_bandit_out/ (a few seconds)
    python toy_bandit.py --out docs/figures --K 4 --n-mc 200000 --seed 0
"""
import argparse
import itertools
from pathlib import Path

import numpy as np

GRPO_EPS = 1e-6  # verl's value (TRL uses 1e-4)


# ----------------------------------------------------------------------------------------------
# Two-armed bandit: p = sigmoid(theta) = P(action 1), s(1) = 1 - p, s(0) = -p,
# grad J = p(1-p)(r1 - r0).


def gradient_variance(p, r1, r0, baseline, bernoulli=False):
    """Exact variance of g = (r_a - b) s(a) for the two-armed bandit (p, b may be arrays).

    r1, r0 are the mean rewards. bernoulli=True: rewards are 0/1 with success probabilities
    q1 = r1, q0 = r0. Variance means E[g^2] - (E[g])^2 over the action (and the Bernoulli reward).
    """
    # BEGIN SOLUTION
    p, b = np.asarray(p, float), np.asarray(baseline, float)
    noise1, noise0 = (r1 * (1 - r1), r0 * (1 - r0)) if bernoulli else (0.0, 0.0)
    # Var(b) = E[(r - b)^2 s^2] - (grad J)^2; given a, E[(r - b)^2] = (r_a - b)^2 + noise_a
    second_moment = (p * (1 - p) ** 2 * ((r1 - b) ** 2 + noise1)
                     + (1 - p) * p**2 * ((r0 - b) ** 2 + noise0))
    return second_moment - (p * (1 - p) * (r1 - r0)) ** 2
    # END SOLUTION


def optimal_baseline(p, r1, r0):
    """Minimum-variance baseline b* = E[r s^2] / E[s^2] of the two-armed bandit, simplified.

    It is not the expected reward (except at p = 1/2). With Bernoulli rewards pass q1, q0.
    """
    # BEGIN SOLUTION
    p = np.asarray(p, float)
    # E[r s^2] / E[s^2] = [p(1-p)^2 r1 + (1-p)p^2 r0] / [p(1-p)^2 + (1-p)p^2], and the
    # denominator is p(1-p)
    return (1 - p) * r1 + p * r0
    # END SOLUTION


def two_arm_baselines(p, r1, r0):
    """The baseline values b, arrays like p: none, mean (expected reward), greedy (ReMax), optimal (b*).

    greedy = reward of the argmax action; at p = 1/2 the tie goes to action 0 (lowest index).
    """
    # BEGIN SOLUTION
    p = np.asarray(p, float)
    return {
        "none": np.zeros_like(p),
        "mean": p * r1 + (1 - p) * r0,  # Sutton's reinforcement comparison
        "greedy": np.where(p > 0.5, r1, r0),
        "optimal": optimal_baseline(p, r1, r0),
    }
    # END SOLUTION


# ----------------------------------------------------------------------------------------------
# K-armed softmax bandit: pi = softmax(theta), s(a) = e_a - pi, ||s(a)||^2 = 1 - 2 pi_a + ||pi||^2.


def softmax(theta):
    z = np.exp(np.asarray(theta, float) - np.max(theta))
    return z / z.sum()


def softmax_gradient_variance(theta, r, baseline, bernoulli=False):
    """Exact tr Cov of g = (r_a - b) s(a) for pi = softmax(theta); r: (K,) mean rewards.

    bernoulli=True: rewards are 0/1 with success probabilities r. baseline may be an array.
    """
    # BEGIN SOLUTION
    pi, r = softmax(theta), np.asarray(r, float)
    sq_norm = 1 - 2 * pi + pi @ pi  # ||s(a)||^2, (K,)
    grad_J = pi * (r - pi @ r)  # E[r s(a)] = sum_a pi_a r_a (e_a - pi)
    noise = r * (1 - r) if bernoulli else 0.0
    b = np.asarray(baseline, float)[..., None]
    return (pi * sq_norm * ((r - b) ** 2 + noise)).sum(-1) - grad_J @ grad_J
    # END SOLUTION


def softmax_optimal_baseline(theta, r):
    """The minimum-variance baseline b* = E[r ||s||^2] / E[||s||^2] of the softmax bandit, a float."""
    # BEGIN SOLUTION
    pi, r = softmax(theta), np.asarray(r, float)
    sq_norm = 1 - 2 * pi + pi @ pi
    return (pi * r * sq_norm).sum() / (1 - pi @ pi)
    # END SOLUTION


def softmax_baselines(theta, r):
    """none, mean, greedy (reward of argmax pi, ties to the lowest index), optimal."""
    # BEGIN SOLUTION
    pi, r = softmax(theta), np.asarray(r, float)
    return {"none": 0.0, "mean": pi @ r, "greedy": r[np.argmax(pi)],
            "optimal": softmax_optimal_baseline(theta, r)}
    # END SOLUTION


# ----------------------------------------------------------------------------------------------
# Monte Carlo: sample the estimator, estimate its variance with a standard error.


def sample_two_arm_gradients(p, r1, r0, baseline, n, rng, bernoulli=False):
    """n iid draws of g = (r_a - b) s(a) from the two-armed bandit, shape (n,)."""
    action1 = rng.random(n) < p
    reward = np.where(action1, r1, r0)
    if bernoulli:
        reward = (rng.random(n) < reward).astype(float)
    return (reward - baseline) * np.where(action1, 1 - p, -p)


def sample_softmax_gradients(theta, r, baseline, n, rng, bernoulli=False):
    """n iid draws of g = (r_a - b)(e_a - pi) from the softmax bandit, shape (n, K)."""
    pi, r = softmax(theta), np.asarray(r, float)
    action = rng.choice(len(pi), size=n, p=pi)
    reward = r[action]
    if bernoulli:
        reward = (rng.random(n) < reward).astype(float)
    return (reward - baseline)[:, None] * (np.eye(len(pi))[action] - pi)


def mc_variance(g):
    """Unbiased estimate of tr Cov(g) from iid draws g, shape (n,) or (n, K); and its std error."""
    g = np.asarray(g, float).reshape(len(g), -1)
    sq_dev = ((g - g.mean(0)) ** 2).sum(-1)
    n = len(sq_dev)
    return sq_dev.mean() * n / (n - 1), sq_dev.std(ddof=1) / np.sqrt(n)


# ----------------------------------------------------------------------------------------------
# Group estimators: K samples per prompt, g = (1/K) sum_i A_i s(a_i). rewards: (..., K).


def over_groups(advantages, rewards, **kwargs):
    """Apply a torch advantage function of (B,) rewards in adjacent groups (an exercise of rloo.py or
    grpo.py) to numpy rewards grouped along the last axis."""
    import torch  # imported here so that importing this file does no work

    rewards = np.asarray(rewards, float)
    flat = torch.as_tensor(rewards.reshape(-1), dtype=torch.float64)
    return advantages(flat, rewards.shape[-1], **kwargs).numpy().reshape(rewards.shape)


def rloo_advantages(rewards):
    """RLOO: A_i = r_i - mean_{j != i} r_j (rloo.rloo_advantages over the last axis)."""
    import rloo
    return over_groups(rloo.rloo_advantages, rewards)


def mean_advantages(rewards):
    """Mean including self (Dr. GRPO): A_i = r_i - mean r (grpo.grpo_advantages, scale_rewards='none')."""
    import grpo
    return over_groups(grpo.grpo_advantages, rewards, scale_rewards="none")


def grpo_advantages(rewards, eps=GRPO_EPS):
    """GRPO: A_i = (r_i - mean r) / (std r + eps), std with ddof=1; all-equal group -> 0 (grpo.grpo_advantages)."""
    import grpo
    return over_groups(grpo.grpo_advantages, rewards, scale_rewards="group", eps=eps)


def group_gradient_moments(p, r1, r0, advantages, K, bernoulli=False):
    """Exact (E[g], Var[g]) of g = (1/K) sum_i A_i s(a_i) on the two-armed bandit.

    Enumerates every outcome of a group of K iid samples (2^K outcomes; 4^K with Bernoulli
    rewards). advantages: a function rewards (N, K) -> (N, K), e.g. rloo_advantages.
    K * Var[g] is the per-sample variance, comparable with gradient_variance.
    """
    if bernoulli:  # a sample's outcome is (action, 0/1 reward)
        action, reward = np.array([1, 1, 0, 0]), np.array([1.0, 0.0, 1.0, 0.0])
        prob = np.array([p * r1, p * (1 - r1), (1 - p) * r0, (1 - p) * (1 - r0)])
    else:
        action, reward, prob = np.array([1, 0]), np.array([r1, r0], float), np.array([p, 1 - p])
    outcome = np.array(list(itertools.product(range(len(prob)), repeat=K)))  # (N, K)
    score = np.where(action[outcome] == 1, 1 - p, -p)
    g = (advantages(reward[outcome]) * score).mean(-1)
    weight = prob[outcome].prod(-1)
    mean = weight @ g
    return mean, weight @ (g - mean) ** 2


def group_bias_ratio(p, r1, r0, advantages, K, bernoulli=False):
    """E[g_group] / grad J: 1 for an unbiased estimator (r1 != r0)."""
    return group_gradient_moments(p, r1, r0, advantages, K, bernoulli)[0] / (p * (1 - p) * (r1 - r0))


# ----------------------------------------------------------------------------------------------
# Tables and figures.


def fmt(x):
    return "0" if abs(x) < 1e-12 else f"{x:.4g}"


def intervals(mask, p):
    """Describe where a boolean mask over the grid p is true, e.g. 'p in [0.668, 0.999]'."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    runs = [f"[{p[i]:.3f}, {p[j - 1]:.3f}]" for i, j in zip(edges[::2], edges[1::2])]
    return "p in " + " U ".join(runs) if runs else "never"


def print_tables(args, rng):
    settings = args.settings
    names = ["none", "mean", "greedy", "optimal"]
    print("Two-armed bandit, p = P(action 1): exact Var of (r_a - b) s(a), one sample")
    print(f"{'r1':>4} {'r0':>4} {'p':>5} " + "".join(f"{n:>9}" for n in names)
          + f"{'RLOO K=' + str(args.K):>10}{'b*':>8}")
    for r1, r0 in settings:
        for p in args.p:
            var = [gradient_variance(p, r1, r0, b) for b in two_arm_baselines(p, r1, r0).values()]
            rloo = args.K * group_gradient_moments(p, r1, r0, rloo_advantages, args.K)[1]
            print(f"{r1:>4g} {r0:>4g} {p:>5g} " + "".join(f"{fmt(v):>9}" for v in var)
                  + f"{fmt(rloo):>10}{fmt(optimal_baseline(p, r1, r0)):>8}")
    print("(RLOO column: K x Var of the group estimator, by exact enumeration)\n")

    grid = np.linspace(0.001, 0.999, 999)
    print("Where a baseline is worse than none (Dayan 1991; ReMax's greedy baseline):")
    for r1, r0 in settings:
        b = two_arm_baselines(grid, r1, r0)
        none = gradient_variance(grid, r1, r0, 0.0)
        for name in ("mean", "greedy"):
            # strictly worse: greedy equals none where its b is 0, which must not count
            worse = gradient_variance(grid, r1, r0, b[name]) > none * (1 + 1e-9) + 1e-15
            print(f"  r = ({r1:g}, {r0:g}): {name:>6} worse than none: {intervals(worse, grid)}")
    print()

    print(f"Closed form vs Monte Carlo (n = {args.n_mc}, seed {args.seed}): exact | MC +- s.e.")

    def report(name, exact, g, b):
        mc, se = mc_variance(g)
        z = f"{(mc - exact) / se:+.1f}" if se > 0 else "-"
        print(f"    {name:>8}: {float(exact):.6f} | {mc:.6f} +- {se:.6f}  z = {z:>4}  (b = {float(b):.4g})")

    for (r1, r0), p, bernoulli in [(settings[0], 0.9, False), (tuple(args.q), 0.7, True)]:
        print(f"  two-arm {'Bernoulli q' if bernoulli else 'r'}=({r1:g},{r0:g}) p={p}")
        for name, b in two_arm_baselines(p, r1, r0).items():
            report(name, gradient_variance(p, r1, r0, b, bernoulli),
                   sample_two_arm_gradients(p, r1, r0, b, args.n_mc, rng, bernoulli), b)
    theta, r = args.theta, args.arm_rewards
    pi = softmax(theta)
    print(f"  {len(theta)}-arm softmax theta={tuple(theta)} r={tuple(r)}: pi = ({', '.join(f'{p:.4f}' for p in pi)}), "
          f"W = E||s||^2 = 1 - ||pi||^2 = {1 - pi @ pi:.4f}")
    for name, b in softmax_baselines(theta, r).items():
        report(name, softmax_gradient_variance(theta, r, b),
               sample_softmax_gradients(theta, r, b, args.n_mc, rng), b)
    print()

    ps = [0.1, 0.3, 0.5, 0.7, 0.9]
    print("Group estimators: E[g] / grad J by exact enumeration, r = (1, 0)")
    print(f"{'':>16}{'K':>3} " + "".join(f"{'p=' + str(p):>8}" for p in ps))
    for label, adv in [("RLOO", rloo_advantages), ("mean incl. self", mean_advantages),
                       ("GRPO", grpo_advantages)]:
        for K in bias_group_sizes(args.K):
            ratios = [group_bias_ratio(p, 1.0, 0.0, adv, K) for p in ps]
            print(f"{label:>16}{K:>3} " + "".join(f"{r:>8.4f}" for r in ratios))
    print()


def bias_group_sizes(K):
    return sorted({2, K, 2 * K})


def plot_variance(settings, K, path):
    """Variance vs p, one panel per reward setting. GRPO is left out: its estimator is biased and
    measured in units of reward / std, so it has its own figure (plot_group_bias)."""
    import matplotlib  # imported here so that importing this file does no work
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = np.linspace(0.005, 0.995, 199)
    fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.6), squeeze=False)
    for ax, (r1, r0) in zip(axes[0], settings):
        var = {name: gradient_variance(p, r1, r0, b) for name, b in two_arm_baselines(p, r1, r0).items()}
        ax.fill_between(p, 0, 1, where=var["mean"] > var["none"], color="0.9",
                        transform=ax.get_xaxis_transform(), label="mean worse than none")
        for name, v in var.items():
            ax.plot(p, v, label=name)
        rloo = [K * group_gradient_moments(pk, r1, r0, rloo_advantages, K)[1] for pk in p]
        ax.plot(p, rloo, "k:", label=f"RLOO, K={K} (K x Var)")
        ax.set(title=f"r = ({r1:g}, {r0:g})", xlabel="p = P(action 1)")
        ax.set_ylim(bottom=-0.02 * ax.get_ylim()[1])  # keep the optimal line (= 0) visible
    axes[0, 0].set_ylabel("Var of (r_a - b) s(a)")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=6, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_group_bias(K, path):
    """E[g] / grad J vs p for RLOO, mean incl. self and GRPO, group sizes 2, K, 2K."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = np.linspace(0.01, 0.99, 99)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.axhline(1.0, color="k", lw=1, label="RLOO (unbiased)")
    for i, k in enumerate(bias_group_sizes(K)):
        color = f"C{i}"
        ax.plot(p, [group_bias_ratio(pk, 1.0, 0.0, grpo_advantages, k) for pk in p], color=color,
                label=f"GRPO, K={k}")
        ax.plot(p, [group_bias_ratio(pk, 1.0, 0.0, mean_advantages, k) for pk in p], "--",
                color=color, label=f"mean incl. self, K={k}")
    ax.set(xlabel="p = P(action 1) (success rate)", ylabel="E[g] / grad J",
           title="Bias of group estimators, r = (1, 0)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rewards", nargs="+", default=["1,0", "2,1", "1,-1"],
                        help="two-arm reward settings 'r1,r0' (one table block and one panel each)")
    parser.add_argument("--p", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9, 0.99],
                        help="values of p = P(action 1) in the two-arm table")
    parser.add_argument("--q", nargs=2, type=float, default=[0.8, 0.3], metavar=("Q1", "Q0"),
                        help="success probabilities for the Bernoulli-reward Monte Carlo check")
    parser.add_argument("--theta", nargs="+", type=float, default=[0.5, 0.0, -0.3],
                        help="logits of the K-armed softmax example")
    parser.add_argument("--arm-rewards", nargs="+", type=float, default=[1.0, 0.4, 0.0],
                        help="rewards of the K-armed softmax example (same length as --theta)")
    parser.add_argument("--K", type=int, default=4, help="group size for RLOO / GRPO (>= 2)")
    parser.add_argument("--n-mc", type=int, default=200_000, help="Monte Carlo samples per check")
    parser.add_argument("--out", default="toy_bandit_out", help="folder for the PNG figures")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Monte Carlo checks")
    args = parser.parse_args(argv)
    if not 2 <= args.K <= 6:
        parser.error("--K must be between 2 and 6 (the bias figure enumerates 2^(2K) outcomes)")
    try:
        args.settings = [tuple(float(x) for x in s.split(",")) for s in args.rewards]
    except ValueError:
        args.settings = []
    if not args.settings or any(len(s) != 2 for s in args.settings):
        parser.error("--rewards takes pairs 'r1,r0', e.g. --rewards 1,0 2,1")
    if not all(0 <= q <= 1 for q in args.q):
        parser.error("--q are success probabilities, each in [0, 1]")
    if len(args.theta) != len(args.arm_rewards):
        parser.error("--theta and --arm-rewards must have the same length")
    if args.n_mc < 2:
        parser.error("--n-mc must be at least 2")
    return args


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print_tables(args, rng)
    plot_variance(args.settings, args.K, out / "variance_vs_p.png")
    plot_group_bias(args.K, out / "group_bias_vs_p.png")
    print(f"wrote {out / 'variance_vs_p.png'} and {out / 'group_bias_vs_p.png'}")


if __name__ == "__main__":
    main()
