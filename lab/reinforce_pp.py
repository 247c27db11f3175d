"""REINFORCE++ (Hu et al., 2025, https://arxiv.org/abs/2501.03262): REINFORCE with PPO's tricks and no critic, no
per-group standardisation.

For each prompt x, sample G responses y_1..y_G ~ pi(.|x) (as GRPO, so the two compare at equal samples). The k1
penalty to the frozen reference is folded into the reward of every token, the task reward R_i added at the last one;
the return is the sum of the rewards from t on (gamma = 1), and the advantage is that return normalised over every
token of the whole batch, on every process:

    r_t = -beta k1_t (+ R_i at the last token),   G_t = sum_{s >= t} r_s
    A_t = (G_t - mean(G)) / std(G),   mean and std over all the batch's tokens
    loss_t = -min(rho_t A_t, clip(rho_t, 1 - epsilon, 1 + epsilon) A_t)

The batch, not the group, sets the scale: a prompt every sample solves keeps a positive advantage. REINFORCE++-baseline
(--baseline group) first subtracts each group's mean of G_0 = R_i - beta sum_t k1_t, then normalises over the batch,
one advantage per sequence.

    accelerate launch reinforce_pp.py                            # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 reinforce_pp.py   # data-parallel on CPU
    python reinforce_pp.py --baseline group                      # REINFORCE++-baseline
    python lab/reinforce_pp.py --async_rollouts 1 --tis_cap 2    # a sampler process one step ahead, TIS
"""
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # run as lab/reinforce_pp.py: the repository's root first, so `reinforce_pp` is the lesson
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
import exploration  # noqa: E402
from reinforce_pp import reinforce_pp_advantages  # noqa: E402  (the lesson's math)
from lab import config as lab_config  # noqa: E402
from lab import budget, corrections, engine, environments, losses, tasks  # noqa: E402
from support import config, helpers  # noqa: E402
from support.config import arg  # noqa: E402


@dataclass
class Config(environments.AgentConfig, budget.ExplorationConfig, lab_config.GroupConfig):
    beta: float = arg(0.01, "Coefficient of the per-token k1 penalty in the reward (0 = no reference).")
    epsilon: float = arg(0.2, "Clip the ratio to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float = arg(None, "The upper clip (default: epsilon).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy).")
    baseline: str = arg("none", "Subtract first: none (REINFORCE++) | group (its mean; -baseline).")
    loss_agg: str = arg("token-mean", "Loss aggregation: token-mean (REINFORCE++) | seq-mean-token-mean | "
                        "seq-mean-token-sum-norm.")

    def __post_init__(self):
        self.reuses_batch = self.num_epochs > 1
        super().__post_init__()
        config.check_rules(self, beta=config.NON_NEGATIVE, num_epochs=config.AT_LEAST_ONE, epsilon=config.FRACTION,
                           epsilon_high=config.POSITIVE, loss_agg=config.one_of(*common.LOSS_AGG_MODES),
                           baseline=config.one_of("none", "group"))
        config.check(self.geo_mask_delta == 0 or self.baseline == "group", "--geo_mask_delta masks sequences by "
                     "their advantage, and REINFORCE++'s is per token: give --baseline group (one per sequence), or "
                     "--tis_cap or --tis_veto.")
        self.clip = common.Clip(self.epsilon, self.epsilon_high or self.epsilon)


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
        mask, T = rollout.mask, rollout.mask.shape[1]  # (B, T): 1 on each completion's actions

        # ---- reward, and the log-probs the loss compares with ----
        with trainer.timer("reward"):
            rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
        groups, ids = sampler.record(rollout, correct)  # each row's group, what its baseline runs over (None: G rows)
        ref_logp = trainer.reference_logprobs(ref_model, rollout)  # pi_ref (None when beta = 0)
        scored = cfg.num_epochs > 1 or ref_logp is not None  # pi_old: for the ratio, and for k1 in the reward
        old_logp = trainer.old_logprobs(rollout) if scored else None  # mu = 1 and beta = 0: logp
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy
        m2po_keep = engine.m2po_keep(trainer, rollout, old_logp, rollout_logp)  # M2PO's mask of the batch, or None

        # ---- advantages: k1 in each token's reward, the return normalised over the whole batch ----
        kl = common.kl_k1(old_logp, ref_logp) if ref_logp is not None else torch.zeros_like(mask.float())
        # every process's tokens (completions padded to one length), then this one's rows
        all_kl, all_mask = (accelerator.gather(accelerator.pad_across_processes(x, dim=1)) for x in (kl, mask))
        all_rewards = accelerator.gather(rewards)
        if cfg.baseline == "group" and ids is not None:  # knapsack's groups, tree's ancestors: G_0 less their mean
            returns = all_rewards - cfg.beta * common.masked_sum(all_kl, all_mask, dim=1)  # (B,): G_0
            centred = exploration.grpo_advantages_by_group(returns, budget.gathered(accelerator, ids), "none")
            adv = common.masked_whiten(centred[:, None].expand_as(all_kl), all_mask)  # as the lesson whitens
        else:
            adv = reinforce_pp_advantages(all_rewards, all_kl, all_mask, cfg.beta,
                                          group_size if cfg.baseline == "group" else None)  # -baseline: G rows
        adv = adv.chunk(accelerator.num_processes)[accelerator.process_index][:, :T]  # (B, T)
        row_adv = common.masked_mean(adv, mask, dim=1)  # (B,): --baseline group's A_i; the geometric mask's

        # ---- update: mu optimizer steps on the same batch, each summing its micro-batches' gradients ----
        for epoch in range(cfg.num_epochs):  # the stats are those of the last (most off-policy) update
            for mb in trainer.micro_batches(rollout, common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)):
                logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                old = logp.detach() if old_logp is None else mb.of(old_logp)  # mu = 1: pi_old = pi_theta in value
                pg_weight, correction, per_row = None, {}, {}
                if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                    pg_weight, correction, per_row = corrections.rollout_correction(
                        logp, old, mb.of(rollout_logp), mb.of(row_adv), mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                        cfg.tis_level, cfg.tis_veto, mb.of(m2po_keep))
                loss, stats = losses.clipped_loss(logp, old, mb.of(adv), mb.mask, cfg.clip, mb.agg, 0.0, pg_weight)
                stats = {**stats, **correction, "entropy": common.masked_mean(entropy, mb.mask)}
                trainer.backward(loss, mb, stats, per_row)
            update = trainer.step(policy)  # clip, check finite, optimizer step, zero_grad

        # ---- log (PLUMBING: docs/metrics.md says what each metric means) ----
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            **sampler.metrics(rewards, row_adv, groups),  # frac_zero_std_groups, effective_samples, decoded, sizes
            "train/adv_mean": common.masked_mean(adv, mask),
            "train/adv_abs_max": adv.abs().max(),
            "train/kl_seq": common.masked_sum(kl, mask) / len(rollout),
            **{f"train/{key}": value for key, value in update.items()},
            **reward_stats,
        }
        tokens = {"kl_k1": kl} if ref_logp is not None else {}  # for the rollout viewer, with adv
        if trainer.end_step(step, metrics, rollout, rewards, adv, tokens):
            break

    # ---- end: save, plot (PLUMBING) ----
    trainer.finish()


if __name__ == "__main__":
    helpers.launch(main)
