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
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import common
from support import config, models, run, tasks
from support.config import arg


@dataclass
class Config(config.TrainConfig):
    baseline: str = arg("greedy", "'greedy' (ReMax) or 'none' (plain REINFORCE).")
    beta: float = arg(0.05, "Coefficient of the per-token k1 penalty folded into the return (0 = no reference).")
    adv_clip: float = arg(5.0, "Clip the advantage r - r_greedy to [-adv_clip, adv_clip] (0 = off).")
    loss_agg: str = arg("token-mean", "Loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum-norm.")

    def __post_init__(self):
        super().__post_init__()
        if self.baseline not in ("greedy", "none"):
            raise ValueError(f"--baseline must be 'greedy' or 'none' (got {self.baseline!r}).")
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0 (got {self.beta}).")
        if self.adv_clip < 0:
            raise ValueError(f"--adv_clip must be >= 0 (got {self.adv_clip}).")
        if self.loss_agg not in config.LOSS_AGG_MODES:
            raise ValueError(f"--loss_agg must be one of {config.LOSS_AGG_MODES} (got {self.loss_agg!r}).")


def remax_advantages(rewards, greedy_rewards):
    """A_i = r(x_i, y_i) - r(x_i, y_greedy_i): the greedy response's reward as baseline. (B,)"""
    # BEGIN SOLUTION
    # HINT: adv = rewards - greedy_rewards; (B,) in, (B,) out
    return rewards - greedy_rewards
    # END SOLUTION


def remax_loss(logp, adv, kl, mask, beta, loss_agg="token-mean", max_len=None):
    """REINFORCE loss with the k1 penalty folded into the return.

    logp, kl: (B, T) per-token log-probs (with grad) and k1 = logp - ref_logp (detached);
    adv: (B,) sequence advantage. Per-token return G_t = A - beta * sum_{t'>=t} k1_t'
    (reward-to-go: the penalty on earlier tokens does not depend on later actions).
    Loss = aggregate(-G_t * logp_t); max_len is the seq-mean-token-sum-norm constant
    (--max_new_tokens). Returns (loss, stats) with stats: return_mean (mean G_t over tokens).
    """
    # BEGIN SOLUTION
    # HINT: returns = adv[:, None] - beta * reward_to_go(kl, mask), detached, (B, T);
    # HINT: loss = aggregate_loss(-returns * logp, mask, loss_agg, max_len);
    # HINT: stats = {'return_mean': masked_mean(returns, mask)}
    returns = (adv[:, None] - beta * common.reward_to_go(kl, mask)).detach()
    loss = common.aggregate_loss(-returns * logp, mask, loss_agg, max_len)
    return loss, {"return_mean": common.masked_mean(returns, mask)}
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
    optimizer, scheduler = models.make_optimizer(policy, cfg)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    if ref_model is not None:
        ref_model = models.prepare_frozen(accelerator, ref_model)
    sampler = tasks.PromptSampler(train_data, cfg.batch_size, cfg.seed, accelerator.process_index,
                                  accelerator.num_processes)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    ckpt = run.Checkpointer(cfg, accelerator, sampler)
    start_step = ckpt.resume()
    logger = run.MetricLogger(cfg, accelerator, start_step)
    if start_step == 0:
        logger.log(0, tasks.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    timer = run.StepTimer()
    for step in tqdm(range(start_step + 1, cfg.num_steps + 1), disable=not accelerator.is_main_process, desc="remax"):
        # ---- rollout: one sampled response per prompt ----
        batch = sampler.next()
        prompts = [ex["prompt"] for ex in batch]
        prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, prompts, accelerator.device)
        with timer("generation"):
            unwrapped = accelerator.unwrap_model(policy)
            completion_ids = common.generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg)
        with timer("scoring"):
            mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
            completions = tasks.decode_completions(tokenizer, completion_ids, mask)
            rewards, correct, reward_stats = reward_fn(batch, completions)
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, mask], dim=1)
            T = completion_ids.shape[1]
            micro_batches = common.micro_batches(len(input_ids), cfg.micro_batch_size)
            if ref_model is not None:
                with torch.no_grad():
                    ref_logp = torch.cat([common.token_logprobs(ref_model, input_ids[mb], attention_mask[mb], T,
                                                                cfg.temperature) for mb in micro_batches])

        # ---- baseline: the reward of the greedy response (ReMax), or none (REINFORCE) ----
        if cfg.baseline == "greedy":
            with timer("generation"):
                greedy_ids = common.generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg, greedy=True)
            with timer("scoring"):
                greedy_mask = common.completion_mask(greedy_ids, tokenizer.eos_token_id)
                greedy_rewards, _, _ = reward_fn(batch, tasks.decode_completions(tokenizer, greedy_ids, greedy_mask))
        else:
            greedy_ids, greedy_rewards = completion_ids[:0], torch.zeros_like(rewards)
        adv = remax_advantages(rewards, greedy_rewards)
        if cfg.adv_clip > 0:
            adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)

        with timer("forward_backward"):
            # ---- log-probs, KL penalty, loss, in micro-batches whose gradients add up to the batch's ----
            num_tokens = accelerator.reduce(mask.sum().float(), reduction="mean")  # token-mean over every process
            logp, entropy = [], []
            for mb in micro_batches:
                mb_logp, mb_entropy = common.token_logprobs(policy, input_ids[mb], attention_mask[mb], T,
                                                            cfg.temperature, with_entropy=True, top_k=cfg.top_k,
                                                            top_p=cfg.top_p)
                mb_kl = common.kl_k1(mb_logp.detach(), ref_logp[mb]) if ref_model is not None else \
                    torch.zeros_like(mb_logp)
                mb_loss, _ = remax_loss(mb_logp, adv[mb], mb_kl, mask[mb], cfg.beta, cfg.loss_agg,
                                        max_len=cfg.max_new_tokens)
                weight = common.micro_batch_weight(mask[mb], cfg.loss_agg, num_tokens, len(input_ids))
                run.backward(accelerator, policy, weight * mb_loss, sync=mb.stop == len(input_ids))
                logp.append(mb_logp.detach())
                entropy.append(mb_entropy)
            logp, entropy = torch.cat(logp), torch.cat(entropy)
            # the whole batch's loss and stats, for the log
            kl = common.kl_k1(logp, ref_logp) if ref_model is not None else torch.zeros_like(logp)
            loss, stats = remax_loss(logp, adv, kl, mask, cfg.beta, cfg.loss_agg, max_len=cfg.max_new_tokens)

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
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/greedy_reward": greedy_rewards.mean(),
            "train/generated": len(completion_ids) + len(greedy_ids),
            "train/adv_mean": adv.mean(),
            "train/adv_std": adv.std(),
            "train/return_mean": stats["return_mean"],
            "train/kl_seq": common.masked_sum(kl, mask) / len(batch),
            "train/entropy": common.masked_mean(entropy, mask),
            "train/loss": loss.detach(),
            "train/grad_norm": grad_norm,
            "train/completion_len": lengths.mean(),
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
