"""GRPO: Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024,
https://arxiv.org/abs/2402.03300).

For each prompt x, sample a group of G responses y_1..y_G ~ pi(.|x): the group is the baseline, so
no value model and no greedy decode. The price is G generations per prompt. The reward of response i
is standardised within its group and broadcast to its tokens, in the PPO clipped surrogate plus a k3
KL term to the frozen reference (rho_t = pi_theta / pi_old):

    A_i = (r_i - mean(r)) / (std(r) + eps)
    loss_t = -min(rho_t A_i, clip(rho_t, 1 - epsilon, 1 + epsilon) A_i) + beta k3_t

With mu = 1 update per batch rho = 1, the clip inert: REINFORCE with the group baseline. Dividing by
the std weighs each prompt by its difficulty (Dr. GRPO drops it); GSPO clips one ratio per sequence.

    accelerate launch grpo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 grpo.py      # data-parallel on CPU
    python grpo.py --scale_rewards none --loss_agg seq-mean-token-sum-norm   # Dr. GRPO
    python grpo.py --importance_sampling_level sequence --epsilon 3e-4 --epsilon_high 4e-4  # GSPO

Between the BEGIN SOLUTION and END SOLUTION comments: a classroom exercise's code, which a student
copy replaces with # HINT: lines (docs/classroom.md).
"""
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed

import common
from support import helpers
from support.models import token_logprobs  # common.token_logprobs, faster; equal (tests/test_fast.py)
from support.helpers import arg


@dataclass
class Config(helpers.TrainConfig):
    num_generations: int = arg(8, "G: completions per prompt, >= 2 (batch_size / G prompts).")
    num_steps: int = arg(600, "Optimizer steps (one rollout batch each).")
    eval_every: int = arg(50, "Held-out greedy accuracy every N steps (and at start and end).")
    beta: float = arg(0.04, "Coefficient of the per-token KL term to the reference (0 = none).")
    kl_estimator: str = arg("k3", "Estimator of that KL term: k3 (GRPO) | k2 | k1.")
    importance_sampling_level: str = arg("token", "The ratio: per token (GRPO) | sequence (GSPO).")
    epsilon: float = arg(0.2, "Clip the ratio to [1 - epsilon, 1 + epsilon_high] (GSPO: 3e-4).")
    epsilon_high: float = arg(None, "The upper clip (default: epsilon; GSPO: 4e-4).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy).")
    scale_rewards: str = arg("group", "Divide A by the std of: group | batch | none (Dr. GRPO).")
    loss_agg: str = arg("seq-mean-token-mean", "Loss aggregation: seq-mean-token-mean (GRPO) | "
                        "token-mean | seq-mean-token-sum-norm (Dr. GRPO).")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_groups(self)  # G >= 2, dividing --batch_size
        helpers.check_rules(self, beta=helpers.NON_NEGATIVE, num_epochs=helpers.AT_LEAST_ONE,
                            epsilon=helpers.FRACTION, epsilon_high=helpers.POSITIVE,
                            kl_estimator=helpers.one_of("k1", "k2", "k3"),
                            loss_agg=helpers.one_of(*common.LOSS_AGG_MODES),
                            importance_sampling_level=helpers.one_of("token", "sequence"),
                            scale_rewards=helpers.one_of("group", "batch", "none"))
        level = self.importance_sampling_level
        helpers.check(level == "token" or self.loss_agg != "token-mean", "GSPO: one term per "
                      "sequence, which --loss_agg token-mean would weigh by its length.")
        self.clip = common.Clip(self.epsilon, self.epsilon_high or self.epsilon, level)


def grpo_advantages(rewards, group_size, scale_rewards="group", eps=1e-6):
    """A_i = (r_i - mean(r_group)) / (std + eps) for (B,) rewards, each group's G samples adjacent.

    std with Bessel's correction (as TRL and verl); eps = 1e-6 as verl. scale_rewards: 'group'
    (GRPO), 'batch' (the std of all B rewards) or 'none' (Dr. GRPO). An all-equal group gets 0.
    """
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
              kl_estimator="k3"):
    """Clipped surrogate plus beta * KL to the reference, per token (DeepSeekMath eq. 3).

    logp: (B, T) under the policy trained (with grad); old_logp, ref_logp: (B, T) detached, at
    sampling time and under the reference (None when beta == 0); adv: (B,). clip: a common.Clip
    (its range and level: "sequence" is GSPO's s_i = exp(mean_t log rho_t)); kl_estimator: the KL
    term's, k1 | k2 | k3 (common.kl_penalty); loss_agg: common.aggregate_loss's mode or a
    micro-batch's Aggregation. Returns (loss, stats): common.clip_stats (clip_frac_low,
    clip_frac_high, approx_kl), kl_k3 and kl_term.
    """
    clip = common.Clip(*clip)  # a Clip, or its fields as a plain tuple
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take
    # logp's value, so the gradient at a padded position is 0, not 0 * inf = NaN from exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    ref_logp = None if ref_logp is None else torch.where(mask.bool(), ref_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # rho_t = pi_theta / pi_old
    sequence = clip.level == "sequence"  # GSPO (Zheng et al., 2025): one ratio per sequence
    if sequence:  # s_i = exp(mean_t log rho_t) on every token of sequence i (eq. 7)
        ratio = torch.exp(common.masked_mean(log_ratio, mask, dim=1))[:, None].expand_as(logp)
    adv = adv[:, None]
    surrogate = common.clipped_surrogate(ratio, adv, clip)  # min(rho A, clip(rho) A)
    kl = common.kl_penalty(logp, ref_logp, kl_estimator) if ref_logp is not None else \
        torch.zeros_like(logp)
    if sequence:  # GSPO: the surrogate once per sequence (its tokens' mean), the KL term per token
        loss = common.aggregate_loss(-surrogate, mask, common.per_sequence(loss_agg)) + \
            common.aggregate_loss(beta * kl, mask, loss_agg)
    else:
        loss = common.aggregate_loss(-surrogate + beta * kl, mask, loss_agg)
    with torch.no_grad():
        stats = {
            **common.clip_stats(ratio, log_ratio, adv, mask, clip),
            "kl_k3": common.masked_mean(common.kl_k3(logp, ref_logp) if ref_logp is not None else kl, mask),
            "kl_term": common.masked_mean(kl, mask),
        }
    return loss, stats
    # END SOLUTION


