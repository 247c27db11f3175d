"""ReMax: REINFORCE with the greedy response's reward as baseline (Li et al., 2023, ICML 2024,
https://arxiv.org/abs/2310.10505).

For each prompt x, sample one response y ~ pi(.|x) and decode one greedy response y_greedy. The
advantage is A = r(x, y) - r(x, y_greedy): the greedy reward is a baseline that does not depend on
the sampled y, so the gradient stays unbiased, and it tracks how hard each prompt is, which is what
plain REINFORCE lacks when prompts differ (--baseline none shows the failure). A per-token k1
penalty -beta * (logp - ref_logp) is folded into the return (reward-to-go). Loss: -A_t * log pi(y_t
| x, y_<t), one on-policy update per batch: no ratio, no clipping, no value model. The price is one
extra greedy generation per prompt.

    accelerate launch remax.py                                   # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 remax.py     # data-parallel on CPU
    python remax.py --reward_scales hetero --baseline none       # watch REINFORCE fail

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
    baseline: str = arg("greedy", "'greedy' (ReMax) or 'none' (plain REINFORCE).")
    beta: float = arg(0.05, "Coefficient of the per-token k1 penalty in the return (0 = none).")
    adv_clip: float = arg(5.0, "Clip the advantage r - r_greedy to +- adv_clip (0 = off).")
    loss_agg: str = arg("token-mean", "Loss aggregation: token-mean | seq-mean-token-mean | "
                        "seq-mean-token-sum-norm.")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_rules(self, beta=helpers.NON_NEGATIVE, adv_clip=helpers.NON_NEGATIVE,
                            baseline=helpers.one_of("greedy", "none"),
                            loss_agg=helpers.one_of(*common.LOSS_AGG_MODES))


def remax_advantages(rewards, greedy_rewards):
    """A_i = r(x_i, y_i) - r(x_i, y_greedy_i): the greedy response's reward as baseline. (B,)"""
    # BEGIN SOLUTION
    return rewards - greedy_rewards
    # END SOLUTION


def remax_loss(logp, adv, kl, mask, beta, loss_agg="token-mean"):
    """REINFORCE loss with the k1 penalty folded into the return.

    logp, kl: (B, T) per-token log-probs (with grad) and k1 = logp - ref_logp (detached); adv: (B,)
    sequence advantage. Per-token return G_t = A - beta * sum_{t'>=t} k1_t' (reward-to-go: the
    penalty on earlier tokens does not depend on later actions). Loss = aggregate(-G_t * logp_t);
    loss_agg: a mode of common.aggregate_loss, or the micro-batch's common.Aggregation (with
    seq-mean-token-sum-norm's constant, --max_new_tokens). Only with that constant normaliser is the
    expected gradient of the KL part that of beta * KL_seq(pi || ref) (divided by max_len);
    token-mean (the default, as the official code) divides by the batch's token count, a ratio
    estimator biased at small batches, and seq-mean-token-mean weighs each sequence by 1/|y|
    (docs/algorithms.md). Returns (loss, stats) with stats: return_mean (mean G_t over tokens).
    """
    # BEGIN SOLUTION
    returns = (adv[:, None] - beta * common.reward_to_go(kl, mask)).detach()
    loss = common.aggregate_loss(-returns * logp, mask, loss_agg)
    return loss, {"return_mean": common.masked_mean(returns, mask)}
    # END SOLUTION


def main():
    cfg = helpers.parse_config(Config)
    # ---- setup: accelerator, data, policy and optimizer, reference (PLUMBING: skip at first) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = helpers.load_data(cfg, accelerator)
    reward_fn = helpers.make_reward_fn(cfg, accelerator)
    set_seed(cfg.seed)  # the same initial weights on every rank (a LoRA adapter is drawn)
    policy, ref_model, optimizer = helpers.load_models(cfg, accelerator, reference=cfg.beta > 0)
    prompts = helpers.prompt_sampler(train_data, cfg.batch_size, cfg, accelerator)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    start = helpers.resume(cfg, accelerator, prompts)  # --resume_from: its step, else 0
    logger = helpers.open_log(cfg, accelerator, start)
    if start == 0:  # held-out accuracy before training
        logger.log(0, helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    for step in helpers.steps(cfg, start, accelerator):
        started = time.time()
        # ---- rollout: one sampled response per prompt, and (ReMax) its greedy one ----
        examples = prompts.next()
        rollout = helpers.sample(policy, tokenizer, examples, cfg, accelerator)
        if cfg.baseline == "greedy":
            greedy = helpers.sample(policy, tokenizer, examples, cfg, accelerator, greedy=True)
        mask, B, T = rollout.mask, *rollout.mask.shape  # (B, T): 1 on each completion's tokens

        # ---- reward, and the log-probs the loss compares with ----
        rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions)  # (B,)
        ref_logp = helpers.score(ref_model, rollout, cfg, truncated=False) if cfg.beta > 0 else None

        # ---- advantages: the reward of the greedy response is the baseline (ReMax), or none ----
        if cfg.baseline == "greedy":
            greedy_rewards, _, _ = reward_fn(greedy.examples, greedy.completions)
        else:
            greedy_rewards = torch.zeros_like(rewards)
        adv = remax_advantages(rewards, greedy_rewards)
        if cfg.adv_clip > 0:
            adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)

        # ---- update: one on-policy optimizer step, summing its micro-batches' gradients ----
        agg = common.Aggregation(cfg.loss_agg, cfg.max_new_tokens)  # how the loss reduces its tokens, said once
        num_tokens = accelerator.reduce(mask.sum().float(), "mean")  # per process, as DDP averages
        size = cfg.micro_batch_size or B  # rows of a forward/backward pass (0: the whole batch)
        batches = [slice(i, i + size) for i in range(0, B, size)]
        for epoch in range(1):  # on-policy: one update per batch (GRPO: mu)
            update_loss, update_stats, kl_seq = 0.0, [], 0.0
            for rows in batches:
                logp, entropy = token_logprobs(  # (b, T), with gradient
                    policy, rollout.input_ids[rows], rollout.attention_mask[rows], T, cfg.temperature,
                    with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                ref = None if ref_logp is None else ref_logp[rows]
                kl = torch.zeros_like(logp) if ref is None else common.kl_k1(logp.detach(), ref)
                # its part of the batch's loss: the weighted losses sum to the batch's
                weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, B)
                mb_agg = agg._replace(weight=weight)
                loss, stats = remax_loss(logp, adv[rows], kl, mask[rows], cfg.beta, mb_agg)
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
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/greedy_reward": greedy_rewards.mean(),
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
