"""PPO with a learned value model (Schulman et al., 2017, https://arxiv.org/abs/1707.06347;
for LLMs: Ouyang et al., 2022, and Huang et al., "The N+ implementation details of RLHF
with PPO", 2024).

Each sampled completion is an episode whose actions are its tokens. The reward is
r_t = -beta * (logp_t - ref_logp_t) on every token plus the task reward R(x, y) on the
last one. A critic V (the policy's backbone with a scalar head instead of the LM head)
predicts the return from every prefix, and GAE turns rewards and values into per-token
advantages:

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   V_{T+1} = 0.

The batch is then reused for --num_epochs passes over --num_mini_batches minibatches, which
is why the ratio rho = pi_theta / pi_old and its clip are needed. What this costs against
remax.py: a second trainable model (its gradients and Adam state) and its forward/backward
passes in every update; what it buys: a per-token, per-prefix baseline instead of one
greedy reward per prompt, and several updates per batch of samples.

    accelerate launch ppo.py                                     # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 ppo.py       # data-parallel (gloo on CPU)
    python ppo.py --adaptive_kl True --kl_target 1.0             # Ziegler et al. KL control
"""
import os
import sys
from dataclasses import dataclass
from typing import Optional

if __name__ == "__main__":  # run as lab/ppo.py: the repository's root first, so that `ppo` is the lesson
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
import vapo  # noqa: E402
from ppo import (AdaptiveKLController, ValueModel, explained_variance, gae, last_action,  # noqa: E402
                 ppo_value_loss)  # the lesson's math and models
from lab import config as lab_config  # noqa: E402
from lab import corrections, engine, environments, losses, tasks  # noqa: E402
from support import config, helpers, models, run  # noqa: E402
from support.config import arg  # noqa: E402


