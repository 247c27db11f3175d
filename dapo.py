"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025,
https://arxiv.org/abs/2503.14476).

GRPO's group advantage A_i = (r_i - mean(r)) / (std(r) + eps) with four changes, each a flag or
a line below:
  1. Clip-higher: clip(rho, 1 - epsilon_low, 1 + epsilon_high) with epsilon_high > epsilon_low, so
     low-probability tokens with A > 0 can grow further before the clip stops them (entropy
     collapse is slower).
  2. Dynamic sampling: a group whose answers are all right or all wrong has A = 0 and teaches
     nothing. Drop it and sample new prompts until the batch holds batch_size / num_generations
     groups with mixed correctness (at most --max_sampling_rounds generation rounds).
  3. Token-mean: the loss is the mean over all tokens of the batch, so long responses weigh by
     their length (GRPO averages per sequence first).
  4. Overlong shaping: a length penalty, 0 up to max_len - cache_len tokens, falling linearly to
     -1 at max_len, is added to the reward.
No KL term and no reference model: the policy is meant to move far from its start.

    accelerate launch dapo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 dapo.py      # data-parallel on CPU
    python dapo.py --epsilon_high 0.2 --overlong_cache_len 0     # symmetric clip, no length shaping
"""
import sys
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import common
from grpo import grpo_advantages
from support import config, models, run, tasks
from support.config import arg


@dataclass
class Config(config.GroupConfig):
    epsilon_low: float = arg(0.2, "Clip the ratio below at 1 - epsilon_low (DAPO: 0.2).")
    epsilon_high: float = arg(0.28, "Clip the ratio above at 1 + epsilon_high (DAPO: 0.28), >= epsilon_low.")
    dual_clip_c: float = arg(0.0, "Dual clip: a token with A < 0 loses at most c |A|, whatever its ratio (0 = off).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy, the clip is inert).")
    max_sampling_rounds: int = arg(8, "Dynamic sampling: at most this many generation rounds per step.")
    dynamic_sampling_metric: str = arg("correct", "Drop groups whose 'correct' (DAPO) or 'reward' is all equal.")
    overlong_cache_len: int = arg(3, "Overlong shaping: penalty from max_new_tokens - cache_len tokens on (0 = off).")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.epsilon_low < 1:
            raise ValueError(f"--epsilon_low must be in (0, 1) (got {self.epsilon_low}).")
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(f"--epsilon_high ({self.epsilon_high}) must be >= --epsilon_low ({self.epsilon_low}): "
                             "that is clip-higher.")
        if self.dual_clip_c < 0 or 0 < self.dual_clip_c <= 1:
            raise ValueError(f"--dual_clip_c must be 0 (off) or > 1 (got {self.dual_clip_c}).")
        if self.num_epochs < 1:
            raise ValueError(f"--num_epochs must be >= 1 (got {self.num_epochs}).")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"--max_sampling_rounds must be >= 1 (got {self.max_sampling_rounds}).")
        if self.dynamic_sampling_metric not in ("correct", "reward"):
            raise ValueError("--dynamic_sampling_metric must be 'correct' or 'reward' "
                             f"(got {self.dynamic_sampling_metric!r}).")
        if self.dynamic_sampling_metric == "correct" and not self.answer_column and self.dataset != "arithmetic":
            raise ValueError("--answer_column '' gives no correctness to filter on: "
                             "use --dynamic_sampling_metric reward.")
        if not 0 <= self.overlong_cache_len <= self.max_new_tokens:
            raise ValueError(f"--overlong_cache_len must be in [0, --max_new_tokens = {self.max_new_tokens}] "
                             f"(got {self.overlong_cache_len}).")


def dynamic_sampling_filter(correct, group_size):
    """Keep mask (num_groups,) bool: True for a group whose 0/1 correctness is mixed (some right,
    some wrong), False when all are right or all are wrong. Filters on correctness, not on the
    shaped reward (an all-wrong group with different lengths is still dropped)."""
    # BEGIN SOLUTION
    # HINT: group correct as (B / G, G) rows of adjacent samples;
    # HINT: keep a row iff its values are not all equal; (B,) in, (B / G,) bool out
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
    # HINT: with L = lengths: 0 if L <= max_len - cache_len, -1 if L > max_len, else
    # HINT: ((max_len - cache_len) - L) / cache_len; cache_len == 0: only L > max_len gets -1; (B,) float out
    lengths = lengths.float()
    expected_max = max_len - cache_len
    if cache_len == 0:
        return torch.where(lengths > max_len, -1.0, 0.0)
    penalty = ((expected_max - lengths) / cache_len).clamp(min=-1.0, max=0.0)
    return penalty
    # END SOLUTION


def dapo_loss(logp, old_logp, adv, mask, epsilon_low, epsilon_high, dual_clip_c=0.0, pg_weight=None):
    """Clipped surrogate with decoupled clip range, token-mean over the whole batch (DAPO eq. 8).

    logp: (B, T) with grad; old_logp: (B, T) at sampling time (detached); adv: (B,).
    dual_clip_c > 1 bounds the loss of a token with A < 0 by c |A|; pg_weight (B, T), detached,
    multiplies the surrogate (TIS, masks).
    Returns (loss, stats): clip_frac_low / clip_frac_high, the fraction of tokens clipped below
    (rho < 1 - epsilon_low with A < 0) and above (rho > 1 + epsilon_high with A > 0); approx_kl,
    the k3 estimate of KL(pi_old || pi_theta) from the ratio.
    """
    # BEGIN SOLUTION
    # HINT: ratio = exp(logp - old_logp), A = adv[:, None];
    # HINT: surrogate = min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) (dual clip
    # HINT: and pg_weight as in grpo_loss); loss = token-mean of -surrogate over mask; stats: docstring
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)  # rho = pi_theta / pi_old
    adv = adv[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    if dual_clip_c > 0:  # dual clip (Ye et al., 2020): with A < 0 the min above is unbounded in rho
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip_c * adv), surrogate)
    if pg_weight is not None:
        surrogate = pg_weight * surrogate
    per_token_loss = -surrogate
    loss = common.aggregate_loss(per_token_loss, mask, "token-mean")
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean(((ratio < 1 - epsilon_low) & (adv < 0)).float(), mask),
            "clip_frac_high": common.masked_mean(((ratio > 1 + epsilon_high) & (adv > 0)).float(), mask),
            "approx_kl": common.masked_mean(ratio - 1 - log_ratio, mask),
        }
    return loss, stats
    # END SOLUTION


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, seed, policy, data (no reference model: no KL term) ----
    accelerator = config.make_accelerator(cfg)
    set_seed(cfg.seed)  # identical initial weights on every rank
    with accelerator.main_process_first():  # the main process downloads tokenizer and data, the others read its cache
        tokenizer = models.load_tokenizer(cfg)
        train_data, eval_data = tasks.load_task(cfg, tokenizer)  # data errors surface before models load
    reward_fn = tasks.make_reward_fn(cfg, accelerator)
    policy = models.load_model(cfg)
    rollout_model = models.load_rollout_model(cfg, policy)  # None unless --rollout_dtype differs
    optimizer, scheduler = models.make_optimizer(policy, cfg)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    if rollout_model is not None:
        rollout_model = rollout_model.to(accelerator.device)
    group_size = cfg.num_generations
    sampler = tasks.PromptSampler(train_data, cfg.batch_size // group_size, cfg.seed, accelerator.process_index,
                                  accelerator.num_processes)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    ckpt = run.Checkpointer(cfg, accelerator, sampler)
    start_step = ckpt.resume()
    logger = run.MetricLogger(cfg, accelerator, start_step)
    if start_step == 0:
        logger.log(0, tasks.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    timer = run.StepTimer()
    for step in tqdm(range(start_step + 1, cfg.num_steps + 1), disable=not accelerator.is_main_process, desc="dapo"):
        # ---- rollout: dynamic sampling, rounds of groups until batch_size completions in mixed groups ----
        kept_examples, kept_completion_ids, kept_rewards, kept_correct = [], [], [], []
        round_rewards, rounds, groups_dropped = [], 0, 0  # every round's rewards, kept or dropped (logged only)
        # every rank samples as many rounds (under ZeRO-3 each generate is a collective): until all are full
        while rounds < cfg.max_sampling_rounds and accelerator.reduce(
                torch.tensor(float(len(kept_examples) < cfg.batch_size), device=accelerator.device), "sum") > 0:
            rounds += 1
            batch = sampler.next()
            prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in batch],
                                                              accelerator.device)
            with timer("generation"):
                unwrapped = accelerator.unwrap_model(policy)
                if rollout_model is not None:  # the sampler gets this step's weights, in its own dtype
                    unwrapped = models.sync_rollout_model(rollout_model, unwrapped)
                completion_ids = common.generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg,
                                                 num_samples=group_size)
            with timer("scoring"):
                examples = [ex for ex in batch for _ in range(group_size)]  # each prompt's samples adjacent
                mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
                completions = tasks.decode_completions(tokenizer, completion_ids, mask)
                rewards, correct, reward_stats = reward_fn(examples, completions)
                round_rewards.append(rewards)
                keep = dynamic_sampling_filter(correct if cfg.dynamic_sampling_metric == "correct" else rewards,
                                               group_size)
                groups_dropped += int((~keep).sum())
                keep = keep.repeat_interleave(group_size)
                kept_examples += [ex for ex, k in zip(examples, keep.tolist()) if k]
                kept_completion_ids += list(completion_ids[keep])
                kept_rewards.append(rewards[keep])
                kept_correct.append(correct[keep])
        sampled_rewards = torch.cat(round_rewards)
        # every process trains on as many completions, the fewest kept (under ZeRO-3 each forward is a collective);
        # a process with no mixed group has nothing to learn from: then every process skips (DDP steps together)
        n = min(accelerator.gather(torch.tensor([min(len(kept_examples), cfg.batch_size)],
                                                device=accelerator.device)).tolist())
        nothing_kept = n == 0
        if len(kept_examples) < cfg.batch_size:
            print(f"warning: step {step} (rank {accelerator.process_index}): --max_sampling_rounds "
                  f"{cfg.max_sampling_rounds} reached with {len(kept_examples) // group_size} of "
                  f"{cfg.batch_size // group_size} groups with mixed {cfg.dynamic_sampling_metric}; "
                  + ("skipping the step (a process kept no group)" if nothing_kept else "training on those")
                  + ". Raise --max_sampling_rounds to fill the batch.", file=sys.stderr, flush=True)
        metrics, samples = {}, []
        if not nothing_kept:
            with timer("scoring"):
                examples, rewards, correct = kept_examples[:n], torch.cat(kept_rewards)[:n], torch.cat(kept_correct)[:n]
                completion_ids = torch.nn.utils.rnn.pad_sequence(kept_completion_ids[:n], batch_first=True,
                                                                 padding_value=tokenizer.pad_token_id)
                prompts = [ex["prompt"] for ex in examples]
                prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, prompts, accelerator.device)
                mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
                penalty = overlong_penalty(mask.sum(1), cfg.max_new_tokens, cfg.overlong_cache_len)
                rewards = rewards + penalty  # overlong shaping, after the filter
                input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
                attention_mask = torch.cat([prompt_mask, mask], dim=1)
                T = completion_ids.shape[1]
                sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p}  # score on the distribution that was sampled
                micro_batches = common.micro_batches(len(input_ids), cfg.micro_batch_size)
                old_logp, rollout_logp = None, None
                with torch.no_grad():
                    if cfg.num_epochs > 1:  # log-probs at sampling time; with mu = 1 they are logp.detach()
                        old_logp = torch.cat([common.token_logprobs(policy, input_ids[mb], attention_mask[mb], T,
                                                                    cfg.temperature, **sampling)
                                              for mb in micro_batches])
                    if rollout_model is not None:  # what an inference engine returns with its samples
                        rollout_logp = torch.cat([common.token_logprobs(rollout_model, input_ids[mb],
                                                                        attention_mask[mb], T, cfg.temperature,
                                                                        **sampling) for mb in micro_batches])
                adv = grpo_advantages(rewards, group_size)

            num_tokens = accelerator.reduce(mask.sum().float(), reduction="mean")  # token-mean over every process
            for _ in range(cfg.num_epochs):  # stats below are those of the last (most off-policy) update
                with timer("forward_backward"):
                    # ---- log-probs, ratio, clip-higher surrogate, token-mean, rollout correction, in
                    # micro-batches whose gradients add up to the batch's ----
                    logp, entropy = [], []
                    for mb in micro_batches:
                        mb_logp, mb_entropy = common.token_logprobs(policy, input_ids[mb], attention_mask[mb], T,
                                                                    cfg.temperature, with_entropy=True, **sampling)
                        mb_old_logp = old_logp[mb] if cfg.num_epochs > 1 else mb_logp.detach()
                        mb_rollout_logp = rollout_logp[mb] if rollout_model is not None else None
                        pg_weight, _ = common.rollout_correction(mb_logp, mb_old_logp, mb_rollout_logp, adv[mb],
                                                                 mask[mb], cfg.tis_cap, cfg.geo_mask_delta)
                        mb_loss, _ = dapo_loss(mb_logp, mb_old_logp, adv[mb], mask[mb], cfg.epsilon_low,
                                               cfg.epsilon_high, cfg.dual_clip_c, pg_weight)
                        weight = common.micro_batch_weight(mask[mb], "token-mean", num_tokens, len(input_ids))
                        run.backward(accelerator, policy, weight * mb_loss, sync=mb.stop == len(input_ids))
                        logp.append(mb_logp.detach())
                        entropy.append(mb_entropy)
                    # the whole batch's loss and stats, for the log
                    logp, entropy = torch.cat(logp), torch.cat(entropy)
                    if cfg.num_epochs == 1:
                        old_logp = logp
                    pg_weight, correction = common.rollout_correction(logp, old_logp, rollout_logp, adv, mask,
                                                                      cfg.tis_cap, cfg.geo_mask_delta)
                    loss, stats = dapo_loss(logp, old_logp, adv, mask, cfg.epsilon_low, cfg.epsilon_high,
                                            cfg.dual_clip_c, pg_weight)

                with timer("optimizer"):
                    # ---- mu steps on the same batch ----
                    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                    grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
                    ckpt.check_finite(step, loss, grad_norm, policy, tokenizer)
                    optimizer.step()
                    optimizer.zero_grad()
            scheduler.step()  # once per rollout batch, so --warmup_steps counts steps as in every script

            lengths = mask.sum(1).float()
            grouped = rewards.view(-1, group_size)
            metrics = {
                "train/reward": rewards.mean(),
                "train/reward_std": rewards.std(),
                "train/correct": correct.mean(),
                "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
                "train/groups_kept": len(examples) // group_size,
                "train/overlong_penalty": penalty.mean(),
                "train/adv_mean": adv.mean(),
                "train/adv_std": adv.std(),
                "train/adv_abs_max": adv.abs().max(),
                "train/clip_frac_low": stats["clip_frac_low"],
                "train/clip_frac_high": stats["clip_frac_high"],
                "train/approx_kl": stats["approx_kl"],
                "train/entropy": common.masked_mean(entropy, mask),
                "train/loss": loss.detach(),
                "train/grad_norm": grad_norm,
                "train/completion_len": lengths.mean(),
                **{f"train/{key}": value for key, value in correction.items()},
                **timer.metrics(),
            }
            metrics["time/tokens_per_s"] = lengths.sum() / metrics["time/step_s"]
            samples = zip(prompts, tasks.decode_completions(tokenizer, completion_ids, mask), rewards.tolist())

        # ---- log (a skipped step logs only what dynamic sampling did) ----
        metrics.update({
            "train/skipped_step": float(nothing_kept),
            "train/sampling_rounds": rounds,
            "train/groups_dropped": groups_dropped,
            "train/generated": len(sampled_rewards),
            "train/reward_sampled": sampled_rewards.mean(),
        })
        metrics = run.reduce_metrics(accelerator, metrics)
        if step % cfg.eval_every == 0 or step == cfg.num_steps:
            metrics.update(tasks.evaluate(policy, tokenizer, eval_data, cfg, accelerator))
        logger.log(step, metrics, samples=samples)
        if ckpt.step_end(step, policy, tokenizer):
            break

    # ---- end: save, plot ----
    logger.finish(policy)
    if cfg.save_model:
        models.save_model(accelerator, policy, tokenizer, f"{cfg.output_dir}/final", cfg.merge_lora)

    accelerator.wait_for_everyone()
    accelerator.end_training()  # close the process group on every rank before the interpreter exits


if __name__ == "__main__":
    main()
