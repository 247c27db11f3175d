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
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoModelForSequenceClassification

import common
from support import config, engine, environments, models, run, tasks
from support.config import arg


@dataclass
class Config(environments.AgentConfig, config.CorrectionConfig):
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
    reuses_batch = True  # num_epochs x num_mini_batches updates on each batch (config.TrainConfig)

    def __post_init__(self):
        super().__post_init__()
        config.check_rules(self, dual_clip_c=config.DUAL_CLIP, num_epochs=config.AT_LEAST_ONE)
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
        self.clip = common.Clip(self.epsilon, self.epsilon, self.dual_clip_c)


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., 2016), per token. (B, T) in, out.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t,
    with V_{T+1} = 0 after the last valid token. `mask` is 1 on the tokens that are actions: a
    completion's prefix, or an episode's model tokens (agents.py), where t + 1 is the next action,
    the environment's tokens between them skipped. Positions where it is 0 contribute nothing and
    get A = R = 0. lam is a number or a (B,) tensor, one lambda per sequence. Returns (advantages, returns).
    """
    # BEGIN SOLUTION
    acts = mask.bool()
    rewards = torch.where(acts, rewards, torch.zeros_like(rewards))
    values = torch.where(acts, values, torch.zeros_like(values))
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):  # a position that is no action leaves the recursion as it is
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = torch.where(acts[:, t], delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(acts[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
    advantages = torch.where(acts, advantages, torch.zeros_like(advantages))
    returns = advantages + values
    return advantages, returns
    # END SOLUTION


def decoupled_gae(rewards, values, mask, gamma, lam_policy, lam_critic):
    """Decoupled GAE (VC-PPO, Yuan et al., 2025; VAPO): the policy's advantages with lam_policy,
    the critic's targets R_t = A_t + V_t with lam_critic (1: the Monte Carlo return, which an
    untrained V cannot bias). (B, T) in; returns (advantages, returns)."""
    # BEGIN SOLUTION
    advantages, _ = gae(rewards, values, mask, gamma, lam_policy)
    _, returns = gae(rewards, values, mask, gamma, lam_critic)
    return advantages, returns
    # END SOLUTION


def last_action(mask):
    """(B,) the position of each row's last 1 in the (B, T) mask: its last action (0 when it has none)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask.bool(), positions, 0).max(dim=1).values


def length_adaptive_lam(lengths, alpha):
    """VAPO's length-adaptive GAE (Yue et al., 2025): lam = 1 - 1/(alpha |y|) per sequence, so the
    total weight of the TD errors, 1/(1 - lam) = alpha |y|, grows with the length. Clamped at 0
    (one-step TD) for |y| <= 1/alpha. (B,) lengths in, (B,) lambdas out."""
    # BEGIN SOLUTION
    return (1 - 1 / (alpha * lengths.float())).clamp(min=0.0)
    # END SOLUTION


def ppo_policy_loss(logp, old_logp, adv, mask, epsilon, dual_clip_c=0.0, loss_agg="token-mean", pg_weight=None):
    """Clipped surrogate (Schulman et al., 2017, eq. 7), token-mean over the minibatch (loss_agg: token-mean, or
    the micro-batch's common.Aggregation of it).

    logp: (B, T) with grad; old_logp, adv: (B, T) from rollout time. Per token
    -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon) A), rho = exp(logp - old_logp): once the ratio
    has moved past the clip in the direction A favours, the gradient is zero. With A < 0 it is
    unbounded as rho grows; dual_clip_c > 1 caps that token's loss at c |A|. pg_weight (B, T), detached, multiplies
    the surrogate (TIS, masks against a stale sampler: --async_rollouts).
    Returns (loss, stats): clip_frac_low / clip_frac_high, the fraction of tokens clipped below
    (rho < 1 - epsilon with A < 0) and above (rho > 1 + epsilon with A > 0); approx_kl, the k3
    estimate of KL(pi_old || pi_theta) from the ratio.
    """
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take logp's value,
    # so the gradient at a padded position is 0, not 0 * inf = NaN from an exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    # BEGIN SOLUTION
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
    if dual_clip_c > 0:  # dual clip (Ye et al., 2020)
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip_c * adv), surrogate)
    if pg_weight is not None:  # a padding weight may hold anything: keep it out of the gradient
        surrogate = torch.where(mask.bool(), pg_weight, 0.0) * surrogate
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    with torch.no_grad():
        stats = {
            "clip_frac_low": common.masked_mean(((ratio < 1 - epsilon) & (adv < 0)).float(), mask),
            "clip_frac_high": common.masked_mean(((ratio > 1 + epsilon) & (adv > 0)).float(), mask),
            "approx_kl": common.masked_mean(ratio - 1 - log_ratio, mask),
        }
    return loss, stats
    # END SOLUTION


