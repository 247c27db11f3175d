"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025,
https://arxiv.org/abs/2503.14476).

For each prompt x, sample a group of G responses y_1..y_G ~ pi(.|x): the group is the baseline,
so no value model and no greedy decode. The price is G generations per prompt.
GRPO's advantage A_i = (r_i - mean(r)) / (std(r) + eps) and clipped surrogate, with four changes, each a flag or a line:
  1. Clip-higher: clip(rho, 1 - epsilon_low, 1 + epsilon_high) with epsilon_high > epsilon_low, so low-probability
     tokens with A > 0 can grow further before the clip stops them (entropy collapse is slower).
  2. Dynamic sampling: a group whose answers are all right or all wrong has A = 0 and teaches nothing. Drop it and
     sample new prompts until the batch holds batch_size / G groups of mixed correctness (--max_sampling_rounds).
  3. Token-mean: the loss is the mean over all tokens of the batch, so long responses weigh by their length
     (GRPO averages per sequence first).
  4. Overlong shaping: a length penalty, 0 up to max_len - cache_len tokens, falling linearly to -1 at max_len,
     is added to the reward.
No KL term and no reference model: the policy is meant to move far from its start.

    accelerate launch dapo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 dapo.py      # data-parallel on CPU
    python dapo.py --epsilon_high 0.2 --overlong_cache_len 0     # symmetric clip, no length shaping
"""
import sys
from dataclasses import dataclass

import torch

import common
import exploration
from support import budget, config, engine, environments, tasks
from support.config import arg


@dataclass
class Config(environments.AgentConfig, budget.ExplorationConfig, config.GroupConfig):
    epsilon_low: float = arg(0.2, "Clip the ratio below at 1 - epsilon_low (DAPO: 0.2).")
    epsilon_high: float = arg(0.28, "Clip the ratio above at 1 + epsilon_high (DAPO: 0.28), >= epsilon_low.")
    dual_clip_c: float = arg(0.0, "Dual clip: a token with A < 0 loses at most c |A|, whatever its ratio (0 = off).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy, the clip is inert).")
    max_sampling_rounds: int = arg(8, "Dynamic sampling: at most this many generation rounds per step.")
    dynamic_sampling_metric: str = arg("correct", "Drop groups whose 'correct' (DAPO) or 'reward' is all equal.")
    overlong_cache_len: int = arg(3, "Overlong shaping: penalty from max_new_tokens - cache_len tokens on (0 = off).")

    def __post_init__(self):
        self.reuses_batch = self.num_epochs > 1
        super().__post_init__()
        config.check_rules(self, dual_clip_c=config.DUAL_CLIP, num_epochs=config.AT_LEAST_ONE)
        config.check_rules(self, epsilon_low=config.FRACTION, epsilon_high=config.POSITIVE,
                           max_sampling_rounds=config.AT_LEAST_ONE,
                           dynamic_sampling_metric=config.one_of("correct", "reward"))
        config.check(self.epsilon_high >= self.epsilon_low,
                     f"--epsilon_high ({self.epsilon_high}) must be >= --epsilon_low ({self.epsilon_low}).")
        config.check(self.dynamic_sampling_metric == "reward" or self.answer_column or self.dataset == "arithmetic",
                     "--answer_column '' gives no correctness to filter on: use --dynamic_sampling_metric reward.")
        config.check(0 <= self.overlong_cache_len <= self.max_new_tokens,
                     f"--overlong_cache_len must be in [0, --max_new_tokens] (got {self.overlong_cache_len}).")
        self.clip = common.Clip(self.epsilon_low, self.epsilon_high, self.dual_clip_c)


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


def dynamic_sampling_filter(correct, group_size, group_ids=None):
    """Keep mask (num_groups,) bool: True for a group whose 0/1 correctness is mixed (some right,
    some wrong), False when all are right or all are wrong. Filters on correctness, not on the
    shaped reward (an all-wrong group with different lengths is still dropped). group_ids: as grpo_advantages'."""
    if group_ids is not None:
        return ~exploration.all_equal(correct, group_ids)
    # BEGIN SOLUTION
    grouped = correct.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
    # END SOLUTION


