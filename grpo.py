"""GRPO: Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024,
https://arxiv.org/abs/2402.03300).

For each prompt x, sample a group of G responses y_1..y_G ~ pi_old(.|x). The advantage of
response i is its reward standardised within the group, A_i = (r_i - mean(r)) / (std(r) + eps),
broadcast to every token: the group is the baseline, so no value model and no greedy decode.
Per-token loss, the PPO clipped surrogate plus a k3 KL term to the frozen reference:

    -min(rho_t A_i, clip(rho_t, 1 - epsilon, 1 + epsilon) A_i) + beta * k3_t,   rho_t = pi_theta / pi_old

With one update per batch (--num_epochs 1) rho == 1 in value and the clip is inert: the
gradient is REINFORCE with the group baseline. With mu > 1 updates the batch is reused and the
ratio is taken against the log-probs at sampling time. Dividing by the group std rescales each
prompt's gradient by its difficulty (a bias, see --scale_rewards none for Dr. GRPO). The price is
G generations per prompt.

    accelerate launch grpo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 grpo.py      # data-parallel on CPU
    python grpo.py --scale_rewards none --loss_agg seq-mean-token-sum-norm   # Dr. GRPO
    python grpo.py --rollout_dtype bfloat16 --tis_cap 2         # a bf16 sampler, corrected (docs/stability.md)
"""
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import common
from support import config, models, run, tasks
from support.config import arg


@dataclass
class Config(config.GroupConfig):
    beta: float = arg(0.04, "Coefficient of the KL-to-reference term in the per-token loss (0 = no reference).")
    kl_estimator: str = arg("k3", "Estimator of that KL term: k3 (GRPO) | k2 | k1 (docs/algorithms.md).")
    kl_is_weight: bool = arg(False, "Multiply the KL term by the ratio pi_theta / pi_old (DeepSeek-V3.2).")
    epsilon: float = arg(0.2, "Clip the ratio pi_theta / pi_old to [1 - epsilon, 1 + epsilon].")
    dual_clip_c: float = arg(0.0, "Dual clip: a token with A < 0 loses at most c |A|, whatever its ratio (0 = off).")
    num_epochs: int = arg(1, "mu: optimizer updates per rollout batch (1 = on-policy, the clip is inert).")
    scale_rewards: str = arg("group", "Divide the centred reward by the std of: group | batch | none (Dr. GRPO).")
    loss_agg: str = arg("seq-mean-token-mean", "Loss aggregation: seq-mean-token-mean (GRPO paper) | token-mean | "
                        "seq-mean-token-sum-norm (Dr. GRPO).")

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0 (got {self.beta}).")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"--kl_estimator must be k1, k2 or k3 (got {self.kl_estimator!r}).")
        if self.dual_clip_c < 0 or 0 < self.dual_clip_c <= 1:
            raise ValueError(f"--dual_clip_c must be 0 (off) or > 1 (got {self.dual_clip_c}).")
        if not 0 < self.epsilon < 1:
            raise ValueError(f"--epsilon must be in (0, 1) (got {self.epsilon}).")
        if self.num_epochs < 1:
            raise ValueError(f"--num_epochs must be >= 1 (got {self.num_epochs}).")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"--scale_rewards must be 'group', 'batch' or 'none' (got {self.scale_rewards!r}).")
        if self.loss_agg not in config.LOSS_AGG_MODES:
            raise ValueError(f"--loss_agg must be one of {config.LOSS_AGG_MODES} (got {self.loss_agg!r}).")


def grpo_advantages(rewards, group_size, scale_rewards="group", eps=1e-6):
    """A_i = (r_i - mean(r_group)) / (std + eps) for (B,) rewards, each group's G samples adjacent.

    std is torch.std (Bessel's correction, ddof=1, as TRL and verl); eps = 1e-6 as verl (TRL
    uses 1e-4). scale_rewards: 'group' divides by the group's std (GRPO), 'batch' by the std of
    all B rewards, 'none' only centres (Dr. GRPO). A group whose rewards are all equal gets
    exactly 0 for every member. Returns (B,).
    """
    # BEGIN SOLUTION
    # HINT: group rewards as (B / G, G) rows of adjacent samples; adv = r - row mean;
    # HINT: 'group': / (row std + eps), 'batch': / (std of all B + eps), std with ddof 1;
    # HINT: a row whose rewards are all equal gets exactly 0; back to (B,)
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


