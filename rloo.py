"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., 2024, "Back to Basics",
https://arxiv.org/abs/2402.14740; the estimator is Kool et al., 2019).

For each prompt x, sample a group of G responses y_1..y_G ~ pi(.|x): the group is the baseline, so
no value model and no greedy decode. The price is G generations per prompt. The baseline of response
i is the mean reward of the OTHER G - 1, so it does not depend on y_i: no bias. The whole completion
is one action, with a k1 penalty to the frozen reference (detached) in the reward:

    A_i = r~_i - mean_{j != i} r~_j = G / (G - 1) * (r~_i - mean(r~))
    r~_i = r_i - beta * sum_t k1_t

Loss: -A_i * log pi(y_i | x) (a sum of token log-probs), averaged, one on-policy update per batch:
no ratio, no clip.

    accelerate launch rloo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 rloo.py      # data-parallel on CPU
    python rloo.py --reward_scales hetero                        # the baseline adapts per prompt

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
    beta: float = arg(0.05, "Coefficient of the sequence k1 penalty in the reward (0 = none).")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_groups(self)  # G >= 2, dividing --batch_size
        helpers.check_rules(self, beta=helpers.NON_NEGATIVE)
        helpers.check(self.micro_batch_size % self.num_generations == 0, "--micro_batch_size must be a "
                      "multiple of --num_generations: a micro-batch holds whole groups.")


def rloo_advantages(rewards, group_size):
    """A_i = r_i - mean_{j != i} r_j within each group, for (B,) rewards with each group's G samples
    adjacent. Returns (B,)."""
    # BEGIN SOLUTION
    grouped = rewards.view(-1, group_size)  # (B / G, G)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    adv = grouped - baseline
    return adv.view(-1)
    # END SOLUTION


def rloo_loss(logp, adv, mask, loss_agg="seq-mean-token-sum"):
    """REINFORCE with the whole completion as one action: mean_i of -A_i * sum_t logp_{i,t}.

    logp: (B, T) per-token log-probs (with grad); adv: (B,) detached; mask: (B, T). loss_agg:
    seq-mean-token-sum, the mean over sequences of their sums, or the micro-batch's
    common.Aggregation of it. Returns (loss, stats) with stats: seq_logp_mean, the mean sequence
    log-prob log pi(y_i|x)."""
    # BEGIN SOLUTION
    seq_logp = common.masked_sum(logp, mask, dim=1)  # log pi(y_i | x)
    loss = common.aggregate_loss(-adv.detach()[:, None] * logp, mask, loss_agg)
    return loss, {"seq_logp_mean": seq_logp.detach().mean()}
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

        # ---- update: one on-policy optimizer step, summing its micro-batches' gradients ----
        agg = common.Aggregation("seq-mean-token-sum")  # how the loss reduces its tokens, said once
        num_tokens = accelerator.reduce(mask.sum().float(), "mean")  # per process, as DDP averages
        size = cfg.micro_batch_size or B  # rows of a forward/backward pass (0: the whole batch)
        batches = [slice(i, i + size) for i in range(0, B, size)]
        for epoch in range(1):  # on-policy: one update per batch (GRPO: mu)
            update_loss, update_stats, kl_seq = 0.0, [], 0.0
            adv, rewards_kl = [], []
            for rows in batches:
                logp, entropy = token_logprobs(  # (b, T), with gradient
                    policy, rollout.input_ids[rows], rollout.attention_mask[rows], T, cfg.temperature,
                    with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                ref = None if ref_logp is None else ref_logp[rows]
                kl = torch.zeros_like(logp) if ref is None else common.kl_k1(logp.detach(), ref)
                # ---- advantages: the other G - 1 rewards, with their KL penalty, are the baseline ----
                rewards_kl.append(rewards[rows] - cfg.beta * common.masked_sum(kl, mask[rows], dim=1))
                adv.append(rloo_advantages(rewards_kl[-1], G))
                # its part of the batch's loss: the weighted losses sum to the batch's
                weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, B)
                mb_agg = agg._replace(weight=weight)
                loss, stats = rloo_loss(logp, adv[-1], mask[rows], mb_agg)
                last = rows == batches[-1]  # DDP averages the gradients after the last one only
                accelerator.sync_gradients = last  # (and DeepSpeed steps there)
                with nullcontext() if last else accelerator.no_sync(policy):
                    accelerator.backward(loss)
                update_loss += loss.detach()
                entropy = common.masked_mean(entropy, mask[rows])
                share = mask[rows].sum() / mask.sum().clamp(min=1)  # its stats' weight
                seq_logp = common.Sums((stats["seq_logp_mean"] * len(logp), len(logp)))  # a mean over rows
                update_stats.append((share, {**stats, "entropy": entropy, "seq_logp_mean": seq_logp}))
                kl_seq += common.masked_sum(kl, mask[rows]) / B
            max_norm = cfg.max_grad_norm or float("inf")
            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
            helpers.check_finite(accelerator, update_loss, grad_norm, step)
            optimizer.step()
            optimizer.zero_grad()
        adv, rewards_kl = torch.cat(adv), torch.cat(rewards_kl)

        # ---- log, evaluate, checkpoint (PLUMBING: docs/metrics.md says what each one means) ----
        grouped = rewards.view(-1, G)
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
            "train/reward_with_kl": rewards_kl.mean(),
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
