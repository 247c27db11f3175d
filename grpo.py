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
"""
from dataclasses import dataclass

import torch

import common
import exploration
from support import budget, config, engine, environments, tasks
from support.config import arg


@dataclass
class Config(environments.AgentConfig, budget.ExplorationConfig, config.GroupConfig):
    beta: float = arg(0.04, "Coefficient of the KL-to-reference term in the per-token loss (0 = no reference).")
    kl_estimator: str = arg("k3", "Estimator of that KL term: k3 (GRPO) | k2 | k1 (docs/algorithms.md).")
    kl_is_weight: bool = arg(False, "Multiply the KL term by the ratio pi_theta / pi_old (DeepSeek-V3.2).")
    importance_sampling_level: str = arg("token", "The clipped ratio: per token (GRPO) or per sequence (GSPO).")
    epsilon: float = arg(None, "Clip the ratio to [1 - epsilon, 1 + epsilon] (default 0.2; sequence level: 3e-4).")
    epsilon_high: float = arg(None, "Sequence level: the upper clip 1 + epsilon_high (default --epsilon, else 4e-4).")
    dual_clip_c: float = arg(0.0, "Dual clip: a token with A < 0 loses at most c |A|, whatever its ratio (0 = off).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy, the clip is inert).")
    scale_rewards: str = arg("group", "Divide the centred reward by the std of: group | batch | none (Dr. GRPO).")
    loss_agg: str = arg("seq-mean-token-mean", "Loss aggregation: seq-mean-token-mean (GRPO) | token-mean | "
                        "seq-mean-token-sum-norm (Dr. GRPO).")

    def __post_init__(self):
        self.reuses_batch = self.num_epochs > 1
        super().__post_init__()
        config.check_rules(self, beta=config.NON_NEGATIVE)
        config.check_rules(self, dual_clip_c=config.DUAL_CLIP, num_epochs=config.AT_LEAST_ONE)
        config.check_rules(self, kl_estimator=config.one_of("k1", "k2", "k3"), epsilon=config.FRACTION, epsilon_high=
                           config.POSITIVE, importance_sampling_level=config.one_of("token", "sequence"), scale_rewards=
                           config.one_of("group", "batch", "none"), loss_agg=config.one_of(*common.LOSS_AGG_MODES))
        sequence = self.importance_sampling_level == "sequence"  # GSPO's clip range: v2 section 5.1
        config.check(sequence or self.epsilon_high is None, "--epsilon_high needs --importance_sampling_level sequence")
        if sequence and self.epsilon_high is None:
            self.epsilon_high = 4e-4 if self.epsilon is None else self.epsilon
        self.epsilon = (3e-4 if sequence else 0.2) if self.epsilon is None else self.epsilon
        config.check(not sequence or self.loss_agg != "token-mean", "--importance_sampling_level sequence: one term "
                     "per sequence, which --loss_agg token-mean would weigh by its tokens.")
        self.clip = common.Clip(self.epsilon, self.epsilon_high or self.epsilon, self.dual_clip_c,
                                self.importance_sampling_level)


def grpo_advantages(rewards, group_size, scale_rewards="group", eps=1e-6, group_ids=None):
    """A_i = (r_i - mean(r_group)) / (std + eps) for (B,) rewards, each group's G samples adjacent.

    std is torch.std (Bessel's correction, ddof=1, as TRL and verl); eps = 1e-6 as verl (TRL
    uses 1e-4). scale_rewards: 'group' divides by the group's std (GRPO), 'batch' by the std of
    all B rewards, 'none' only centres (Dr. GRPO). A group whose rewards are all equal gets
    exactly 0 for every member. Returns (B,). group_ids: (B,) groups of any size, or (B, D) tree ancestors.
    """
    if group_ids is not None:
        return exploration.grpo_advantages_by_group(rewards, group_ids, scale_rewards, eps)
    # BEGIN SOLUTION
    grouped = rewards.view(-1, group_size)  # (B / G, G)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    adv[(grouped == grouped[:, :1]).all(dim=1)] = 0.0  # the mean of equal floats may round
    if scale_rewards == "group":
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        adv = adv / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return adv.view(-1)
    # END SOLUTION


def grpo_loss(logp, old_logp, ref_logp, adv, mask, clip, beta, loss_agg="seq-mean-token-mean",
              kl_term=common.KLTerm(), pg_weight=None):
    """Clipped surrogate plus beta * KL to the reference, per token (DeepSeekMath eq. 3).

    logp: (B, T) log-probs under the policy being trained (with grad); old_logp: (B, T) at sampling
    time (detached); adv: (B,), the same for every token. pg_weight (B, T), detached, multiplies the
    surrogate (TIS, masks). clip: a common.Clip (or a tuple of its fields), the range of the ratio and its dual
    clip, or a number epsilon: [1 - epsilon, 1 + epsilon]; at clip.level "sequence" (GSPO) each token of sequence
    i gets s_i = exp(mean_t log rho_t), clipped once per sequence. ref_logp: (B, T) under the reference, or None
    when beta == 0; the KL term (kl_term: its estimator and ratio weight, common.kl_penalty) keeps its gradient
    through logp. loss_agg: a mode of common.aggregate_loss, or the micro-batch's common.Aggregation.
    Returns (loss, stats): clip_frac_low / clip_frac_high, the fraction of tokens clipped below
    (ratio < 1 - clip.low, A < 0) and above (ratio > 1 + clip.high, A > 0); approx_kl, k3 of the token ratio, an
    estimate of KL(pi_old || pi_theta); kl_k3, the mean k3 to the reference; kl_term, the mean of the term beta
    multiplies (the KL term stays per token).
    """
    clip, kl_term = common.Clip(*clip) if isinstance(clip, tuple) else common.Clip(clip, clip), common.KLTerm(*kl_term)
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take logp's value,
    # so the gradient at a padded position is 0, not 0 * inf = NaN from an exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    ref_logp = None if ref_logp is None else torch.where(mask.bool(), ref_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # rho_t = pi_theta / pi_old
    sequence = clip.level == "sequence"  # GSPO (Zheng et al., 2025): one ratio and one term per sequence
    if sequence:  # s_i = exp(mean_t log rho_t) on every token of sequence i (eq. 7)
        ratio = torch.exp(common.masked_mean(log_ratio, mask, dim=1))[:, None].expand_as(logp)
    adv = adv[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv)
    if clip.dual_c > 0:  # dual clip (Ye et al., 2020): with A < 0 the min above is unbounded in rho
        surrogate = torch.where(adv < 0, torch.max(surrogate, clip.dual_c * adv), surrogate)
    if pg_weight is not None:  # a padding weight may hold anything: keep it out of the gradient
        surrogate = torch.where(mask.bool(), pg_weight, 0.0) * surrogate
    kl = torch.zeros_like(logp) if ref_logp is None else \
        common.kl_penalty(logp, ref_logp, kl_term.estimator, old_logp if kl_term.ratio_weight else None)
    if sequence:  # GSPO: the surrogate once per sequence (the mean of its equal token terms), the KL term per token
        loss = common.aggregate_loss(-surrogate, mask, common.per_sequence(loss_agg)) + \
            common.aggregate_loss(beta * kl, mask, loss_agg)
    else:
        loss = common.aggregate_loss(-surrogate + beta * kl, mask, loss_agg)
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean(((ratio < 1 - clip.low) & (adv < 0)).float(), mask),
            "clip_frac_high": common.masked_mean(((ratio > 1 + clip.high) & (adv > 0)).float(), mask),
            "approx_kl": common.masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),
            "kl_k3": common.masked_mean(common.kl_k3(logp, ref_logp) if ref_logp is not None else kl, mask),
            "kl_term": common.masked_mean(kl, mask),
        }
    return loss, stats
    # END SOLUTION


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, reference (PLUMBING: skip on a first read) ----
    accelerator = config.make_accelerator(cfg)
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
        old_logp = trainer.old_logprobs(rollout) if cfg.num_epochs > 1 else None  # pi_old; mu = 1: logp
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy

        # ---- advantages: each reward standardised within its group ----
        adv = grpo_advantages(accelerator.gather(rewards), group_size, cfg.scale_rewards,  # batch: every process's std
                              group_ids=budget.gathered(accelerator, ids))  # knapsack's groups, tree's ancestors
        adv = adv.chunk(accelerator.num_processes)[accelerator.process_index]

        # ---- update: mu optimizer steps on the same batch, each summing its micro-batches' gradients ----
        for epoch in range(cfg.num_epochs):  # the stats are those of the last (most off-policy) update
            kl_seq = 0.0
            for mb in trainer.micro_batches(rollout, common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)):
                logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                old = logp.detach() if old_logp is None else mb.of(old_logp)  # mu = 1: pi_old = pi_theta in value
                pg_weight, correction, per_row = None, {}, {}
                if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                    pg_weight, correction, per_row = common.rollout_correction(
                        logp, old, mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                        cfg.tis_level, cfg.tis_veto, cfg.m2po_tau)
                loss, stats = grpo_loss(logp, old, mb.of(ref_logp), mb.of(adv), mb.mask, cfg.clip, cfg.beta, mb.agg,
                                        common.KLTerm(cfg.kl_estimator, cfg.kl_is_weight), pg_weight)
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
    main()
