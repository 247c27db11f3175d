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
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # run as lab/dapo.py: the repository's root first, so that `dapo` is the lesson
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import exploration  # noqa: E402
from dapo import dynamic_sampling_filter, grpo_advantages, overlong_penalty  # noqa: E402 (the lesson's)
from lab import config as lab_config  # noqa: E402
from lab import budget, corrections, engine, environments, losses, tasks  # noqa: E402
from support import config, helpers  # noqa: E402
from support.config import arg  # noqa: E402


@dataclass
class Config(environments.AgentConfig, budget.ExplorationConfig, lab_config.GroupConfig):
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
        config.check_rules(self, dual_clip_c=lab_config.DUAL_CLIP, num_epochs=config.AT_LEAST_ONE)
        config.check_rules(self, epsilon_low=config.FRACTION, epsilon_high=config.POSITIVE,
                           max_sampling_rounds=config.AT_LEAST_ONE,
                           dynamic_sampling_metric=config.one_of("correct", "reward"))
        config.check(self.epsilon_high >= self.epsilon_low,
                     f"--epsilon_high ({self.epsilon_high}) must be >= --epsilon_low ({self.epsilon_low}).")
        config.check(self.dynamic_sampling_metric == "reward" or self.answer_column or self.dataset == "arithmetic",
                     "--answer_column '' gives no correctness to filter on: use --dynamic_sampling_metric reward.")
        config.check(0 <= self.overlong_cache_len <= self.max_new_tokens,
                     f"--overlong_cache_len must be in [0, --max_new_tokens] (got {self.overlong_cache_len}).")
        self.clip = common.Clip(self.epsilon_low, self.epsilon_high)


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, reference (PLUMBING: skip on a first read) ----
    accelerator = helpers.make_accelerator(cfg)
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
        rounds = []  # each round's (rollout, rewards, correct, keep, reward_stats)
        while len(rounds) < cfg.max_sampling_rounds and helpers.any_process(  # every process samples as many rounds
                accelerator, sum(int(r[3].sum()) for r in rounds) < cfg.batch_size):
            rollout = trainer.rollout(sampler)  # each prompt's G samples adjacent (knapsack: its n_i)
            with trainer.timer("reward"):
                rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
            groups, _ = sampler.record(rollout, correct)  # each row's group; each prompt's success rate kept
            values = correct if cfg.dynamic_sampling_metric == "correct" else rewards
            keep = dynamic_sampling_filter(values, group_size) if cfg.budget == "uniform" else \
                ~exploration.all_equal(values, groups)  # (num_groups,) mixed groups
            rounds.append((rollout, rewards, correct, keep[groups], reward_stats))
        n = helpers.fewest(accelerator, min(cfg.batch_size, sum(int(keep.sum()) for *_, keep, _ in rounds)))
        rollout, rewards, correct, reward_stats, metrics = helpers.fill_batch(rounds, n, cfg, tokenizer, step)
        if rollout is None:
            if trainer.end_step(step, metrics):  # a skipped step logs only what dynamic sampling did
                break
            continue

        # ---- reward: overlong shaping, after the filter; the log-probs the loss compares with ----
        # an episode's length counts the environment's tokens too: --max_new_tokens is its budget, -1 when cut there
        penalty = overlong_penalty(rollout.budget_used, cfg.max_new_tokens, cfg.overlong_cache_len)
        rewards = rewards + penalty
        old_logp = trainer.old_logprobs(rollout) if cfg.num_epochs > 1 else None  # pi_old; mu = 1: logp
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy
        m2po_keep = engine.m2po_keep(trainer, rollout, old_logp, rollout_logp)  # M2PO's mask of the batch, or None

        # ---- advantages: each reward standardised within its group ----
        groups = exploration.group_ids(rollout.examples, rewards.device)  # (B,) each row's group (the last may be cut)
        ids = sampler.subgroups(rollout, groups)  # knapsack's groups, tree's ancestors (None: G adjacent rows)
        adv = grpo_advantages(rewards, group_size) if ids is None else \
            exploration.grpo_advantages_by_group(rewards, ids)

        # ---- update: mu optimizer steps on the same batch, each summing its micro-batches' gradients ----
        for epoch in range(cfg.num_epochs):  # the stats are those of the last (most off-policy) update
            for mb in trainer.micro_batches(rollout, common.Aggregation("token-mean")):
                logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                old = logp.detach() if old_logp is None else mb.of(old_logp)  # mu = 1: pi_old = pi_theta in value
                pg_weight, correction, per_row = None, {}, {}
                if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                    pg_weight, correction, per_row = corrections.rollout_correction(
                        logp, old, mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                        cfg.tis_level, cfg.tis_veto, mb.of(m2po_keep))
                loss, stats = losses.clipped_loss(logp, old, mb.of(adv), mb.mask, cfg.clip, mb.agg, cfg.dual_clip_c,
                                                  pg_weight)
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
    helpers.launch(main)
