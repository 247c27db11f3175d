"""GRPO: Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024,
https://arxiv.org/abs/2402.03300).

For each prompt x, sample a group of G responses y_1..y_G ~ pi(.|x): the group is the baseline,
so no value model and no greedy decode. The price is G generations per prompt.
The reward of response i is standardised within its group and broadcast to its tokens, in the PPO clipped
surrogate plus a k3 KL term to the frozen reference (rho_t = pi_theta / pi_old):

    A_i = (r_i - mean(r)) / (std(r) + eps),   -min(rho_t A_i, clip(rho_t, 1 - epsilon, 1 + epsilon) A_i) + beta k3_t

With one update per batch rho = 1 and the clip is inert: REINFORCE with the group baseline; with mu > 1 updates
the batch is reused. Dividing by the std weighs each prompt by its difficulty (a bias: Dr. GRPO drops it). GSPO
clips one ratio per sequence instead of one per token.

    accelerate launch grpo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 grpo.py      # data-parallel on CPU
    python grpo.py --scale_rewards none --loss_agg seq-mean-token-sum-norm   # Dr. GRPO
    python grpo.py --importance_sampling_level sequence --beta 0  # GSPO
    python lab/grpo.py --policy_loss cispo --num_epochs 4         # CISPO, SAPO, GMPO: objectives.py
"""
import os
import sys
from dataclasses import dataclass

import torch

if __name__ == "__main__":  # run as lab/grpo.py: the repository's root first, so that `grpo` is the lesson
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import exploration  # noqa: E402
import kimi  # noqa: E402
import objectives  # noqa: E402
from grpo import grpo_advantages  # noqa: E402  (the lesson's math)
from lab import config as lab_config  # noqa: E402
from lab import budget, corrections, engine, environments, losses, tasks  # noqa: E402
from support import config, helpers  # noqa: E402
from support.config import arg  # noqa: E402


@dataclass
class Config(environments.AgentConfig, budget.ExplorationConfig, lab_config.GroupConfig):
    beta: float = arg(0.04, "Coefficient of the KL-to-reference term in the per-token loss (0 = no reference).")
    kl_estimator: str = arg("k3", "Estimator of that KL term: k3 (GRPO) | k2 | k1 (docs/algorithms.md).")
    kl_is_weight: bool = arg(False, "Multiply the KL term by the ratio pi_theta / pi_old (DeepSeek-V3.2).")
    importance_sampling_level: str = arg("token", "The clipped ratio: per token (GRPO) or per sequence (GSPO).")
    epsilon: float = arg(None, "Clip the ratio to [1 - epsilon, 1 + epsilon] (default 0.2; sequence level: 3e-4).")
    epsilon_high: float = arg(None, "Sequence level: the upper clip 1 + epsilon_high (default --epsilon, else 4e-4).")
    dual_clip_c: float = arg(0.0, "Dual clip: a token with A < 0 loses at most c |A|, whatever its ratio (0 = off).")
    policy_loss: str = arg("ppo", "The token objective: ppo (the clip) | cispo | sapo | gmpo (objectives.py; "
                           "docs/algorithms.md).")
    tau_pos: float = arg(1.0, "--policy_loss sapo: the gate's temperature on tokens with A > 0.")
    tau_neg: float = arg(1.05, "--policy_loss sapo: the gate's temperature on tokens with A <= 0.")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy, the clip is inert).")
    scale_rewards: str = arg("group", "Divide the centred reward by the std of: group | batch | none (Dr. GRPO).")
    loss_agg: str = arg("seq-mean-token-mean", "Loss aggregation: seq-mean-token-mean (GRPO) | token-mean | "
                        "seq-mean-token-sum-norm (Dr. GRPO).")
    length_penalty: float = arg(0.0, "Weight of Kimi k1.5's length reward over each group, added to the reward "
                                "(0 = off).")

    def __post_init__(self):
        self.reuses_batch = self.num_epochs > 1
        super().__post_init__()
        config.check_rules(self, beta=config.NON_NEGATIVE)
        config.check_rules(self, dual_clip_c=lab_config.DUAL_CLIP, num_epochs=config.AT_LEAST_ONE)
        config.check_rules(self, kl_estimator=config.one_of("k1", "k2", "k3"), epsilon=config.FRACTION, epsilon_high=
                           config.POSITIVE, importance_sampling_level=config.one_of("token", "sequence"), scale_rewards=
                           config.one_of("group", "batch", "none"), loss_agg=config.one_of(*common.LOSS_AGG_MODES))
        config.check_rules(self, policy_loss=config.one_of("ppo", "cispo", "sapo", "gmpo"), tau_pos=config.POSITIVE,
                           tau_neg=config.POSITIVE)
        sequence = self.importance_sampling_level == "sequence"  # GSPO's clip range: v2 section 5.1
        config.check(self.policy_loss == "ppo" or not sequence, "--importance_sampling_level sequence is GSPO, a "
                     "clip of --policy_loss ppo: give one or the other.")
        config.check(sequence or self.policy_loss in ("cispo", "gmpo") or self.epsilon_high is None,
                     "--epsilon_high needs --importance_sampling_level sequence or --policy_loss cispo | gmpo")
        if self.policy_loss == "cispo":  # MiniMax-M1: no lower bound; the cap 1 + 4 = 5 (ScaleRL, TRL's example)
            self.epsilon, self.epsilon_high = self.epsilon or 1.0, self.epsilon_high or 4.0
        if self.policy_loss == "gmpo":  # GMPO: the clip (e^-0.4, e^0.4) on each token ratio
            self.epsilon = self.epsilon or 0.4
        if sequence and self.epsilon_high is None:
            self.epsilon_high = 4e-4 if self.epsilon is None else self.epsilon
        self.epsilon = (3e-4 if sequence else 0.2) if self.epsilon is None else self.epsilon
        config.check((not sequence and self.policy_loss != "gmpo") or self.loss_agg != "token-mean", "--importance_"
                     "sampling_level sequence, --policy_loss gmpo: one term per sequence, which --loss_agg token-mean "
                     "would weigh by its tokens.")
        config.check_rules(self, length_penalty=config.NON_NEGATIVE)
        config.check(self.length_penalty == 0 or (self.budget == "uniform" and self.sampler != "tree"),
                     "--length_penalty compares the lengths of each prompt's G samples: give --budget uniform and "
                     "a --sampler other than tree.")
        self.clip = common.Clip(self.epsilon, self.epsilon_high or self.epsilon, self.importance_sampling_level)