def main():
    cfg = helpers.parse_config(Config)
    # ---- setup: accelerator, data, policy and optimizer, reference (PLUMBING: skip at first) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = helpers.load_data(cfg, accelerator)
    reward_fn = helpers.make_reward_fn(cfg, accelerator)
    set_seed(cfg.seed)  # the same initial weights on every rank (a LoRA adapter is drawn)
    policy, ref_model, optimizer = helpers.load_models(cfg, accelerator, reference=cfg.beta > 0)
    G = cfg.num_generations
    prompts = helpers.prompt_sampler(train_data, cfg.batch_size // G, cfg, accelerator)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    start = helpers.resume(cfg, accelerator, prompts)  # --resume_from: its step, else 0
    logger = helpers.open_log(cfg, accelerator, start)
    if start == 0:  # held-out accuracy before training
        logger.log(0, helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    for step in helpers.steps(cfg, start, accelerator):
        started = time.time()
        # ---- rollout: a group of G sampled responses per prompt, each group's rows adjacent ----
        rollout = helpers.sample(policy, tokenizer, prompts.next(), cfg, accelerator, num_samples=G)
        mask, B, T = rollout.mask, *rollout.mask.shape  # (B, T): 1 on each completion's tokens

        # ---- reward, and the log-probs the loss compares with ----
        rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions)  # (B,)
        ref_logp = helpers.score(ref_model, rollout, cfg, truncated=False) if cfg.beta > 0 else None
        old_logp = helpers.score(policy, rollout, cfg) if cfg.num_epochs > 1 else None  # pi_old

        # ---- advantages: each reward standardised within its group ----
        adv = grpo_advantages(accelerator.gather(rewards), G, cfg.scale_rewards)  # every process's
        adv = adv.chunk(accelerator.num_processes)[accelerator.process_index]  # this one's rows

        # ---- update: mu optimizer steps, each summing its micro-batches' gradients ----
        agg = common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)  # how the loss reduces its tokens, said once
        num_tokens = accelerator.reduce(mask.sum().float(), "mean")  # per process, as DDP averages
        size = cfg.micro_batch_size or B  # rows of a forward/backward pass (0: the whole batch)
        batches = [slice(i, i + size) for i in range(0, B, size)]
        for epoch in range(cfg.num_epochs):  # the stats are the last (most off-policy) update's
            update_loss, update_stats, kl_seq = 0.0, [], 0.0
            for rows in batches:
                logp, entropy = token_logprobs(  # (b, T), with gradient
                    policy, rollout.input_ids[rows], rollout.attention_mask[rows], T, cfg.temperature,
                    with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                old = logp.detach() if old_logp is None else old_logp[rows]  # mu = 1: pi_theta
                ref = None if ref_logp is None else ref_logp[rows]
                kl = torch.zeros_like(logp) if ref is None else common.kl_k1(logp.detach(), ref)
                # its part of the batch's loss: the weighted losses sum to the batch's
                weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, B)
                mb_agg = agg._replace(weight=weight)
                loss, stats = grpo_loss(logp, old, ref, adv[rows], mask[rows], cfg.clip, cfg.beta, mb_agg,
                                        cfg.kl_estimator)
                last = rows == batches[-1]  # DDP averages the gradients after the last one only
                accelerator.sync_gradients = last  # (and DeepSpeed steps there)
                with nullcontext() if last else accelerator.no_sync(policy):
                    accelerator.backward(loss)
                update_loss += loss.detach()
                entropy = common.masked_mean(entropy, mask[rows])
                share = mask[rows].sum() / mask.sum().clamp(min=1)  # its stats' weight
                update_stats.append((share, {**stats, "entropy": entropy}))
                kl_seq += common.masked_sum(kl, mask[rows]) / B
            max_norm = cfg.max_grad_norm or float("inf")
            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
            helpers.check_finite(accelerator, update_loss, grad_norm, step)
            optimizer.step()
            optimizer.zero_grad()

        # ---- log, evaluate, checkpoint (PLUMBING: docs/metrics.md says what each one means) ----
        grouped = rewards.view(-1, G)
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/adv_abs_max": adv.abs().max(),
            "train/kl_seq": kl_seq,
            "train/loss": update_loss,
            "train/grad_norm": grad_norm,
            **{f"train/{key}": value for key, value in helpers.combine(update_stats).items()},
            **reward_stats,
        }
        due = step % cfg.eval_every == 0 or step == cfg.num_steps
        evaluation = helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator) if due else {}
        helpers.log_step(logger, step, metrics, rollout, rewards, started, evaluation)
        helpers.save_checkpoint(cfg, accelerator, step, policy, tokenizer, prompts)

    helpers.finish(cfg, accelerator, logger, policy, tokenizer, prompts)


if __name__ == "__main__":
    helpers.launch(main)  # one thread per process, the process group closed at the end
