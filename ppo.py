"""PPO with a learned value model (Schulman et al., 2017, https://arxiv.org/abs/1707.06347;
for LLMs: Ouyang et al., 2022, and Huang et al., "The N+ implementation details of RLHF
with PPO", 2024).

Each sampled completion is an episode whose actions are its tokens. The reward is
r_t = -kl_coef * (logp_t - ref_logp_t) on every token plus the task reward R(x, y) on the
last one. A critic V (the policy's backbone with a scalar head instead of the LM head)
predicts the return from every prefix, and GAE turns rewards and values into per-token
advantages:

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   V_{T+1} = 0.

The batch is then reused for --ppo_epochs passes over --num_mini_batches minibatches, which
is why the ratio rho = pi_theta / pi_old and its clip are needed. What this costs against
remax.py: a second trainable model (its gradients and Adam state) and its forward/backward
passes in every update; what it buys: a per-token, per-prefix baseline instead of one
greedy reward per prompt, and several updates per batch of samples.

    accelerate launch ppo.py                                     # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 ppo.py       # data-parallel (gloo on CPU)
    python ppo.py --adaptive_kl True --kl_target 1.0             # Ziegler et al. KL control
"""
from dataclasses import dataclass, field

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, get_constant_schedule_with_warmup

import common


@dataclass
class Config(common.TrainConfig):
    num_steps: int = field(default=150, metadata={"help": "Rollout batches (each gives ppo_epochs x num_mini_batches optimizer steps). 150 fit in 5 minutes on 2 CPU cores with the embedded model."})
    learning_rate: float = field(default=3e-5, metadata={"help": "Policy learning rate (AdamW). Below the common 1e-4 because each batch gives ppo_epochs x num_mini_batches = 16 steps (tuned on the embedded model); papers use 1e-6..3e-6 for 7B models."})
    critic_learning_rate: float = field(default=1e-4, metadata={"help": "Critic learning rate (AdamW). Tiny model default (1e-3 made the critic overshoot: lower explained variance); papers use ~1e-5 for 7B models."})
    reward_model_path: str = field(default="", metadata={"help": "Initialise the critic from this sequence-classification checkpoint with the policy's tokenizer (a reward model, or output_dir/final/critic of an earlier run); default: the policy's backbone with a new value head. (--reward_model scores; this only initialises the critic.)"})
    kl_coef: float = field(default=0.05, metadata={"help": "Coefficient of the per-token k1 penalty in the reward (initial value if --adaptive_kl)."})
    adaptive_kl: bool = field(default=False, metadata={"help": "Adapt kl_coef towards --kl_target (Ziegler et al., 2019)."})
    kl_target: float = field(default=1.0, metadata={"help": "Target KL per sequence (nats) for --adaptive_kl (Ziegler et al.: 6 for 24-token completions)."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller, in samples (Ziegler et al.: 10000)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda: 1 = Monte Carlo returns (high variance), 0 = one-step TD (biased by V)."})
    ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    num_mini_batches: int = field(default=4, metadata={"help": "Minibatches per pass (one optimizer step each); must divide --batch_size."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip the ratio pi/pi_old to [1 - c, 1 + c] in the policy loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip the new value to V_old +- c in the value loss."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss. Policy and critic are separate models, so it only scales the critic's gradient (before clipping)."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("critic_learning_rate", "ppo_epochs", "num_mini_batches", "cliprange", "cliprange_value", "vf_coef", "kl_target", "kl_horizon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name} must be > 0 (got {getattr(self, name)}).")
        if self.kl_coef < 0:
            raise ValueError(f"--kl_coef must be >= 0 (got {self.kl_coef}).")
        if self.adaptive_kl and self.kl_coef == 0:
            raise ValueError("--adaptive_kl needs --kl_coef > 0 (it scales kl_coef multiplicatively).")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"--gamma must be in [0, 1] (got {self.gamma}).")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"--lam must be in [0, 1] (got {self.lam}).")
        if self.batch_size % self.num_mini_batches != 0:
            raise ValueError(f"--num_mini_batches ({self.num_mini_batches}) must divide --batch_size ({self.batch_size}).")


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., 2016), per token. (B, T) in, out.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t,
    with V_{T+1} = 0 after the last valid token. `mask` is a completion mask (1 on a prefix
    of each row): positions where it is 0 contribute nothing and get A = R = 0.
    Returns (advantages, returns).
    """
    # BEGIN SOLUTION
    rewards = torch.where(mask.bool(), rewards, torch.zeros_like(rewards))
    values = torch.where(mask.bool(), values, torch.zeros_like(values))
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[:, t]
        advantages[:, t] = next_adv
    advantages = torch.where(mask.bool(), advantages, torch.zeros_like(advantages))
    returns = advantages + values
    return advantages, returns
    # END SOLUTION


def ppo_policy_loss(logp, old_logp, adv, mask, cliprange):
    """Clipped surrogate (Schulman et al., 2017, eq. 7), token-mean over the minibatch.

    logp: (B, T) with grad; old_logp, adv: (B, T) from rollout time. Per token
    -min(rho A, clip(rho, 1 - c, 1 + c) A), rho = exp(logp - old_logp): once the ratio has
    moved past the clip in the direction A favours, the gradient is zero.
    Returns (loss, stats) with stats: clipfrac (fraction of tokens where the clip is active)
    and approx_kl (k3 estimate of KL(pi_old || pi_theta) from the ratio).
    """
    # BEGIN SOLUTION
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    loss = common.masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": common.masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": common.masked_mean(common.kl_k3(old_logp, logp), mask),
        }
    return loss, stats
    # END SOLUTION


def ppo_value_loss(values, old_values, returns, mask, cliprange_value):
    """Clipped value loss, token-mean: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    values: (B, T) with grad; old_values, returns: (B, T) from rollout time. Like the policy
    clip, it keeps the critic near the one that produced the advantages.
    Returns (loss, stats) with stats: clipfrac (fraction of tokens where the clipped term wins).
    """
    # BEGIN SOLUTION
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * common.masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"clipfrac": common.masked_mean((clipped > unclipped).float(), mask)}
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
    Always trained in full (also when the policy uses --lora_r), in --torch_dtype."""

    def __init__(self, path, torch_dtype="float32", gradient_checkpointing=False):
        super().__init__()
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=common.DTYPES[torch_dtype])
        common.disable_dropout(self.model)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.train()  # dropout is off; train mode only lets gradient checkpointing act

    def forward(self, input_ids, attention_mask, num_completion_tokens):
        """(B, C) values V_t of the prefix before each of the last C tokens (the state in which
        token t is chosen: the same positions whose logits give logp_t), in fp32."""
        c = num_completion_tokens
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=common.position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        return self.model.score(hidden[:, -(c + 1):-1]).squeeze(-1).float()


