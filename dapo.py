"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025,
https://arxiv.org/abs/2503.14476).

For each prompt x, sample a group of G responses y_1..y_G ~ pi(.|x): the group is the baseline, so
no value model and no greedy decode. The price is G generations per prompt. GRPO's advantage and
clipped surrogate, with four changes and no KL term (the policy is meant to move far):
  1. Clip-higher: clip(rho_t, 1 - epsilon_low, 1 + epsilon_high), epsilon_high > epsilon_low.
  2. Dynamic sampling: drop each group whose answers are all right or all wrong (A = 0) and sample
     more until the batch holds batch_size / G groups of mixed answers.
  3. Token-mean: the loss is the mean over all the batch's tokens (GRPO: per sequence first).
  4. Overlong shaping: a length penalty, 0 up to max_len - cache_len tokens, -1 at max_len.

    accelerate launch dapo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 dapo.py      # data-parallel on CPU

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
    epsilon_low: float = arg(0.2, "Clip the ratio below at 1 - epsilon_low (DAPO: 0.2).")
    epsilon_high: float = arg(0.28, "Clip the ratio above at 1 + epsilon_high (DAPO: 0.28).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy).")
    max_sampling_rounds: int = arg(8, "Dynamic sampling: at most this many rounds per step.")
    overlong_cache_len: int = arg(3, "Overlong shaping over the last cache_len tokens (0 = off).")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_groups(self)  # G >= 2, dividing --batch_size
        helpers.check_rules(self, epsilon_low=helpers.FRACTION, epsilon_high=helpers.POSITIVE,
                            num_epochs=helpers.AT_LEAST_ONE, max_sampling_rounds=helpers.AT_LEAST_ONE)
        helpers.check(self.epsilon_high >= self.epsilon_low, "--epsilon_high must be >= --epsilon_low")
        helpers.check(0 <= self.overlong_cache_len <= self.max_new_tokens, "--overlong_cache_len "
                      "must be in [0, --max_new_tokens].")
        self.clip = common.Clip(self.epsilon_low, self.epsilon_high)


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


def dynamic_sampling_filter(correct, group_size):
    """Keep mask (num_groups,) bool: True for a group whose 0/1 correctness is mixed (some right,
    some wrong), False when all are right or all are wrong. Filters on correctness, not on the
    shaped reward (an all-wrong group with different lengths is still dropped)."""
    # BEGIN SOLUTION
    grouped = correct.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
    # END SOLUTION


def overlong_penalty(lengths, max_len, cache_len):
    """DAPO's soft overlong punishment (eq. 13), added to the reward, for (B,) lengths:

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


def dapo_loss(logp, old_logp, adv, mask, clip, loss_agg="token-mean"):
    """Clipped surrogate with the decoupled clip range, token-mean over the batch (DAPO eq. 8).

    logp: (B, T) under the policy trained (with grad); old_logp: (B, T) detached, at sampling time;
    adv: (B,). clip: a common.Clip, [1 - epsilon_low, 1 + epsilon_high]. loss_agg: token-mean or a
    micro-batch's Aggregation of it. Returns (loss, stats): common.clip_stats (clip_frac_low,
    clip_frac_high, approx_kl).
    """
    clip = common.Clip(*clip)  # a Clip, or its fields as a plain tuple
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take
    # logp's value, so the gradient at a padded position is 0, not 0 * inf = NaN from exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp  # (B, T)
    ratio = torch.exp(log_ratio)  # rho_t = pi_theta / pi_old
    adv = adv[:, None]
    surrogate = common.clipped_surrogate(ratio, adv, clip)  # min(rho A, clip(rho) A)
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    return loss, common.clip_stats(ratio, log_ratio, adv, mask, clip)
    # END SOLUTION


def main():
    cfg = helpers.parse_config(Config)
    # ---- setup: accelerator, data, policy and optimizer, reference (PLUMBING: skip at first) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = helpers.load_data(cfg, accelerator)
    reward_fn = helpers.make_reward_fn(cfg, accelerator)
    set_seed(cfg.seed)  # the same initial weights on every rank (a LoRA adapter is drawn)
    policy, _, optimizer = helpers.load_models(cfg, accelerator, reference=False)  # no KL term
    G = cfg.num_generations
    prompts = helpers.prompt_sampler(train_data, cfg.batch_size // G, cfg, accelerator)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    start = helpers.resume(cfg, accelerator, prompts)  # --resume_from: its step, else 0
    logger = helpers.open_log(cfg, accelerator, start)
    if start == 0:  # held-out accuracy before training
        logger.log(0, helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    for step in helpers.steps(cfg, start, accelerator):
        started = time.time()
        # ---- rollout: groups of G, in rounds until batch_size / G groups have mixed answers ----
        rounds = []  # each round's (rollout, rewards, correct, keep, reward_stats)
        while len(rounds) < cfg.max_sampling_rounds and helpers.any_process(  # as many everywhere
                accelerator, sum(int(keep.sum()) for _, _, _, keep, _ in rounds) < cfg.batch_size):
            rollout = helpers.sample(policy, tokenizer, prompts.next(), cfg, accelerator, num_samples=G)
            rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions)
            keep = dynamic_sampling_filter(correct, G).repeat_interleave(G)  # (B,) whole groups
            rounds.append((rollout, rewards, correct, keep, reward_stats))
        n = helpers.fewest(accelerator, min(cfg.batch_size, sum(int(keep.sum()) for *_, keep, _ in rounds)))
        rollout, rewards, correct, reward_stats, metrics = helpers.fill_batch(rounds, n, cfg, tokenizer, step)
        if rollout is None:  # no process kept a group: log what dynamic sampling did, and go on
            helpers.log_step(logger, step, metrics, None, None, started)
            continue
        mask, B, T = rollout.mask, *rollout.mask.shape  # (B, T): 1 on each completion's tokens

        # ---- reward: overlong shaping, after the filter; the log-probs the loss compares with ----
        penalty = overlong_penalty(mask.sum(1), cfg.max_new_tokens, cfg.overlong_cache_len)
        rewards = rewards + penalty
        old_logp = helpers.score(policy, rollout, cfg) if cfg.num_epochs > 1 else None  # pi_old

        # ---- advantages: each reward standardised within its group ----
        adv = grpo_advantages(rewards, G)

        # ---- update: mu optimizer steps, each summing its micro-batches' gradients ----
        agg = common.Aggregation("token-mean")  # how the loss reduces its tokens, said once
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
                loss, stats = dapo_loss(logp, old, adv[rows], mask[rows], cfg.clip, mb_agg)
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
            **metrics,
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
            "train/overlong_penalty": penalty.mean(),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/adv_abs_max": adv.abs().max(),
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
