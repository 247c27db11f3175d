"""ReMax: REINFORCE with the greedy response's reward as baseline (Li et al., 2023, ICML 2024,
https://arxiv.org/abs/2310.10505).

For each prompt x, sample one response y ~ pi(.|x) and decode one greedy response y_greedy.
The advantage is A = r(x, y) - r(x, y_greedy): the greedy reward is a baseline that does not
depend on the sampled y, so the gradient stays unbiased, and it tracks how hard each prompt is,
which is what plain REINFORCE lacks when prompts differ (--baseline none shows the failure).
A per-token k1 penalty -beta * (logp - ref_logp) is folded into the return (reward-to-go).
Loss: -A_t * log pi(y_t | x, y_<t), one on-policy update per batch: no ratio, no clipping,
no value model. The price is one extra greedy generation per prompt.

    accelerate launch remax.py                                   # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 remax.py     # data-parallel on CPU
    python remax.py --reward_scales hetero --baseline none       # watch REINFORCE fail
"""
import os
import sys
from dataclasses import dataclass

if __name__ == "__main__":  # run as lab/remax.py: the repository's root first, so that `remax` is the lesson
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
from remax import remax_advantages  # noqa: E402  (the lesson's math)
from lab import config as lab_config  # noqa: E402
from lab import corrections, engine, environments, losses, tasks  # noqa: E402
from support import config, helpers  # noqa: E402
from support.config import arg  # noqa: E402


@dataclass
class Config(environments.AgentConfig, lab_config.CorrectionConfig):
    baseline: str = arg("greedy", "'greedy' (ReMax) or 'none' (plain REINFORCE).")
    beta: float = arg(0.05, "Coefficient of the per-token k1 penalty folded into the return (0 = no reference).")
    adv_clip: float = arg(5.0, "Clip the advantage r - r_greedy to [-adv_clip, adv_clip] (0 = off).")
    loss_agg: str = arg("token-mean", "Loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum-norm.")

    def __post_init__(self):
        super().__post_init__()
        config.check_rules(self, beta=config.NON_NEGATIVE)
        config.check_rules(self, baseline=config.one_of("greedy", "none"), adv_clip=config.NON_NEGATIVE,
                           loss_agg=config.one_of(*common.LOSS_AGG_MODES))


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, reference (PLUMBING: skip on a first read) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = engine.load_data(cfg, accelerator)
    reward_fn = tasks.make_reward_fn(cfg, accelerator)
    policy, ref_model, rollout_model = engine.load_models(cfg, accelerator, reference=cfg.beta > 0)
    sampler = tasks.PromptSampler(train_data, cfg.batch_size, cfg.seed, accelerator.process_index,
                                  accelerator.num_processes)
    trainer = engine.Trainer(cfg, accelerator, tokenizer, sampler, eval_data, policy, rollout_model)
    if trainer.resume() == 0:  # --resume_from: the checkpoint's step, else 0
        trainer.evaluate(step=0)  # held-out accuracy before training

    for step in trainer.steps():
        # ---- rollout: one sampled response per prompt, and (ReMax) its greedy one ----
        rollout = trainer.rollout(sampler, greedy=cfg.baseline == "greedy")  # the greedy: rollout.greedy

        # ---- reward, and the log-probs the loss compares with ----
        with trainer.timer("reward"):
            rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
        ref_logp = trainer.reference_logprobs(ref_model, rollout)  # pi_ref (None when beta = 0)
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler's, when it is a copy
        m2po_keep = engine.m2po_keep(trainer, rollout, None, rollout_logp)  # M2PO's mask of the batch, or None

        # ---- advantages: the reward of the greedy response is the baseline (ReMax), or none (REINFORCE) ----
        if cfg.baseline == "greedy":
            with trainer.timer("reward"):
                greedy = rollout.greedy  # its rewards: None, or the sampler process's (--async_rollouts)
                greedy_rewards, _, _ = reward_fn(greedy.examples, greedy.completions, greedy.rewards)
        else:
            greedy_rewards = torch.zeros_like(rewards)
        adv = remax_advantages(rewards, greedy_rewards)
        if cfg.adv_clip > 0:
            adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)

        # ---- update: one on-policy optimizer step, the batch's gradient summed over its micro-batches ----
        kl_seq = 0.0
        for mb in trainer.micro_batches(rollout, common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)):
            logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
            kl = common.kl_k1(logp.detach(), mb.of(ref_logp)) if ref_logp is not None else torch.zeros_like(logp)
            pg_weight, correction, per_row = None, {}, {}
            if rollout_logp is not None or cfg.geo_mask_delta > 0:  # a sampler that is not this policy: TIS, mask
                pg_weight, correction, per_row = corrections.rollout_correction(
                    logp, logp.detach(), mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, cfg.geo_mask_delta,
                    cfg.tis_level, cfg.tis_veto, mb.of(m2po_keep))
            loss, stats = losses.remax_loss(logp, mb.of(adv), kl, mb.mask, cfg.beta, mb.agg, pg_weight)
            stats = {**stats, **correction, "entropy": common.masked_mean(entropy, mb.mask)}
            trainer.backward(loss, mb, stats, per_row)
            kl_seq += common.masked_sum(kl, mb.mask) / len(rollout)
        update = trainer.step(policy)  # clip, check finite, optimizer step, zero_grad

        # ---- log (PLUMBING: docs/metrics.md says what each metric means) ----
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/greedy_reward": greedy_rewards.mean(),
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