class AdaptiveKLController:
    """Ziegler et al. (2019), section 2.2: move kl_coef so that the KL per sequence tracks a target,
    kl_coef <- kl_coef * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon) after n samples."""

    def __init__(self, kl_coef, target, horizon):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, kl, n):
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n / self.horizon

    def state_dict(self):  # saved in resumable checkpoints (accelerator.register_for_checkpointing)
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


# the critic's own panels, next to common.PLOT_KEYS in curves.png
CRITIC_PLOT_KEYS = ("train/value_loss", "train/explained_variance", "train/value_clipfrac",
                    "train/policy_clipfrac", "train/approx_kl", "train/kl_coef")


def main():
    cfg = common.parse_config(Config)
    # ---- setup: accelerator, seed, policy, critic, reference, data ----
    accelerator = common.make_accelerator(cfg)
    if accelerator.state.deepspeed_plugin is not None:
        raise SystemExit("error: ppo.py trains two models (policy and critic) and accelerate's DeepSpeed integration "
                         "prepares one model per Accelerator: launch it with DDP (e.g. configs/ddp_8gpu.yaml).")
    set_seed(cfg.seed)  # identical initial weights on every rank
    tokenizer = common.load_tokenizer(cfg)
    train_data, eval_data = common.load_task(cfg, tokenizer)  # data errors surface before models load
    reward_fn = common.make_reward_fn(cfg, accelerator.device)
    policy = common.load_model(cfg)
    if cfg.reward_model_path:
        common.check_model_path(cfg.reward_model_path, flag="--reward_model_path")
    critic = ValueModel(cfg.reward_model_path or cfg.model_name_or_path, cfg.torch_dtype, cfg.gradient_checkpointing)
    ref_model = common.load_reference(cfg, policy) if cfg.kl_coef > 0 else None
    optimizer, scheduler = common.make_optimizer(policy, cfg)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_learning_rate, weight_decay=0.0)
    critic_scheduler = get_constant_schedule_with_warmup(critic_optimizer, cfg.warmup_steps)
    policy, critic, optimizer, critic_optimizer, scheduler, critic_scheduler = accelerator.prepare(
        policy, critic, optimizer, critic_optimizer, scheduler, critic_scheduler)
    if ref_model is not None:
        ref_model = ref_model.to(accelerator.device)
    kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    accelerator.register_for_checkpointing(kl_ctl)
    sampler = common.PromptSampler(train_data, cfg.batch_size, cfg.seed, accelerator.process_index, accelerator.num_processes)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    ckpt = common.Checkpointer(cfg, accelerator, sampler)
    start_step = ckpt.resume()
    logger = common.MetricLogger(cfg, accelerator, start_step)
    if start_step == 0:
        logger.log(0, common.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    timer = common.StepTimer()
    for step in tqdm(range(start_step + 1, cfg.num_steps + 1), disable=not accelerator.is_main_process, desc="ppo"):
        # ---- rollout: one sampled response per prompt ----
        batch = sampler.next()
        prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, [ex["prompt"] for ex in batch], accelerator.device)
        with timer("generation"):
            unwrapped = accelerator.unwrap_model(policy)
            completion_ids = common.generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg)
        with timer("scoring"):
            mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
            completions = common.decode_completions(tokenizer, completion_ids, mask)
            rewards, correct = reward_fn(batch, completions)
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, mask], dim=1)
            T = completion_ids.shape[1]
            with torch.no_grad():
                # log-probs and values at rollout time: pi_old and V_old for every update below
                old_logp, entropy = common.token_logprobs(policy, input_ids, attention_mask, T, cfg.temperature, with_entropy=True)
                old_values = critic(input_ids, attention_mask, T)
                if ref_model is not None:
                    ref_logp = common.token_logprobs(ref_model, input_ids, attention_mask, T, cfg.temperature)

        with timer("forward_backward"):
            # ---- per-token reward, GAE advantage (the critic is the baseline) ----
            kl = common.kl_k1(old_logp, ref_logp) if ref_model is not None else torch.zeros_like(old_logp)
            last = mask.sum(1) - 1  # index of the EOS, or of the last token when cut at max length
            token_rewards = -kl_ctl.value * kl
            token_rewards[torch.arange(len(batch)), last] += rewards
            adv, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
            adv = common.masked_whiten(adv, mask)

        # ---- ppo_epochs passes over num_mini_batches minibatches ----
        updates = []
        mb_size = cfg.batch_size // cfg.num_mini_batches
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(cfg.batch_size, device=accelerator.device).split(mb_size):
                with timer("forward_backward"):
                    logp = common.token_logprobs(policy, input_ids[idx], attention_mask[idx], T, cfg.temperature)
                    pg_loss, pg_stats = ppo_policy_loss(logp, old_logp[idx], adv[idx], mask[idx], cfg.cliprange)
                    values = critic(input_ids[idx], attention_mask[idx], T)
                    vf_loss, vf_stats = ppo_value_loss(values, old_values[idx], returns[idx], mask[idx], cfg.cliprange_value)
                    loss = pg_loss + cfg.vf_coef * vf_loss
                    accelerator.backward(loss)
                with timer("optimizer"):
                    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
                    grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
                    critic_grad_norm = accelerator.clip_grad_norm_(critic.parameters(), max_norm)
                    # a NaN stops here; earlier minibatches of this step are already in the saved weights
                    ckpt.check_finite(step, loss, torch.stack([grad_norm, critic_grad_norm]), policy, tokenizer)
                    optimizer.step()
                    critic_optimizer.step()
                    optimizer.zero_grad()
                    critic_optimizer.zero_grad()
                updates.append(torch.stack([loss.detach(), pg_loss.detach(), vf_loss.detach(), pg_stats["clipfrac"], pg_stats["approx_kl"],
                                            vf_stats["clipfrac"], grad_norm, critic_grad_norm]))
        scheduler.step()  # once per rollout batch, so --warmup_steps counts steps as in every script
        critic_scheduler.step()
        loss, pg_loss, vf_loss, policy_clipfrac, approx_kl, value_clipfrac, grad_norm, critic_grad_norm = torch.stack(updates).mean(0)

        # ---- log ----
        lengths = mask.sum(1).float()
        seq_kl = common.masked_sum(kl, mask) / len(batch)
        metrics = {
            "train/reward": rewards.mean(), "train/reward_std": rewards.std(), "train/correct": correct.mean(),
            "train/generated": len(completion_ids),
            "train/value_mean": common.masked_mean(old_values, mask), "train/return_mean": common.masked_mean(returns, mask),
            "train/kl": seq_kl, "train/kl_coef": kl_ctl.value, "train/entropy": common.masked_mean(entropy, mask),
            "train/loss": loss, "train/policy_loss": pg_loss, "train/value_loss": vf_loss,
            "train/policy_clipfrac": policy_clipfrac, "train/approx_kl": approx_kl, "train/value_clipfrac": value_clipfrac,
            "train/explained_variance": explained_variance(old_values, returns, mask), "train/grad_norm": grad_norm, "train/critic_grad_norm": critic_grad_norm,
            "train/completion_len": lengths.mean(),
            **timer.metrics(),
        }
        metrics["time/tokens_per_s"] = lengths.sum() / metrics["time/step_s"]
        metrics = common.reduce_metrics(accelerator, metrics)
        if cfg.adaptive_kl:
            kl_ctl.update(metrics["train/kl"], cfg.batch_size * accelerator.num_processes)
        if step % cfg.eval_every == 0 or step == cfg.num_steps:
            metrics.update(common.evaluate(policy, tokenizer, eval_data, cfg, accelerator))
        logger.log(step, metrics)
        if ckpt.step_end(step, policy, tokenizer):
            break

    # ---- end: save, plot ----
    logger.finish(policy)
    if accelerator.is_main_process:
        common.plot_metrics(logger.path, f"{cfg.output_dir}/critic_curves.png", CRITIC_PLOT_KEYS)
    if cfg.save_model:
        common.save_model(accelerator, policy, tokenizer, f"{cfg.output_dir}/final", cfg.merge_lora)
        common.save_model(accelerator, accelerator.unwrap_model(critic).model, tokenizer, f"{cfg.output_dir}/final/critic")


if __name__ == "__main__":
    main()