def objective_loss(cfg, logp, old_logp, ref_logp, adv, mask, agg, pg_weight):
    """--policy_loss cispo | sapo | gmpo: objectives.py's loss plus beta times the KL term to the reference, per token
    and aggregated with agg, as grpo_loss adds it. Returns (loss, stats)."""
    if cfg.policy_loss == "cispo":
        loss, stats = objectives.cispo_loss(logp, old_logp, adv, mask, cfg.clip, agg, pg_weight)
    elif cfg.policy_loss == "sapo":
        loss, stats = objectives.sapo_loss(logp, old_logp, adv, mask, cfg.tau_pos, cfg.tau_neg, agg, pg_weight)
    else:
        loss, stats = objectives.gmpo_loss(logp, old_logp, adv, mask, cfg.clip, agg, pg_weight)
    if ref_logp is None:
        return loss, stats
    ref_logp = torch.where(mask.bool(), ref_logp, logp.detach())
    if cfg.kl_is_weight:  # DeepSeek-V3.2's ratio weight
        kl = losses.ratio_weighted_kl(logp, ref_logp, old_logp, cfg.kl_estimator)
    else:
        kl = common.kl_penalty(logp, ref_logp, cfg.kl_estimator)
    kl_term = common.masked_mean(kl.detach(), mask)
    return loss + common.aggregate_loss(cfg.beta * kl, mask, agg), {**stats, "kl_term": kl_term}


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
            if cfg.length_penalty > 0:  # Kimi k1.5: within each group the shorter right answers gain
                length_rewards = kimi.length_reward(rollout.mask.sum(1), correct, group_size)
                rewards = rewards + cfg.length_penalty * length_rewards
                reward_stats = {**reward_stats, "train/length_reward": length_rewards.mean()}
        groups, ids = sampler.record(rollout, correct)  # each row's group, what its baseline runs over (None: G rows)
        ref_logp = trainer.reference_logprobs(ref_model, rollout)  # pi_ref (None when beta = 0)
        old_logp = trainer.old_logprobs(rollout) if cfg.num_epochs > 1 else None  # pi_old; mu = 1: logp
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy
        m2po_keep = engine.m2po_keep(trainer, rollout, old_logp, rollout_logp)  # M2PO's mask of the batch, or None

        # ---- advantages: each reward standardised within its group ----
        ids = budget.gathered(accelerator, ids)  # knapsack's groups, tree's ancestors (None: G adjacent rows)
        adv = grpo_advantages(accelerator.gather(rewards), group_size, cfg.scale_rewards) if ids is None else \
            exploration.grpo_advantages_by_group(accelerator.gather(rewards), ids, cfg.scale_rewards)  # batch: all
        adv = adv.chunk(accelerator.num_processes)[accelerator.process_index]

        # ---- update: mu optimizer steps on the same batch, each summing its micro-batches' gradients ----
        for epoch in range(cfg.num_epochs):  # the stats are those of the last (most off-policy) update
            kl_seq = 0.0
            for mb in trainer.micro_batches(rollout, common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)):
                logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                old = logp.detach() if old_logp is None else mb.of(old_logp)  # mu = 1: pi_old = pi_theta in value
                pg_weight, correction, per_row = None, {}, {}
                if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                    pg_weight, correction, per_row = corrections.rollout_correction(
                        logp, old, mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                        cfg.tis_level, cfg.tis_veto, mb.of(m2po_keep))
                if cfg.policy_loss == "ppo":
                    loss, stats = losses.grpo_loss(logp, old, mb.of(ref_logp), mb.of(adv), mb.mask, cfg.clip,
                                                   cfg.beta, mb.agg, cfg.kl_estimator, cfg.kl_is_weight,
                                                   cfg.dual_clip_c, pg_weight)
                else:  # CISPO, SAPO, GMPO: the objective, then the same KL term
                    loss, stats = objective_loss(cfg, logp, old, mb.of(ref_logp), mb.of(adv), mb.mask, mb.agg, pg_weight)
                stats = {**stats, **correction, "entropy": common.masked_mean(entropy, mb.mask)}
                trainer.backward(loss, mb, stats, per_row)
                if ref_logp is not None:
                    kl_seq += common.masked_sum(common.kl_k1(logp.detach(), mb.of(ref_logp)), mb.mask) / len(rollout)
            update = trainer.step(policy)  # clip, check finite, optimizer step, zero_grad

        # ---- log (PLUMBING: docs/metrics.md says what each metric means) ----
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            **sampler.metrics(rewards, adv, groups),  # frac_zero_std_groups, effective_samples, decoded, sizes
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
