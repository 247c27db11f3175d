"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., 2024, "Back to Basics",
https://arxiv.org/abs/2402.14740; the estimator is Kool et al., 2019).

For each prompt x, sample K responses y_1..y_K ~ pi(.|x). The baseline of response i is the mean
reward of the OTHER K-1 responses, so it does not depend on y_i and the gradient stays unbiased:

    A_i = r~_i - mean_{j != i} r~_j = K / (K-1) * (r~_i - mean(r~)),   r~ = r - beta * sum_t k1_t

The per-token k1 penalty (detached) is summed over the sequence and folded into the reward.
The whole completion is one action: loss -A_i * log pi(y_i | x) (sum of the token log-probs),
averaged over the samples; one on-policy update per batch: no ratio, no clipping, no value
model. The price is K generations per prompt.

    accelerate launch rloo.py                                    # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 rloo.py      # data-parallel on CPU
    python rloo.py --reward_scales hetero                        # the group baseline adapts per prompt
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
    beta: float = arg(0.05, "Coefficient of the sequence k1 penalty folded into the reward (0 = no reference).")

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0 (got {self.beta}).")
        if self.micro_batch_size % self.num_generations:
            raise ValueError(f"--micro_batch_size ({self.micro_batch_size}) must be a multiple of --num_generations "
                             f"({self.num_generations}): a sample's leave-one-out baseline needs its group's KL "
                             "penalties, so a micro-batch holds whole groups.")


def rloo_advantages(rewards, group_size):
    """A_i = r_i - mean_{j != i} r_j within each group, for (B,) rewards with each group's K
    samples adjacent. Equals K/(K-1) * (r_i - mean(r)). Returns (B,)."""
    # BEGIN SOLUTION
    # HINT: group rewards as (B / K, K) rows of adjacent samples;
    # HINT: adv = r - (row sum - r) / (K - 1), back to (B,)
    grouped = rewards.view(-1, group_size)  # (B / K, K)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).view(-1)
    # END SOLUTION


def rloo_loss(logp, adv, mask, pg_weight=None):
    """REINFORCE with the whole completion as one action: mean_i of -A_i * sum_t logp_{i,t}.

    logp: (B, T) per-token log-probs (with grad); adv: (B,) detached; mask: (B, T); pg_weight
    (B, T), detached, multiplies each token's log-prob (TIS, masks).
    Returns (loss, stats) with stats: seq_logp_mean, the mean sequence log-prob log pi(y_i|x)."""
    # BEGIN SOLUTION
    # HINT: seq_logp = masked_sum(logp, mask, dim=1), (B,) (pg_weight: masked_sum of pg_weight * logp);
    # HINT: loss = -mean(adv.detach() * seq_logp); stats = {'seq_logp_mean': mean of the unweighted seq_logp}
    seq_logp = common.masked_sum(logp, mask, dim=1)  # log pi(y_i | x)
    weighted = seq_logp if pg_weight is None else common.masked_sum(pg_weight * logp, mask, dim=1)
    loss = -(adv.detach() * weighted).mean()
    return loss, {"seq_logp_mean": seq_logp.detach().mean()}
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
    for step in tqdm(range(start_step + 1, cfg.num_steps + 1), disable=not accelerator.is_main_process, desc="rloo"):
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
            micro_batches = common.micro_batches(len(input_ids), cfg.micro_batch_size)  # whole groups each
            ref_logp, rollout_logp = None, None
            with torch.no_grad():
                if ref_model is not None:
                    ref_logp = torch.cat([common.token_logprobs(ref_model, input_ids[mb], attention_mask[mb], T,
                                                                cfg.temperature) for mb in micro_batches])
                if rollout_model is not None:  # what an inference engine returns with its samples
                    rollout_logp = torch.cat([common.token_logprobs(rollout_model, input_ids[mb], attention_mask[mb],
                                                                    T, cfg.temperature, **sampling)
                                              for mb in micro_batches])

        with timer("forward_backward"):
            # ---- log-probs, KL folded into the reward, leave-one-out advantage, loss, in micro-batches of whole
            # groups (a sample's baseline needs its group's KL penalties) whose gradients add up to the batch's ----
            logp, entropy = [], []
            for mb in micro_batches:
                mb_logp, mb_entropy = common.token_logprobs(policy, input_ids[mb], attention_mask[mb], T,
                                                            cfg.temperature, with_entropy=True, **sampling)
                mb_kl = common.kl_k1(mb_logp.detach(), ref_logp[mb]) if ref_model is not None else \
                    torch.zeros_like(mb_logp)
                mb_rewards_kl = rewards[mb] - cfg.beta * common.masked_sum(mb_kl, mask[mb], dim=1)  # r - b sum k1_t
                mb_adv = rloo_advantages(mb_rewards_kl, group_size)
                mb_rollout_logp = rollout_logp[mb] if rollout_model is not None else None
                pg_weight, _ = common.rollout_correction(mb_logp, mb_logp.detach(), mb_rollout_logp, mb_adv, mask[mb],
                                                         cfg.tis_cap, cfg.geo_mask_delta)
                mb_loss, _ = rloo_loss(mb_logp, mb_adv, mask[mb], pg_weight)
                weight = common.micro_batch_weight(mask[mb], "seq-mean", None, len(input_ids))
                run.backward(accelerator, policy, weight * mb_loss, sync=mb.stop == len(input_ids))
                logp.append(mb_logp.detach())
                entropy.append(mb_entropy)
            # the whole batch's advantages, loss and stats, for the log
            logp, entropy = torch.cat(logp), torch.cat(entropy)
            kl = common.kl_k1(logp, ref_logp) if ref_model is not None else torch.zeros_like(logp)
            rewards_kl = rewards - cfg.beta * common.masked_sum(kl, mask, dim=1)
            adv = rloo_advantages(rewards_kl, group_size)
            pg_weight, correction = common.rollout_correction(logp, logp, rollout_logp, adv, mask, cfg.tis_cap,
                                                              cfg.geo_mask_delta)
            loss, stats = rloo_loss(logp, adv, mask, pg_weight)

        with timer("optimizer"):
            # ---- one on-policy step ----
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
            ckpt.check_finite(step, loss, grad_norm, policy, tokenizer)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        # ---- log ----
        lengths = mask.sum(1).float()
        grouped = rewards.view(-1, group_size)
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/generated": len(completion_ids),
            "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
            "train/reward_with_kl": rewards_kl.mean(),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/seq_logp": stats["seq_logp_mean"],
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
