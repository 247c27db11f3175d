"""REINFORCE++ (Hu et al., 2025, https://arxiv.org/abs/2501.03262): REINFORCE with PPO's
tricks and no critic, no per-group standardisation.

For each prompt x, sample G responses y_1..y_G ~ pi(.|x) (as GRPO, so the two compare at equal
samples). The k1 penalty to the frozen reference is folded into the reward of every token, the
task reward R_i added at the last one; the return is the sum of the rewards from t on (gamma = 1),
and the advantage is that return normalised over every token of the whole batch, on every process:

    r_t = -beta k1_t (+ R_i at the last token),   G_t = sum_{s >= t} r_s
    A_t = (G_t - mean(G)) / std(G),   mean and std over all the batch's tokens
    loss_t = -min(rho_t A_t, clip(rho_t, 1 - epsilon, 1 + epsilon) A_t)

The batch, not the group, sets the scale: a prompt every sample solves keeps a positive advantage.
REINFORCE++-baseline (--baseline group) first subtracts each group's mean of G_0 = R_i - beta sum_t
k1_t, then normalises over the batch, one advantage per sequence.

    accelerate launch reinforce_pp.py                            # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 reinforce_pp.py   # data-parallel on CPU
    python reinforce_pp.py --baseline group                      # REINFORCE++-baseline

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
    beta: float = arg(0.01, "Coefficient of the per-token k1 penalty in the reward (0 = none).")
    epsilon: float = arg(0.2, "Clip the ratio to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float = arg(None, "The upper clip (default: epsilon).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy).")
    baseline: str = arg("none", "Subtract first: none (REINFORCE++) | group (its mean; -baseline).")
    loss_agg: str = arg("token-mean", "Loss aggregation: token-mean (REINFORCE++) | "
                        "seq-mean-token-mean | seq-mean-token-sum-norm.")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_groups(self)  # G >= 2, dividing --batch_size
        helpers.check_rules(self, beta=helpers.NON_NEGATIVE, num_epochs=helpers.AT_LEAST_ONE,
                            epsilon=helpers.FRACTION, epsilon_high=helpers.POSITIVE,
                            loss_agg=helpers.one_of(*common.LOSS_AGG_MODES),
                            baseline=helpers.one_of("none", "group"))
        self.clip = common.Clip(self.epsilon, self.epsilon_high or self.epsilon)


def reinforce_pp_advantages(rewards, kl, mask, beta, group_size=None):
    """REINFORCE++'s (B, T) advantages from (B,) task rewards and the (B, T) k1 of each token.

    r_t = -beta k1_t, plus R_i at the last token; G_t = sum_{s >= t} r_s (gamma = 1). group_size
    (REINFORCE++-baseline): G_0 - mean(G_0 of the group) on every token instead, each group's G
    samples adjacent. Then whitened over every masked token of the batch (common.masked_whiten: the
    mean, the std with Bessel's correction), as verl's compute_reinforce_plus_plus[_baseline]_outcome_
    advantage.
    """
    # BEGIN SOLUTION
    kl = torch.where(mask.bool(), kl, 0.0)  # the padding may hold anything
    returns = rewards[:, None] - beta * kl.flip(1).cumsum(1).flip(1)  # (B, T): G_t
    if group_size:  # the sequence's return less its group's mean, broadcast to its tokens
        grouped = (rewards - beta * kl.sum(1)).view(-1, group_size)  # (B / G, G): G_0
        returns = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1, 1).expand_as(kl)
    return common.masked_whiten(returns, mask)
    # END SOLUTION


def reinforce_pp_loss(logp, old_logp, adv, mask, clip, loss_agg="token-mean"):
    """PPO's clipped surrogate on per-token advantages; the KL is in the reward, not here.

    logp: (B, T) under the policy trained (with grad); old_logp, adv: (B, T) detached, at sampling
    time. clip: a common.Clip (its range). loss_agg: common.aggregate_loss's mode or a micro-batch's
    Aggregation. Returns (loss, stats): common.clip_stats (clip_frac_low, clip_frac_high, approx_kl).
    """
    clip = common.Clip(*clip)  # a Clip, or its fields as a plain tuple
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take
    # logp's value, so the gradient at a padded position is 0, not 0 * inf = NaN from exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    adv = torch.where(mask.bool(), adv, 0.0)  # and the advantage 0: 0 * NaN would be NaN
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # rho_t = pi_theta / pi_old
    surrogate = common.clipped_surrogate(ratio, adv, clip)  # min(rho A, clip(rho) A)
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    return loss, common.clip_stats(ratio, log_ratio, adv, mask, clip)


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
        scored = cfg.num_epochs > 1 or cfg.beta > 0  # pi_old: for the ratio, and for k1 in the reward
        old_logp = helpers.score(policy, rollout, cfg) if scored else None

        # ---- advantages: k1 in each token's reward, the return normalised over the whole batch ----
        kl = common.kl_k1(old_logp, ref_logp) if cfg.beta > 0 else torch.zeros_like(mask.float())
        group_size = G if cfg.baseline == "group" else None  # REINFORCE++-baseline
        # every process's tokens (completions padded to one length), then this one's rows
        padded = [accelerator.gather(accelerator.pad_across_processes(x, dim=1)) for x in (kl, mask)]
        adv = reinforce_pp_advantages(accelerator.gather(rewards), *padded, cfg.beta, group_size)
        adv = adv.chunk(accelerator.num_processes)[accelerator.process_index][:, :T]  # (B, T)

        # ---- update: mu optimizer steps, each summing its micro-batches' gradients ----
        agg = common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)  # how the loss reduces its tokens, said once
        num_tokens = accelerator.reduce(mask.sum().float(), "mean")  # per process, as DDP averages
        size = cfg.micro_batch_size or B  # rows of a forward/backward pass (0: the whole batch)
        batches = [slice(i, i + size) for i in range(0, B, size)]
        for epoch in range(cfg.num_epochs):  # the stats are the last (most off-policy) update's
            update_loss, update_stats = 0.0, []
            for rows in batches:
                logp, entropy = token_logprobs(  # (b, T), with gradient
                    policy, rollout.input_ids[rows], rollout.attention_mask[rows], T, cfg.temperature,
                    with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                old = logp.detach() if old_logp is None else old_logp[rows]  # mu = 1: pi_theta
                # its part of the batch's loss: the weighted losses sum to the batch's
                weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, B)
                mb_agg = agg._replace(weight=weight)
                loss, stats = reinforce_pp_loss(logp, old, adv[rows], mask[rows], cfg.clip, mb_agg)
                last = rows == batches[-1]  # DDP averages the gradients after the last one only
                accelerator.sync_gradients = last  # (and DeepSpeed steps there)
                with nullcontext() if last else accelerator.no_sync(policy):
                    accelerator.backward(loss)
                update_loss += loss.detach()
                entropy = common.masked_mean(entropy, mask[rows])
                share = mask[rows].sum() / mask.sum().clamp(min=1)  # its stats' weight
                update_stats.append((share, {**stats, "entropy": entropy}))
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
            "train/adv_mean": common.masked_mean(adv, mask),
            "train/adv_abs_max": adv.abs().max(),
            "train/kl_seq": common.masked_sum(kl, mask) / B,
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