def overlong_penalty(lengths, max_len, cache_len):
    """DAPO's soft overlong punishment (eq. 13), added to the reward, for (B,) lengths in tokens:

        0                                   if L <= max_len - cache_len
        ((max_len - cache_len) - L) / cache_len   if max_len - cache_len < L <= max_len
        -1                                  if L > max_len
    """
    # BEGIN SOLUTION
    lengths = lengths.float()
    expected_max = max_len - cache_len
    if cache_len == 0:
        return torch.where(lengths > max_len, -1.0, 0.0)
    penalty = ((expected_max - lengths) / cache_len).clamp(min=-1.0, max=0.0)
    return penalty
    # END SOLUTION


def dapo_loss(logp, old_logp, adv, mask, clip, pg_weight=None, loss_agg="token-mean"):
    """Clipped surrogate with the decoupled clip range, token-mean over the whole batch (DAPO eq. 8).

    logp: (B, T) log-probs under the policy being trained (with grad); old_logp: (B, T) at sampling
    time (detached); adv: (B,), the same for every token. pg_weight (B, T), detached, multiplies the
    surrogate (TIS, masks). clip: a common.Clip (or a tuple of its fields), the range of the ratio and its dual
    clip: [1 - epsilon_low, 1 + epsilon_high]. loss_agg: token-mean, or the micro-batch's common.Aggregation of it.
    Returns (loss, stats): clip_frac_low / clip_frac_high, the fraction of tokens clipped below
    (ratio < 1 - clip.low, A < 0) and above (ratio > 1 + clip.high, A > 0); approx_kl, k3 of the token ratio, an
    estimate of KL(pi_old || pi_theta).
    """
    clip = common.Clip(*clip)
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take logp's value,
    # so the gradient at a padded position is 0, not 0 * inf = NaN from an exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # rho_t = pi_theta / pi_old
    adv = adv[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv)
    if clip.dual_c > 0:  # dual clip (Ye et al., 2020): with A < 0 the min above is unbounded in rho
        surrogate = torch.where(adv < 0, torch.max(surrogate, clip.dual_c * adv), surrogate)
    if pg_weight is not None:  # a padding weight may hold anything: keep it out of the gradient
        surrogate = torch.where(mask.bool(), pg_weight, 0.0) * surrogate
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean(((ratio < 1 - clip.low) & (adv < 0)).float(), mask),
            "clip_frac_high": common.masked_mean(((ratio > 1 + clip.high) & (adv > 0)).float(), mask),
            "approx_kl": common.masked_mean(ratio - 1 - log_ratio, mask),
        }
    return loss, stats
    # END SOLUTION


