"""The padding may hold anything: every loss, given NaN, an infinity or a number past exp's range at a padded position
of any of its per-token inputs, returns the loss and the gradient of the same batch with clean padding. The loops
write finite values there; a student's or a user's call need not."""
import pytest
import torch

import common
import dapo
import grpo
import ppo
import reinforce_pp
import remax
from lab import losses

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
CLEAN = {  # (B, T) inputs; their padded positions hold what a loop writes there
    "old_logp": torch.tensor([[-1.1, -2.1, -3.0], [-0.4, -0.2, -0.2]]),
    "ref_logp": torch.tensor([[-1.3, -2.2, -3.0], [-0.6, -0.2, -0.2]]),
    "pg_weight": torch.tensor([[0.5, 1.5, 0.0], [2.0, 0.0, 0.0]]),
    "token_adv": torch.tensor([[0.7, -0.3, 0.0], [-1.2, 0.0, 0.0]]),
    "kl": torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]]),
    "old_values": torch.tensor([[0.2, 0.1, 0.0], [0.4, 0.0, 0.0]]),
    "returns": torch.tensor([[1.0, 0.5, 0.0], [-0.5, 0.0, 0.0]]),
}
ADV = torch.tensor([0.7, -1.2])  # (B,): a sequence's advantage has no padding
GSPO = common.Clip(0.2, 0.2, "sequence")
LOSSES = {  # name: (loss of (inputs, logp), its per-token inputs besides logp); the lesson's, then the lab's
    "grpo": (lambda x, lp: grpo.grpo_loss(lp, x["old_logp"], x["ref_logp"], ADV, MASK, common.Clip(0.2, 0.28), 0.04),
             ("old_logp", "ref_logp")),
    "gspo, k2": (lambda x, lp: grpo.grpo_loss(lp, x["old_logp"], x["ref_logp"], ADV, MASK, GSPO, 0.04,
                                              kl_estimator="k2"), ("old_logp", "ref_logp")),
    "dapo": (lambda x, lp: dapo.dapo_loss(lp, x["old_logp"], ADV, MASK, common.Clip(0.2, 0.28)), ("old_logp",)),
    "ppo policy": (lambda x, lp: ppo.ppo_policy_loss(lp, x["old_logp"], x["token_adv"], MASK, common.Clip(0.2, 0.28)),
                   ("old_logp", "token_adv")),
    "ppo value": (lambda x, lp: ppo.ppo_value_loss(lp, x["old_values"], x["returns"], MASK, 0.2),
                  ("old_values", "returns")),
    "reinforce++": (lambda x, lp: reinforce_pp.reinforce_pp_loss(lp, x["old_logp"], x["token_adv"], MASK,
                                                                 common.Clip(0.2, 0.2)), ("old_logp", "token_adv")),
    "remax": (lambda x, lp: remax.remax_loss(lp, ADV, x["kl"], MASK, 0.1), ("kl",)),
    "lab grpo, dual clip, pg_weight": (
        lambda x, lp: losses.grpo_loss(lp, x["old_logp"], x["ref_logp"], ADV, MASK, common.Clip(0.2, 0.28), 0.04,
                                       dual_c=3.0, pg_weight=x["pg_weight"]), ("old_logp", "ref_logp", "pg_weight")),
    "lab gspo, ratio-weighted k3": (
        lambda x, lp: losses.grpo_loss(lp, x["old_logp"], x["ref_logp"], ADV, MASK, GSPO, 0.04, kl_estimator="k3",
                                       ratio_weight=True, dual_c=3.0, pg_weight=x["pg_weight"]),
        ("old_logp", "ref_logp", "pg_weight")),
    "lab dapo": (lambda x, lp: losses.clipped_loss(lp, x["old_logp"], ADV, MASK, common.Clip(0.2, 0.28), dual_c=3.0,
                                                   pg_weight=x["pg_weight"]), ("old_logp", "pg_weight")),
    "lab ppo policy": (lambda x, lp: losses.clipped_loss(lp, x["old_logp"], x["token_adv"], MASK,
                                                         common.Clip(0.2, 0.28), dual_c=3.0, pg_weight=x["pg_weight"]),
                       ("old_logp", "token_adv", "pg_weight")),
    "lab remax": (lambda x, lp: losses.remax_loss(lp, ADV, x["kl"], MASK, 0.1, pg_weight=x["pg_weight"]),
                  ("kl", "pg_weight")),
    "lab rloo": (lambda x, lp: losses.rloo_loss(lp, ADV, MASK, pg_weight=x["pg_weight"]), ("pg_weight",)),
}
CASES = [(name, arg) for name, (_, args) in LOSSES.items() for arg in args]


def loss_and_gradient(name, inputs):
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.2, -0.2]], requires_grad=True)
    loss = LOSSES[name][0](inputs, logp)[0]
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


@pytest.mark.parametrize("name, arg", CASES)
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), -float("inf"), 100.0])
def test_every_loss_ignores_what_the_padding_of_each_per_token_input_holds(name, arg, junk):
    dirty = {**CLEAN, arg: torch.where(MASK.bool(), CLEAN[arg], junk)}
    loss, grad = loss_and_gradient(name, dirty)
    assert torch.isfinite(grad).all(), grad
    torch.testing.assert_close((loss, grad), loss_and_gradient(name, CLEAN), rtol=0, atol=0)
    assert (grad[~MASK.bool()] == 0).all()  # no gradient at a padded position
