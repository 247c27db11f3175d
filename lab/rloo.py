"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., 2024, "Back to Basics",
https://arxiv.org/abs/2402.14740; the estimator is Kool et al., 2019).

For each prompt x, sample a group of G responses y_1..y_G ~ pi(.|x): the group is the baseline,
so no value model and no greedy decode. The price is G generations per prompt.
The baseline of response i is the mean reward of the OTHER G - 1, so it does not depend on y_i: no bias.
The whole completion is one action, with a k1 penalty to the frozen reference (detached) in the reward:

    A_i = r~_i - mean_{j != i} r~_j = G / (G - 1) * (r~_i - mean(r~)),   r~_i = r_i - beta * sum_t k1_t

Loss: -A_i * log pi(y_i | x) (a sum of token log-probs), averaged, one on-policy update per batch: no ratio, no clip.

    accelerate launch rloo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 rloo.py      # data-parallel on CPU
    python rloo.py --reward_scales hetero                        # the group baseline adapts per prompt
"""
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # run as lab/rloo.py: the repository's root first, so that `rloo` is the lesson
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
import exploration  # noqa: E402
from rloo import rloo_advantages  # noqa: E402  (the lesson's math)
from lab import config as lab_config  # noqa: E402
from lab import budget, corrections, engine, environments, losses, tasks  # noqa: E402
from support import config, helpers  # noqa: E402
from support.config import arg  # noqa: E402


@dataclass
class Config(environments.AgentConfig, budget.ExplorationConfig, lab_config.GroupConfig):
    beta: float = arg(0.05, "Coefficient of the sequence k1 penalty folded into the reward (0 = no reference).")

    def __post_init__(self):
        super().__post_init__()
        config.check_rules(self, beta=config.NON_NEGATIVE)
        config.check(self.micro_batch_size % self.num_generations == 0, f"--micro_batch_size ({self.micro_batch_size}) "
                     f"must be a multiple of --num_generations ({self.num_generations}): a sample's leave-one-out "
                     "baseline needs its group's KL penalties, so a micro-batch holds whole groups.")
        config.check(self.budget == "uniform" or self.micro_batch_size == 0, "--budget knapsack: --micro_batch_size 0.")


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, reference (PLUMBING: skip on a first read) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = engine.load_data(cfg, accelerator)
    reward_fn = tasks.make_reward_fn(cfg, accelerator)
    policy, ref_model, rollout_model = engine.load_models(cfg, accelerator, reference=cfg.beta > 0, rollout_copy=True)
    group_size = cfg.num_generations
    sampler = budget.BudgetSampler(train_data, cfg, accelerator.process_index, accelerator.num_processes)
    trainer = engine.Trainer(cfg, accelerator, tokenizer, sampler, eval_data, policy, rollout_model, cfg.rollout_lag)
    if trainer.resume() == 0:  # --resume_from: the checkpoint's step, else 0
        trainer.evaluate(step=0)  # held-out accuracy before training

    for step in trainer.steps():
        # ---- rollout: a group of G sampled responses per prompt ----
        rollout = trainer.rollout(sampler)  # each prompt's G samples adjacent (knapsack: its n_i)

        # ---- reward, and the log-probs the loss compares with ----
        with trainer.timer("reward"):
            rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
        groups, ids = sampler.record(rollout, correct)  # each row's group, what its baseline runs over (None: G rows)
        ref_logp = trainer.reference_logprobs(ref_model, rollout)  # pi_ref (None when beta = 0)
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy
        m2po_keep = engine.m2po_keep(trainer, rollout, None, rollout_logp)  # M2PO's mask of the batch, or None

        # ---- update: one on-policy optimizer step, the batch's gradient summed over its micro-batches ----
        adv, rewards_kl, kl_seq = [], [], 0.0
        for mb in trainer.micro_batches(rollout, common.Aggregation("seq-mean-token-sum")):  # whole groups
            logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
            kl = common.kl_k1(logp.detach(), mb.of(ref_logp)) if ref_logp is not None else torch.zeros_like(logp)
            rewards_kl.append(mb.of(rewards) - cfg.beta * common.masked_sum(kl, mb.mask, dim=1))  # r - beta sum_t k1_t
            adv.append(rloo_advantages(rewards_kl[-1], group_size) if ids is None else  # knapsack, trees
                       exploration.rloo_advantages_by_group(rewards_kl[-1], mb.of(ids)))
            pg_weight, correction, per_row = None, {}, {}
            if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                pg_weight, correction, per_row = corrections.rollout_correction(
                    logp, logp.detach(), mb.of(rollout_logp), adv[-1], mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                    cfg.tis_level, cfg.tis_veto, mb.of(m2po_keep))
            loss, stats = losses.rloo_loss(logp, adv[-1], mb.mask, mb.agg, pg_weight)
            stats = {**stats, **correction, "entropy": common.masked_mean(entropy, mb.mask),  # means over tokens
                     "seq_logp_mean": common.Sums((stats["seq_logp_mean"] * len(logp), len(logp)))}  # over rows
            trainer.backward(loss, mb, stats, per_row)
            kl_seq += common.masked_sum(kl, mb.mask) / len(rollout)
        update = trainer.step(policy)  # clip, check finite, optimizer step, zero_grad
        adv, rewards_kl = torch.cat(adv), torch.cat(rewards_kl)

        # ---- log (PLUMBING: docs/metrics.md says what each metric means) ----
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            **sampler.metrics(rewards, adv, groups),  # frac_zero_std_groups, effective_samples, decoded, sizes
            "train/reward_with_kl": rewards_kl.mean(),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/adv_abs_max": adv.abs().max(),
            "train/kl_seq": kl_seq,
            **{f"train/{key}": value for key, value in update.items()},
            **reward_stats,
        }
        if trainer.end_step(step, metrics, rollout, rewards, adv):
            break

    # ---- end: save, plot (PLUMBING) ----
    trainer.finish()


if __name__ == "__main__":
    helpers.launch(main)
