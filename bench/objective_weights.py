"""The clipped-objective family in one picture (docs/objectives.md): the weight w(r) each objective puts on a token's
score, d objective / d log pi = w(r) A, against the token's ratio r = pi_theta / pi_old, for A > 0 and A < 0.

The weights are not drawn from formulas: each is the gradient, by autograd, of the loss the code trains with
(grpo.grpo_loss for PPO's clip, lab/losses.py's grpo_loss for the dual clip, objectives.py for CISPO, SAPO and
GMPO), on one token with A = +1
or -1, so the picture is of the code. GMPO's is a one-token sequence's (a longer one divides the weight among its
tokens: docs/objectives.md).

    python bench/objective_weights.py                      # writes docs/figures/objective_weights.png
    python bench/objective_weights.py --check              # the weights at a few ratios, printed, no figure
"""
import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import objectives  # noqa: E402
from grpo import grpo_loss  # noqa: E402
from lab import losses  # noqa: E402

EPSILON, DUAL_C, CISPO_CLIP, GMPO_CLIP = 0.2, 3.0, (0.2, 0.28), (0.4, 0.4)
CLIP, NO_CLIP = common.Clip(EPSILON, EPSILON), common.Clip(1e9, 1e9)
# name -> loss(logp, old_logp, adv, mask), each on (1, 1) tensors, mean over the one token
OBJECTIVES = {
    "unclipped ratio (w = r)": lambda logp, old, adv, mask: grpo_loss(logp, old, None, adv, mask, NO_CLIP, 0.0)[0],
    f"PPO clip (eps {EPSILON})": lambda logp, old, adv, mask: grpo_loss(logp, old, None, adv, mask, CLIP, 0.0)[0],
    f"dual clip (c {DUAL_C:g})": lambda logp, old, adv, mask: losses.grpo_loss(
        logp, old, None, adv, mask, CLIP, 0.0, dual_c=DUAL_C)[0],
    f"CISPO (clip {CISPO_CLIP[0]}, {CISPO_CLIP[1]})": lambda logp, old, adv, mask: objectives.cispo_loss(
        logp, old, adv, mask, CISPO_CLIP)[0],
    "SAPO (tau 1.0 / 1.05)": lambda logp, old, adv, mask: objectives.sapo_loss(logp, old, adv, mask)[0],
    "GMPO (log-clip 0.4)": lambda logp, old, adv, mask: objectives.gmpo_loss(logp, old, adv, mask, GMPO_CLIP)[0],
}


def weight(loss_fn, ratio, adv):
    """w(r) = -(d loss / d log pi) / A for one token with ratio r and advantage adv, in float64."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss = loss_fn(logp, torch.zeros_like(logp), torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1))
    (grad,) = torch.autograd.grad(loss, logp)
    return -grad.item() / adv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures" / "objective_weights.png"))
    ap.add_argument("--check", action="store_true", help="print the weights at r = 0.5, 1, 1.5, 4; no figure")
    args = ap.parse_args()
    if args.check:
        for adv in (1.0, -1.0):
            for name, fn in OBJECTIVES.items():
                weights = [weight(fn, r, adv) or 0.0 for r in (0.5, 1, 1.5, 4)]  # (or: no -0.0)
                print(f"A {adv:+g} {name:32s}", " ".join(f"w({r:g}) {w:.4f}" for r, w in zip((0.5, 1, 1.5, 4), weights)))
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [0.05 + 0.01 * i for i in range(396)]  # 0.05 .. 4.0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = ["k:", "C0-", "C1--", "C2-", "C3-", "C4-."]
    for ax, adv in zip(axes, (1.0, -1.0)):
        for (name, fn), style in zip(OBJECTIVES.items(), styles):
            weights = [weight(fn, r, adv) for r in ratios]
            weights = [w if i == 0 or abs(w - weights[i - 1]) < 0.3 else float("nan")  # a clip's step: no riser
                       for i, w in enumerate(weights)]
            ax.plot(ratios, weights, style, label=name, lw=1.8)
        ax.axvline(1.0, color="grey", lw=0.6)
        ax.set_title(f"A {'> 0' if adv > 0 else '< 0'}:  d objective / d log pi = w(r) A")
        ax.set_xlabel("ratio r = pi_theta / pi_old of the token")
        ax.set_ylim(-0.1, 4.1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("w(r)   (0: the token is silenced)")
    axes[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