def ppo_value_loss(values, old_values, returns, mask, epsilon_value, loss_agg="token-mean"):
    """Clipped value loss, token-mean (loss_agg: token-mean, or the micro-batch's common.Aggregation of it):
    0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    values: (B, T) with grad; old_values, returns: (B, T) from rollout time. Like the policy
    clip, it keeps the critic near the one that produced the advantages.
    Returns (loss, stats) with stats: clip_frac (fraction of tokens where the clipped term wins).
    """
    # BEGIN SOLUTION
    values_clipped = old_values + torch.clamp(values - old_values, -epsilon_value, epsilon_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * common.aggregate_loss(torch.max(unclipped, clipped), mask, loss_agg)
    with torch.no_grad():
        stats = {"clip_frac": common.masked_mean((clipped > unclipped).float(), mask)}
    return loss, stats
    # END SOLUTION


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over the valid tokens: 1 = the critic predicts the returns,
    0 = no better than their mean, < 0 = worse than the mean."""
    def var(x):
        return common.masked_mean((x - common.masked_mean(x, mask)) ** 2, mask)
    return 1 - var(returns - values) / var(returns).clamp(min=1e-8)


class ValueModel(torch.nn.Module):
    """The critic: a sequence-classification model with one label (the policy's backbone plus a
    scalar head `score`, as reward models are stored), applied at every position.
    From a causal-LM checkpoint the backbone is loaded and the head newly initialised.
    In --torch_dtype. Given a LoRA config (the policy's --lora_r) only the adapter and the head
    train: the backbone stays a frozen copy, without gradients or AdamW state."""

    def __init__(self, path, torch_dtype="float32", gradient_checkpointing=False, lora=None):
        super().__init__()
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1,
                                                                        dtype=config.DTYPES[torch_dtype])
        models.disable_dropout(self.model)
        if gradient_checkpointing:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            self.model = models.add_lora(self.model, lora)  # the adapter's layers go into the model in place
        self.train()  # dropout is off; train mode only lets gradient checkpointing act

    def forward(self, input_ids, attention_mask, num_completion_tokens):
        """(B, C) values V_t of the prefix before each of the last C tokens (the state in which
        token t is chosen: the same positions whose logits give logp_t), in fp32."""
        c = num_completion_tokens
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # under LoRA
        position_ids = common.position_ids_from_mask(attention_mask)
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False).last_hidden_state
        return model.score(hidden[:, -(c + 1):-1]).squeeze(-1).float()


class AdaptiveKLController:
    """Ziegler et al. (2019), section 2.2: move beta so that the KL per sequence tracks a target,
    beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon) after n samples."""

    def __init__(self, beta, target, horizon):
        self.value, self.target, self.horizon = beta, target, horizon

    def update(self, kl, n):
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n / self.horizon

    def state_dict(self):  # saved in resumable checkpoints (accelerator.register_for_checkpointing)
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


# the critic's own panels, next to run.PLOT_KEYS in curves.png
CRITIC_PLOT_KEYS = ("train/value_loss", "train/explained_variance", "train/value_clip_frac",
                    "train/clip_frac_high", "train/approx_kl", "train/beta")


def main():
    cfg = config.parse_config(Config)
    # ---- setup: accelerator, data, policy, critic, reference (PLUMBING: skip on a first read) ----
    accelerator = config.make_accelerator(cfg)
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
    sampler = tasks.PromptSampler(train_data, cfg.batch_size, cfg.seed, accelerator.process_index,
                                  accelerator.num_processes)
    trainer = engine.Trainer(cfg, accelerator, tokenizer, sampler, eval_data, policy, rollout_model, others=[critic])
    if trainer.resume() == 0:  # --resume_from: the checkpoint's step, else 0
        trainer.evaluate(step=0)  # held-out accuracy before training

    for step in trainer.steps():
        # ---- rollout: one sampled response per prompt ----
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

        # ---- advantages: per-token reward, GAE (the critic is the baseline), whitened ----
        with trainer.timer("gae"):
            kl = common.kl_k1(old_logp, ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
            last = last_action(mask)  # the EOS, or the last token when cut at max length: the reward's place
            token_rewards = -kl_ctl.value * kl
            token_rewards[torch.arange(len(rollout)), last] += rewards
            lam = length_adaptive_lam(mask.sum(1), cfg.lam_alpha) if cfg.lam_alpha > 0 else cfg.lam
            lam_critic = cfg.lam if cfg.lam_critic is None else cfg.lam_critic
            adv, returns = decoupled_gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam_policy=lam,
                                         lam_critic=lam_critic)
            # whitened over the global batch: every process's tokens (completions padded to one length)
            all_adv, all_mask = (accelerator.gather(accelerator.pad_across_processes(x, dim=1)) for x in (adv, mask))
            adv = common.masked_whiten(all_adv, all_mask).chunk(accelerator.num_processes)[accelerator.process_index]
            adv = adv[:, :T]

        # ---- update: num_epochs passes over num_mini_batches minibatches, one optimizer step of each model per
        # minibatch, its gradient summed over its micro-batches; the loss: the clipped policy loss plus vf_coef
        # times the clipped value loss ----
        updates = []
        for epoch in range(cfg.num_epochs):
            for rows in torch.randperm(cfg.batch_size, device=accelerator.device).chunk(cfg.num_mini_batches):
                for mb in trainer.micro_batches(rollout, common.Aggregation("token-mean"), rows):
                    logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient; mb.mask: the actions
                    pg_weight, correction, per_row = None, {}, {}
                    if rollout_logp is not None:  # a stale sampler: pi_old is the proximal policy, mu the sampler
                        pg_weight, correction, per_row = common.rollout_correction(
                            logp, mb.of(old_logp), mb.of(rollout_logp), mb.of(adv), mb.mask, cfg.tis_cap, 0.0,
                            cfg.tis_level, cfg.tis_veto, cfg.m2po_tau)
                    pg_loss, pg_stats = ppo_policy_loss(logp, mb.of(old_logp), mb.of(adv), mb.mask, cfg.epsilon,
                                                        cfg.dual_clip_c, mb.agg, pg_weight)
                    values = critic.model(mb.of(input_ids), mb.of(attention_mask), T)  # (b, T), with gradient
                    vf_loss, vf_stats = ppo_value_loss(values, mb.of(old_values), mb.of(returns), mb.mask,
                                                       cfg.epsilon_value, mb.agg)
                    trainer.backward(pg_loss + cfg.vf_coef * vf_loss, mb, {
                        "policy_loss": common.Sums((pg_loss.detach(),), float),  # the micro-batches' parts add up
                        "value_loss": common.Sums((vf_loss.detach(),), float), "value_clip_frac": vf_stats["clip_frac"],
                        **pg_stats, **correction,
                        "entropy": common.masked_mean(entropy, mb.mask)}, per_row)
                updates.append(trainer.step(policy, critic))  # clip each, check finite, both optimizers step
        stats = {key: torch.stack([torch.as_tensor(u[key]) for u in updates]).mean() for key in updates[0]}

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
    main()