def grpo_loss(logp, old_logp, ref_logp, adv, mask, epsilon, beta, loss_agg="seq-mean-token-mean", max_len=None,
              kl_estimator="k3", kl_is_weight=False, dual_clip_c=0.0, pg_weight=None):
    """Clipped surrogate plus beta * KL to the reference, per token (DeepSeekMath eq. 3).

    logp: (B, T) log-probs under the policy being trained (with grad); old_logp: (B, T) at
    sampling time (detached); ref_logp: (B, T) under the reference, or None when beta == 0;
    adv: (B,) sequence advantage, the same for every token. The KL term keeps its gradient
    through logp (common.kl_penalty): k3's is, per state with the states held fixed, that of the
    forward KL(pi_ref || pi_theta); k2's, or k3's with kl_is_weight, that of the reverse KL; none
    is the sequence KL's (docs/algorithms.md). dual_clip_c > 1 bounds the loss of a token with
    A < 0 by c |A|; pg_weight (B, T), detached, multiplies the surrogate (TIS, masks).
    Returns (loss, stats): clip_frac_low / clip_frac_high, the fraction of tokens clipped below
    (rho < 1 - eps with A < 0) and above (rho > 1 + eps with A > 0); approx_kl, KL(pi_old ||
    pi_theta) estimated by k3 of the ratio; kl_k3, the mean per-token k3 to the reference;
    kl_term, the mean of the term beta multiplies.
    """
    # BEGIN SOLUTION
    # HINT: ratio = exp(logp - old_logp), (B, T); A = adv[:, None];
    # HINT: surrogate = min(ratio * A, clamp(ratio, 1 - epsilon, 1 + epsilon) * A) (dual clip:
    # HINT: where A < 0, max(surrogate, dual_clip_c * A)), times pg_weight if given;
    # HINT: per_token_loss = -surrogate + beta * kl_penalty(logp, ref_logp, kl_estimator, old_logp if
    # HINT: kl_is_weight); loss = aggregate_loss(per_token_loss, mask, loss_agg, max_len); stats: docstring
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)  # rho = pi_theta / pi_old
    adv = adv[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
    if dual_clip_c > 0:  # dual clip (Ye et al., 2020): with A < 0 the min above is unbounded in rho
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip_c * adv), surrogate)
    if pg_weight is not None:
        surrogate = pg_weight * surrogate
    if ref_logp is not None:
        kl = common.kl_penalty(logp, ref_logp, kl_estimator, old_logp if kl_is_weight else None)
    else:
        kl = torch.zeros_like(logp)
    per_token_loss = -surrogate + beta * kl
    loss = common.aggregate_loss(per_token_loss, mask, loss_agg, max_len)
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean(((ratio < 1 - epsilon) & (adv < 0)).float(), mask),
            "clip_frac_high": common.masked_mean(((ratio > 1 + epsilon) & (adv > 0)).float(), mask),
            "approx_kl": common.masked_mean(ratio - 1 - log_ratio, mask),
            "kl_k3": common.masked_mean(common.kl_k3(logp, ref_logp) if ref_logp is not None else kl, mask),
            "kl_term": common.masked_mean(kl, mask),
        }
    return loss, stats
    # END SOLUTION


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, seed, policy, reference, data ----
    accelerator = config.make_accelerator(cfg)
    set_seed(cfg.seed)  # identical initial weights on every rank
    with accelerator.main_process_first():  # the main process downloads tokenizer and data, the others read its cache
        tokenizer = models.load_tokenizer(cfg)
        train_data, eval_data = tasks.load_task(cfg, tokenizer)  # data errors surface before models load
    reward_fn = tasks.make_reward_fn(cfg, accelerator)
    policy = models.load_model(cfg)
    ref_model = models.load_reference(cfg, policy) if cfg.beta > 0 else None
    rollout_model = models.load_rollout_model(cfg, policy)  # None unless --rollout_dtype differs
    optimizer, scheduler = models.make_optimizer(policy, cfg)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    if ref_model is not None:
        ref_model = models.prepare_frozen(accelerator, ref_model)
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
    for step in tqdm(range(start_step + 1, cfg.num_steps + 1), disable=not accelerator.is_main_process, desc="grpo"):
        # ---- rollout: a group of sampled responses per prompt ----
        batch = sampler.next()
        prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in batch], accelerator.device)
        with timer("generation"):
            unwrapped = accelerator.unwrap_model(policy)
            if rollout_model is not None:  # the sampler gets this step's weights, in its own dtype
                unwrapped = models.sync_rollout_model(rollout_model, unwrapped)
            completion_ids = common.generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=group_size)
        with timer("scoring"):
            examples = [ex for ex in batch for _ in range(group_size)]  # each prompt's samples adjacent, as generate
            prompts = [ex["prompt"] for ex in examples]
            prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
            mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
            completions = tasks.decode_completions(tokenizer, completion_ids, mask)
            rewards, correct, reward_stats = reward_fn(examples, completions)
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, mask], dim=1)
            T = completion_ids.shape[1]
            sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p}  # score on the distribution that was sampled
            micro_batches = common.micro_batches(len(input_ids), cfg.micro_batch_size)
            old_logp, ref_logp, rollout_logp = None, None, None
            with torch.no_grad():
                if cfg.num_epochs > 1:  # log-probs at sampling time; with mu = 1 they are logp.detach()
                    old_logp = torch.cat([common.token_logprobs(policy, input_ids[mb], attention_mask[mb], T,
                                                                cfg.temperature, **sampling) for mb in micro_batches])
                if ref_model is not None:
                    ref_logp = torch.cat([common.token_logprobs(ref_model, input_ids[mb], attention_mask[mb], T,
                                                                cfg.temperature) for mb in micro_batches])
                if rollout_model is not None:  # what an inference engine returns with its samples
                    rollout_logp = torch.cat([common.token_logprobs(rollout_model, input_ids[mb], attention_mask[mb],
                                                                    T, cfg.temperature, **sampling)
                                              for mb in micro_batches])
            # over the global batch: --scale_rewards batch divides by the std of every process's rewards
            adv = grpo_advantages(accelerator.gather(rewards), group_size, cfg.scale_rewards)
            adv = adv.chunk(accelerator.num_processes)[accelerator.process_index]

        num_tokens = accelerator.reduce(mask.sum().float(), reduction="mean")  # token-mean over every process
        for _ in range(cfg.num_epochs):  # stats below are those of the last (most off-policy) update
            with timer("forward_backward"):
                # ---- log-probs, ratio, clipped surrogate + KL, rollout correction, in micro-batches whose
                # gradients add up to the batch's ----
                logp, entropy = [], []
                for mb in micro_batches:
                    mb_logp, mb_entropy = common.token_logprobs(policy, input_ids[mb], attention_mask[mb], T,
                                                                cfg.temperature, with_entropy=True, **sampling)
                    mb_old_logp = old_logp[mb] if cfg.num_epochs > 1 else mb_logp.detach()
                    mb_ref_logp = ref_logp[mb] if ref_model is not None else None
                    mb_rollout_logp = rollout_logp[mb] if rollout_model is not None else None
                    pg_weight, _ = common.rollout_correction(mb_logp, mb_old_logp, mb_rollout_logp, adv[mb], mask[mb],
                                                             cfg.tis_cap, cfg.geo_mask_delta)
                    mb_loss, _ = grpo_loss(mb_logp, mb_old_logp, mb_ref_logp, adv[mb], mask[mb], cfg.epsilon, cfg.beta,
                                           cfg.loss_agg, cfg.max_new_tokens, cfg.kl_estimator, cfg.kl_is_weight,
                                           cfg.dual_clip_c, pg_weight)
                    weight = common.micro_batch_weight(mask[mb], cfg.loss_agg, num_tokens, len(input_ids))
                    run.backward(accelerator, policy, weight * mb_loss, sync=mb.stop == len(input_ids))
                    logp.append(mb_logp.detach())
                    entropy.append(mb_entropy)
                # the whole batch's loss and stats, for the log
                logp, entropy = torch.cat(logp), torch.cat(entropy)
                if cfg.num_epochs == 1:
                    old_logp = logp
                pg_weight, correction = common.rollout_correction(logp, old_logp, rollout_logp, adv, mask,
                                                                  cfg.tis_cap, cfg.geo_mask_delta)
                loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, cfg.epsilon, cfg.beta, cfg.loss_agg,
                                        cfg.max_new_tokens, cfg.kl_estimator, cfg.kl_is_weight, cfg.dual_clip_c,
                                        pg_weight)

            with timer("optimizer"):
                # ---- mu steps on the same batch ----
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
                ckpt.check_finite(step, loss, grad_norm, policy, tokenizer)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()  # once per rollout batch, so --warmup_steps counts steps as in every script

        # ---- log ----
        lengths = mask.sum(1).float()
        grouped = rewards.view(-1, group_size)
        kl = common.kl_k1(logp.detach(), ref_logp) if ref_model is not None else torch.zeros_like(logp)
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/generated": len(completion_ids),
            "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/adv_abs_max": adv.abs().max(),
            "train/clip_frac_low": stats["clip_frac_low"],
            "train/clip_frac_high": stats["clip_frac_high"],
            "train/approx_kl": stats["approx_kl"],
            "train/kl_k3": stats["kl_k3"],
            "train/kl_term": stats["kl_term"],
            "train/kl_seq": common.masked_sum(kl, mask) / len(examples),
            "train/entropy": common.masked_mean(entropy, mask),
            "train/loss": loss.detach(),
            "train/grad_norm": grad_norm,
            "train/completion_len": lengths.mean(),
            **{f"train/{key}": value for key, value in correction.items()},
            **timer.metrics(),
        }
        metrics["time/tokens_per_s"] = lengths.sum() / metrics["time/step_s"]
        metrics = run.reduce_metrics(accelerator, metrics)
        if step % cfg.eval_every == 0 or step == cfg.num_steps:
            metrics.update(tasks.evaluate(policy, tokenizer, eval_data, cfg, accelerator))
        logger.log(step, metrics, samples=zip(prompts, completions, rewards.tolist()))
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