@dataclass
class Config(environments.AgentConfig, lab_config.CorrectionConfig):
    # 150 batches of num_epochs x num_mini_batches = 16 optimizer steps each: 5 minutes on 2 CPU cores
    num_steps: int = arg(150, "Rollout batches (each gives num_epochs x num_mini_batches optimizer steps).")
    # below the common 1e-4 because each batch gives 16 steps (tuned on the embedded model, docs/ppo.md)
    learning_rate: float = arg(3e-5, "Policy learning rate (AdamW); papers use 1e-6..3e-6 for 7B models.")
    critic_learning_rate: float = arg(1e-4, "Critic learning rate (AdamW); papers use ~1e-5 for 7B models.")
    reward_model_path: str = arg("", "Initialise the critic from this sequence-classification checkpoint "
                                 "(default: the policy's backbone with a new value head).")
    beta: float = arg(0.05, "Coefficient of the per-token k1 penalty in the reward (initial value if --adaptive_kl).")
    adaptive_kl: bool = arg(False, "Adapt beta towards --kl_target (Ziegler et al., 2019).")
    kl_target: float = arg(1.0, "Target KL per sequence (nats) for --adaptive_kl.")
    kl_horizon: int = arg(10000, "Horizon of the adaptive KL controller, in samples.")
    gamma: float = arg(1.0, "Discount factor of GAE.")
    lam: float = arg(0.95, "GAE lambda: 1 = Monte Carlo returns (high variance), 0 = one-step TD (biased by V).")
    lam_critic: Optional[float] = arg(None, "GAE lambda of the critic's targets (default: --lam; VC-PPO and VAPO "
                                      "use 1.0).")
    lam_alpha: float = arg(0.0, "Length-adaptive policy lambda 1 - 1/(alpha |y|) per sequence (VAPO: 0.05; "
                           "0 = off: --lam).")
    num_epochs: int = arg(4, "K: passes over each rollout batch.")
    num_mini_batches: int = arg(4, "Minibatches per pass (one optimizer step each); must divide --batch_size.")
    epsilon: float = arg(0.2, "Clip the ratio pi_theta / pi_old to [1 - epsilon, 1 + epsilon] in the policy loss.")
    dual_clip_c: float = arg(0.0, "Dual clip: a token with A < 0 loses at most c |A|, whatever its ratio (0 = off).")
    epsilon_value: float = arg(0.2, "Clip the new value to V_old +- epsilon_value in the value loss.")
    vf_coef: float = arg(0.1, "Weight of the value loss (it only scales the critic's gradient before clipping).")
    epsilon_high: Optional[float] = arg(None, "Upper clip of the ratio, clip-higher (VAPO: 0.28; default --epsilon).")
    value_pretrain_steps: Optional[int] = arg(None, "VAPO's value pretraining: rollout batches of the initial policy "
                                              "the critic regresses on Monte Carlo returns first (0 = none).")
    pos_lm_coef: Optional[float] = arg(None, "mu: weight of VAPO's positive-example LM loss, the NLL of the correct "
                                       "samples' tokens (token-mean; 0 = none).")
    num_generations: Optional[int] = arg(None, "VAPO's group sampling: batch_size / G prompts a step, each sampled G "
                                         "times, its rows adjacent (VAPO: 16; default 1: one sample per prompt).")
    vapo: bool = arg(False, "VAPO's recipe: each VAPO flag left unset takes VAPO's value (docs/algorithms.md#vapo).")
    reuses_batch = True  # num_epochs x num_mini_batches updates on each batch (lab_config.LabConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.vapo:  # the flags given keep their value; lam_alpha's default is 0 (off)
            for name, value in VAPO_RECIPE.items():
                if getattr(self, name) is None or (name == "lam_alpha" and self.lam_alpha == 0):
                    setattr(self, name, value)
        self.value_pretrain_steps, self.pos_lm_coef = self.value_pretrain_steps or 0, self.pos_lm_coef or 0.0
        self.num_generations = self.num_generations or 1
        config.check(self.num_generations >= 1 and self.batch_size % self.num_generations == 0, f"--num_generations "
                     f"({self.num_generations}) must be >= 1 and divide --batch_size ({self.batch_size}).")
        config.check_rules(self, value_pretrain_steps=config.NON_NEGATIVE, pos_lm_coef=config.NON_NEGATIVE,
                           epsilon_high=config.POSITIVE)
        config.check(self.value_pretrain_steps == 0 or self.async_rollouts == 0, "--value_pretrain_steps samples "
                     "from the initial policy in the learner: give --async_rollouts 0.")
        config.check_rules(self, dual_clip_c=lab_config.DUAL_CLIP, num_epochs=config.AT_LEAST_ONE)
        config.check_rules(self, beta=config.NON_NEGATIVE, gamma=config.PROBABILITY, lam=config.PROBABILITY,
                           lam_critic=config.PROBABILITY, lam_alpha=config.NON_NEGATIVE, epsilon=config.FRACTION,
                           **{name: config.POSITIVE for name in ("num_steps", "learning_rate", "critic_learning_rate",
                                                                 "num_mini_batches", "epsilon_value", "vf_coef",
                                                                 "kl_target", "kl_horizon")})
        config.check(not self.adaptive_kl or self.beta > 0, "--adaptive_kl needs --beta > 0 (it scales beta).")
        config.check(self.geo_mask_delta == 0, "--geo_mask_delta masks sequences by their advantage, and PPO's is "
                     "per token: give --tis_cap or --tis_veto.")
        config.check(self.batch_size % self.num_mini_batches == 0,
                     f"--num_mini_batches ({self.num_mini_batches}) must divide --batch_size ({self.batch_size}).")
        self.clip = common.Clip(self.epsilon, self.epsilon_high or self.epsilon)


# VAPO (Yue et al., 2025): decoupled GAE (critic lam 1), length-adaptive lam (alpha 0.05), clip-higher, the
# positive-example LM loss (mu 0.1), value pretraining (the paper: 50 steps; 10 here, for the embedded task's runs),
# group sampling (16 samples of each prompt: 4 prompts of the default 64 rows)
VAPO_RECIPE = {"lam_critic": 1.0, "lam_alpha": 0.05, "epsilon_high": 0.28, "pos_lm_coef": 0.1,
               "value_pretrain_steps": 10, "num_generations": 16}