def fill_batch(kept, batch_size, accelerator, pad_token_id):
    """The kept rows as one (rollout, rewards, correct), as many on every process (the fewest kept, at most
    batch_size: they step together); three Nones when a process kept nothing: every process skips the step."""
    n = engine.fewest(accelerator, min(sum(len(rollout) for rollout, _, _ in kept), batch_size))
    if n == 0:
        return None, None, None
    rollout = engine.Rollout.cat([rollout for rollout, _, _ in kept], pad_token_id, limit=n)
    return rollout, torch.cat([r for _, r, _ in kept])[:n], torch.cat([c for _, _, c in kept])[:n]


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, reference (PLUMBING: skip on a first read) ----
    accelerator = config.make_accelerator(cfg)
    tokenizer, train_data, eval_data = engine.load_data(cfg, accelerator)
    reward_fn = tasks.make_reward_fn(cfg, accelerator)
    policy, _, rollout_model = engine.load_models(cfg, accelerator, reference=False, rollout_copy=True)  # no KL term
    group_size = cfg.num_generations
    sampler = budget.BudgetSampler(train_data, cfg, accelerator.process_index, accelerator.num_processes)
    trainer = engine.Trainer(cfg, accelerator, tokenizer, sampler, eval_data, policy, rollout_model, cfg.rollout_lag)
    if trainer.resume() == 0:  # --resume_from: the checkpoint's step, else 0
        trainer.evaluate(step=0)  # held-out accuracy before training

    for step in trainer.steps():
        # ---- rollout: groups of G sampled responses, with dynamic sampling: rounds of groups until the batch is
        # full of groups whose answers are mixed (all right or all wrong: A = 0, nothing to learn, dropped) ----
        kept, sampled_rewards, round_stats = [], [], []  # kept: (rollout, rewards, correct) of each round
        while len(kept) < cfg.max_sampling_rounds and engine.any_process(  # every process samples as many rounds
                accelerator, sum(len(rollout) for rollout, _, _ in kept) < cfg.batch_size):
            rollout = trainer.rollout(sampler)  # each prompt's G samples adjacent (knapsack: its n_i)
            with trainer.timer("reward"):
                rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
            groups, _ = sampler.record(rollout, correct)  # each row's group; each prompt's success rate kept
            keep = dynamic_sampling_filter(correct if cfg.dynamic_sampling_metric == "correct" else rewards, group_size,
                                           group_ids=None if cfg.budget == "uniform" else groups)[groups]
            kept.append((rollout.select(keep), rewards[keep], correct[keep]))
            sampled_rewards.append(rewards)
            round_stats.append(reward_stats)
        reward_stats = {key: sum(s[key] for s in round_stats) / len(round_stats) for key in round_stats[0]}
        held, sampled_rewards = sum(len(rollout) for rollout, _, _ in kept), torch.cat(sampled_rewards)
        rollout, rewards, correct = fill_batch(kept, cfg.batch_size, accelerator, tokenizer.pad_token_id)
        if held < cfg.batch_size:
            print(f"warning: step {step} (rank {accelerator.process_index}): --max_sampling_rounds "
                  f"{cfg.max_sampling_rounds} reached with {held // group_size} groups of mixed "
                  f"{cfg.dynamic_sampling_metric}; " + ("skipping the step" if rollout is None else "training on those")
                  + ". Raise --max_sampling_rounds to fill the batch.", file=sys.stderr, flush=True)
        metrics = {"train/skipped_step": float(rollout is None), "train/sampling_rounds": len(kept),
                   "train/groups_dropped": (len(sampled_rewards) - held) // group_size,
                   "train/reward_sampled": sampled_rewards.mean()}
        if rollout is None:
            if trainer.end_step(step, metrics):  # a skipped step logs only what dynamic sampling did
                break
            continue

        # ---- reward: overlong shaping, after the filter; the log-probs the loss compares with ----
        penalty = overlong_penalty(rollout.mask.sum(1), cfg.max_new_tokens, cfg.overlong_cache_len)
        rewards = rewards + penalty
        old_logp = trainer.old_logprobs(rollout) if cfg.num_epochs > 1 else None  # pi_old; mu = 1: logp
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy

        # ---- advantages: each reward standardised within its group ----
        groups = exploration.group_ids(rollout.examples, rewards.device)  # (B,) each row's group (the last may be cut)
        adv = grpo_advantages(rewards, group_size, group_ids=sampler.subgroups(rollout, groups))

        # ---- update: mu optimizer steps on the same batch, each summing its micro-batches' gradients ----
        for epoch in range(cfg.num_epochs):  # the stats are those of the last (most off-policy) update
            for mb in trainer.micro_batches(rollout, common.Aggregation("token-mean")):
                logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                old = logp.detach() if old_logp is None else mb.of(old_logp)  # mu = 1: pi_old = pi_theta in value
                pg_weight, correction, per_row = None, {}, {}
                if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                    pg_weight, correction, per_row = common.rollout_correction(
                        logp, old, mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                        cfg.tis_level, cfg.tis_veto, cfg.m2po_tau)
                loss, stats = dapo_loss(logp, old, mb.of(adv), mb.mask, cfg.clip, pg_weight, mb.agg)
                stats = {**stats, **correction, "entropy": common.masked_mean(entropy, mb.mask)}
                trainer.backward(loss, mb, stats, per_row)
            update = trainer.step(policy)  # clip, check finite, optimizer step, zero_grad

        # ---- log (PLUMBING: docs/metrics.md says what each metric means) ----
        metrics = {
            **metrics,
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            **sampler.metrics(rewards, adv, groups),  # frac_zero_std_groups, effective_samples, decoded, sizes
            "train/groups_kept": int(groups[-1]) + 1,
            "train/overlong_penalty": penalty.mean(),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/adv_abs_max": adv.abs().max(),
            **{f"train/{key}": value for key, value in update.items()},
            **reward_stats,
        }
        if trainer.end_step(step, metrics, rollout, rewards, adv):
            break

    # ---- end: save, plot (PLUMBING) ----
    trainer.finish()


if __name__ == "__main__":
    main()