class GroupedPrompts(tasks.PromptSampler):
    """VAPO's group sampling: batch_size / G prompts a step, each sampled G times, its G rows adjacent
    (next() gives async_sampling.draw's pair); with G = 1, the lesson's prompts, one sample each."""

    def __init__(self, examples, cfg, rank=0, world_size=1):
        super().__init__(examples, cfg.batch_size // cfg.num_generations, cfg.seed, rank, world_size)
        self.num_generations = cfg.num_generations

    def next(self):
        return super().next(), self.num_generations


def pretrain_value(cfg, accelerator, trainer, critic, sampler, reward_fn, ref_model=None):
    """VAPO's value pretraining: before the first policy update, --value_pretrain_steps rollout batches of the
    initial policy, the critic regressed (0.5 token-mean squared error, num_epochs x num_mini_batches critic steps
    each) on every token's Monte Carlo return, GAE with lam = 1 and V = 0 of the rewards the main loop gives: the
    task reward R at the last token and -beta k1 on every token (k1 is 0 while the policy samples its whole
    distribution and is the reference; with --top_k / --top_p the policy's log-probs are the truncated
    distribution's, and k1 is not). The token-mean is the global batch's: each process divides its sum by the mean
    token count over processes, as DDP averages. A minibatch is one forward pass (--micro_batch_size does not split
    it). Returns the first and last batch's value loss and explained variance (of the critic before its updates)."""
    first = last = None
    for _ in range(cfg.value_pretrain_steps):
        rollout = trainer.rollout(sampler)
        rewards, _, _ = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
        mask, T = rollout.mask, rollout.mask.shape[1]
        kl = common.kl_k1(trainer.old_logprobs(rollout), trainer.reference_logprobs(ref_model, rollout)) \
            if ref_model is not None else torch.zeros(mask.shape, device=mask.device)
        token_rewards = -cfg.beta * kl
        token_rewards[torch.arange(len(rollout)), last_action(mask)] += rewards
        _, returns = gae(token_rewards, torch.zeros_like(token_rewards), mask, cfg.gamma, 1.0)  # (B, T)
        values = trainer.values(critic.model, rollout)
        last = {"pretrain/value_loss": 0.5 * common.masked_mean((values - returns) ** 2, mask),
                "pretrain/explained_variance": explained_variance(values, returns, mask)}
        first = first or last
        for epoch in range(cfg.num_epochs):
            for rows in torch.randperm(len(rollout), device=mask.device).chunk(cfg.num_mini_batches):
                num_tokens = accelerator.reduce(mask[rows].sum().float(), "mean")  # per process, as DDP averages
                values = critic.model(rollout.input_ids[rows], rollout.attention_mask[rows], T)  # with gradient
                sse = common.masked_sum((values - returns[rows]) ** 2, mask[rows])
                accelerator.backward(0.5 * sse / torch.where(num_tokens > 0, num_tokens, 1.0))
                engine.clip_grad_norms(accelerator, [critic], cfg.max_grad_norm or float("inf"))
                engine.step_optimizers(accelerator, [critic])
    return {**{f"{k}_first": v for k, v in first.items()}, **{f"{k}_last": v for k, v in last.items()}}


# the critic's own panels, next to run.PLOT_KEYS in curves.png
CRITIC_PLOT_KEYS = ("train/value_loss", "train/explained_variance", "train/value_clip_frac",
                    "train/clip_frac_high", "train/approx_kl", "train/beta")


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, critic, reference (PLUMBING: skip on a first read) ----
    accelerator = helpers.make_accelerator(cfg)
    if accelerator.state.deepspeed_plugin is not None:
        raise SystemExit("error: ppo.py trains two models (policy and critic) and accelerate's DeepSpeed integration "
                         "prepares one model per Accelerator: launch it with DDP (e.g. configs/ddp_8gpu.yaml).")
    tokenizer, train_data, eval_data = engine.load_data(cfg, accelerator)
    reward_fn = tasks.make_reward_fn(cfg, accelerator)
    policy, ref_model, rollout_model = engine.load_models(cfg, accelerator, reference=cfg.beta > 0)
    if cfg.reward_model_path:
        models.check_model_path(cfg.reward_model_path, flag="--reward_model_path")
    lora = models.lora_config(cfg, "SEQ_CLS") if cfg.lora_r > 0 else None
    value_model = ValueModel(cfg.reward_model_path or cfg.model_name_or_path, cfg.torch_dtype,
                             cfg.gradient_checkpointing, lora=lora)
    optimizer, scheduler = models.make_optimizer(value_model, cfg, cfg.critic_learning_rate)
    critic = engine.Trainable(*accelerator.prepare(value_model, optimizer, scheduler), name="critic")
    kl_ctl = AdaptiveKLController(cfg.beta, cfg.kl_target, cfg.kl_horizon)
    accelerator.register_for_checkpointing(kl_ctl)
    sampler = GroupedPrompts(train_data, cfg, accelerator.process_index, accelerator.num_processes)
    trainer = engine.Trainer(cfg, accelerator, tokenizer, sampler, eval_data, policy, rollout_model, others=[critic])
    if trainer.resume() == 0:  # --resume_from: the checkpoint's step, else 0
        trainer.evaluate(step=0)  # held-out accuracy before training
        if cfg.value_pretrain_steps > 0:  # VAPO: the critic first learns the initial policy's returns
            trainer.logger.log(0, run.reduce_metrics(accelerator, pretrain_value(cfg, accelerator, trainer, critic,
                                                                                 sampler, reward_fn, ref_model)))

    for step in trainer.steps():
        # ---- rollout: one sampled response per prompt (--num_generations G: G of each, adjacent) ----
        rollout = trainer.rollout(sampler)  # sampled now, or taken from the sampler process (--async_rollouts)
        input_ids, attention_mask, mask = rollout.input_ids, rollout.attention_mask, rollout.mask
        T = mask.shape[1]

        # ---- reward, and pi_old, V_old and pi_ref at rollout time, for every update below ----
        with trainer.timer("reward"):
            rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions, rollout.rewards)
        old_logp = trainer.old_logprobs(rollout)
        old_values = trainer.values(critic.model, rollout)
        ref_logp = trainer.reference_logprobs(ref_model, rollout)  # pi_ref (None when beta = 0)
        rollout_logp = trainer.sampler_logprobs(rollout)  # the sampler process's (mu), else None
        m2po_keep = engine.m2po_keep(trainer, rollout, old_logp, rollout_logp)  # M2PO's mask of the batch, or None

        # ---- advantages: per-token reward, GAE (the critic is the baseline), whitened ----
        with trainer.timer("gae"):
            kl = common.kl_k1(old_logp, ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
            last = last_action(mask)  # the EOS, or the last token when cut at max length: the reward's place
            token_rewards = -kl_ctl.value * kl
            token_rewards[torch.arange(len(rollout)), last] += rewards
            lam = vapo.length_adaptive_lam(mask.sum(1), cfg.lam_alpha) if cfg.lam_alpha > 0 else cfg.lam
            lam_critic = cfg.lam if cfg.lam_critic is None else cfg.lam_critic
            adv, returns = vapo.decoupled_gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam_policy=lam,
                                              lam_critic=lam_critic)
            # whitened over the global batch: every process's tokens (completions padded to one length)
            all_adv, all_mask = (accelerator.gather(accelerator.pad_across_processes(x, dim=1)) for x in (adv, mask))
            adv = common.masked_whiten(all_adv, all_mask).chunk(accelerator.num_processes)[accelerator.process_index]
            adv = adv[:, :T]

        # ---- update: num_epochs passes over num_mini_batches minibatches, one optimizer step of each model per
        # minibatch, its gradient summed over its micro-batches; the loss: the clipped policy loss plus vf_coef
        # times the clipped value loss ----
        updates, sampler_stats = [], []  # sampler_stats: every micro-batch's (token count, sampler statistics)
        for epoch in range(cfg.num_epochs):
            for rows in torch.randperm(cfg.batch_size, device=accelerator.device).chunk(cfg.num_mini_batches):
                if cfg.pos_lm_coef > 0:  # VAPO's NLL divides by the minibatch's correct tokens (mean over processes)
                    positive_tokens = accelerator.reduce((mask[rows] * correct[rows, None]).sum().float(), "mean")
                for mb in trainer.micro_batches(rollout, common.Aggregation("token-mean"), rows):
                    logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                    pg_weight, correction, per_row = None, {}, {}
                    if rollout_logp is not None:  # a stale sampler: pi_old is the proximal policy, mu the sampler
                        pg_weight, correction, per_row = corrections.rollout_correction(
                            logp, mb.of(old_logp), mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, 0.0,
                            cfg.tis_level, cfg.tis_veto, mb.of(m2po_keep))
                    pg_loss, pg_stats = losses.clipped_loss(logp, mb.of(old_logp), mb.of(adv), mb.mask, cfg.clip,
                                                            mb.agg, cfg.dual_clip_c, pg_weight)
                    if cfg.pos_lm_coef > 0:  # VAPO: imitate the correct samples, token-mean over the minibatch's
                        nll = vapo.positive_example_nll(logp, mb.mask, mb.of(correct), positive_tokens)
                        pg_loss, pg_stats = pg_loss + cfg.pos_lm_coef * nll, {**pg_stats, "pos_lm_loss": common.Sums(
                            (nll.detach(),), float)}  # a micro-batch's part of the minibatch's NLL: the parts add up
                    values = critic.model(mb.of(input_ids), mb.of(attention_mask), T)  # (b, T), with gradient
                    vf_loss, vf_stats = ppo_value_loss(values, mb.of(old_values), mb.of(returns), mb.mask,
                                                       cfg.epsilon_value, mb.agg)
                    trainer.backward(pg_loss + cfg.vf_coef * vf_loss, mb, {
                        "policy_loss": common.Sums((pg_loss.detach(),), float),  # the micro-batches' parts add up
                        "value_loss": common.Sums((vf_loss.detach(),), float), "value_clip_frac": vf_stats["clip_frac"],
                        **pg_stats, **correction,
                        "entropy": common.masked_mean(entropy, mb.mask)}, per_row)
                    sampler_stats.append((mb.mask.sum(), correction))
                updates.append(trainer.step(policy, critic))  # clip each, check finite, both optimizers step
        stats = engine.over_updates(updates, sampler_stats)  # means over the updates; the sampler's: the batch's

        # ---- log (PLUMBING: docs/metrics.md says what each metric means) ----
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/value_mean": common.masked_mean(old_values, mask),
            "train/return_mean": common.masked_mean(returns, mask),
            "train/explained_variance": explained_variance(old_values, returns, mask),
            "train/kl_seq": common.masked_sum(kl, mask) / len(rollout),
            "train/beta": kl_ctl.value,
            **{f"train/{key}": value for key, value in stats.items()},  # means over the updates
            **reward_stats,
        }
        if cfg.adaptive_kl:  # Ziegler et al.'s controller, on the KL averaged over every process
            kl_ctl.update(engine.mean_over_processes(accelerator, metrics["train/kl_seq"]),
                          cfg.batch_size * accelerator.num_processes)
        tokens = {"value": old_values, "return": returns, "kl_k1": kl}  # for the rollout viewer, with adv
        if trainer.end_step(step, metrics, rollout, rewards, adv, tokens):
            break

    # ---- end: save, plot (PLUMBING) ----
    if accelerator.is_main_process:
        run.plot_metrics(trainer.logger.path, f"{cfg.output_dir}/critic_curves.png", CRITIC_PLOT_KEYS)
    if cfg.save_model:  # the critic beside the policy; under LoRA merged: a whole critic either way
        models.save_model(accelerator, accelerator.unwrap_model(critic.model).model, tokenizer,
                          f"{cfg.output_dir}/final/critic", merge_lora=True)
    trainer.finish()


if __name__ == "__main__":
    helpers.launch(main)
