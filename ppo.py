"""PPO with a learned value model (Schulman et al., 2017, https://arxiv.org/abs/1707.06347; for
LLMs:
Ouyang et al., 2022, and Huang et al., "The N+ implementation details of RLHF with PPO", 2024).

Each sampled completion is an episode whose actions are its tokens. The reward is r_t = -beta *
(logp_t - ref_logp_t) on every token plus the task reward R(x, y) on the last one. A critic V (the
policy's backbone with a scalar head instead of the LM head) predicts the return from every prefix,
and GAE turns rewards and values into per-token advantages:

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   V_{T+1} = 0.

The batch is then reused for --num_epochs passes over --num_mini_batches minibatches, which is why
the ratio rho = pi_theta / pi_old and its clip are needed. What this costs against remax.py: a
second trainable model (its gradients and Adam state) and its forward/backward passes in every
update; what it buys: a per-token, per-prefix baseline instead of one greedy reward per prompt, and
several updates per batch of samples.

    accelerate launch ppo.py                                     # embedded model and task
    accelerate launch --multi_gpu --num_processes 2 ppo.py       # data-parallel (gloo on CPU)
    python ppo.py --adaptive_kl True --kl_target 1.0             # Ziegler et al.'s KL control

Between the BEGIN SOLUTION and END SOLUTION comments: a classroom exercise's code, which a student
copy replaces with # HINT: lines (docs/classroom.md).
"""
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from transformers import AutoModelForSequenceClassification

import common
from support import helpers
from support.models import token_logprobs  # common.token_logprobs, faster; equal (tests/test_fast.py)
from support.helpers import arg


@dataclass
class Config(helpers.TrainConfig):
    # 150 batches of num_epochs x num_mini_batches = 16 optimizer steps each (docs/ppo.md)
    num_steps: int = arg(150, "Rollout batches (each num_epochs x num_mini_batches steps).")
    learning_rate: float = arg(3e-5, "Policy learning rate (AdamW); papers use 1e-6..3e-6 at 7B.")
    critic_learning_rate: float = arg(1e-4, "Critic learning rate (AdamW); papers use ~1e-5 at 7B.")
    beta: float = arg(0.05, "Coefficient of the per-token k1 penalty in the reward.")
    adaptive_kl: bool = arg(False, "Adapt beta towards --kl_target (Ziegler et al., 2019).")
    kl_target: float = arg(1.0, "Target KL per sequence (nats) for --adaptive_kl.")
    kl_horizon: int = arg(10000, "Horizon of the adaptive KL controller, in samples.")
    gamma: float = arg(1.0, "Discount factor of GAE.")
    lam: float = arg(0.95, "GAE lambda: 1 = Monte Carlo returns, 0 = one-step TD (biased by V).")
    num_epochs: int = arg(4, "K: passes over each rollout batch.")
    num_mini_batches: int = arg(4, "Minibatches per pass (one optimizer step each).")
    epsilon: float = arg(0.2, "Clip the ratio pi_theta / pi_old to [1 - epsilon, 1 + epsilon].")
    epsilon_value: float = arg(0.2, "Clip the new value to V_old +- epsilon_value.")
    vf_coef: float = arg(0.1, "Weight of the value loss (it scales the critic's gradient).")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_rules(self, beta=helpers.NON_NEGATIVE, gamma=helpers.PROBABILITY,
                            lam=helpers.PROBABILITY, epsilon=helpers.FRACTION,
                            num_epochs=helpers.AT_LEAST_ONE)
        helpers.check_rules(self, **{name: helpers.POSITIVE for name in (
            "critic_learning_rate", "num_mini_batches", "epsilon_value", "vf_coef", "kl_target",
            "kl_horizon")})
        helpers.check(not self.adaptive_kl or self.beta > 0, "--adaptive_kl needs --beta > 0.")
        helpers.check(self.batch_size % self.num_mini_batches == 0, f"--num_mini_batches "
                      f"({self.num_mini_batches}) must divide --batch_size ({self.batch_size}).")
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
        helpers.check(not deepspeed, "ppo.py trains two models and accelerate's DeepSpeed integration prepares "
                      "one per Accelerator: launch it with DDP.")
        self.clip = common.Clip(self.epsilon, self.epsilon)


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al., 2016), per token. (B, T) in, out.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t, with
    V_{T+1} = 0 after the last valid token. `mask` is 1 on the tokens that are actions: a
    completion's prefix, or an episode's model tokens (agents.py), where t + 1 is the next action,
    the environment's tokens between them skipped. Positions where it is 0 contribute nothing and
    get A = R = 0. lam is a number or a (B,) tensor, one lambda per sequence. Returns (advantages,
    returns).
    """
    # BEGIN SOLUTION
    acts = mask.bool()
    rewards = torch.where(acts, rewards, torch.zeros_like(rewards))
    values = torch.where(acts, values, torch.zeros_like(values))
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):  # a position that is no action leaves it as it is
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = torch.where(acts[:, t], delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(acts[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
    advantages = torch.where(acts, advantages, torch.zeros_like(advantages))
    returns = advantages + values
    return advantages, returns
    # END SOLUTION


def last_action(mask):
    """(B,) the position of each row's last 1 in the (B, T) mask: its last action (0 when it has
    none)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask.bool(), positions, 0).max(dim=1).values


def ppo_policy_loss(logp, old_logp, adv, mask, clip, loss_agg="token-mean"):
    """Clipped surrogate (Schulman et al., 2017, eq. 7), token-mean over the minibatch (loss_agg:
    token-mean, or the micro-batch's common.Aggregation of it).

    logp: (B, T) with grad; old_logp, adv: (B, T) from rollout time. Per token -min(rho A, clip(rho,
    1 - low, 1 + high) A), rho = exp(logp - old_logp) (common.clipped_surrogate): once the ratio has
    moved past the clip in the direction A favours, the gradient is zero. clip: a common.Clip
    (low = high = epsilon; the lab's clip-higher: DAPO, VAPO). Returns (loss, stats):
    common.clip_stats, clip_frac_low / clip_frac_high, the fraction of tokens clipped below (rho <
    1 - low with A < 0) and above (rho > 1 + high with A > 0); approx_kl, the k3 estimate of
    KL(pi_old || pi_theta) from the ratio.
    """
    clip = common.Clip(*clip)  # a Clip, or its fields as a plain tuple
    # the padding may hold anything (NaN, a gap past exp's range): there the detached inputs take
    # logp's value, so the gradient at a padded position is 0, not 0 * inf = NaN from exp's backward
    old_logp = torch.where(mask.bool(), old_logp, logp.detach())
    adv = torch.where(mask.bool(), adv, 0.0)  # and the advantage 0: 0 * NaN would be NaN
    # BEGIN SOLUTION
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    surrogate = common.clipped_surrogate(ratio, adv, clip)  # min(rho A, clip(rho) A)
    loss = common.aggregate_loss(-surrogate, mask, loss_agg)
    return loss, common.clip_stats(ratio, log_ratio, adv, mask, clip)
    # END SOLUTION


def ppo_value_loss(values, old_values, returns, mask, epsilon_value, loss_agg="token-mean"):
    """Clipped value loss, token-mean (loss_agg: token-mean, or the micro-batch's common.Aggregation
    of
    it): 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    values: (B, T) with grad; old_values, returns: (B, T) from rollout time. Like the policy clip,
    it keeps the critic near the one that produced the advantages. Returns (loss, stats) with stats:
    clip_frac (fraction of tokens where the clip binds and the clipped term wins).
    """
    # the padding may hold anything: there the detached inputs take the value's, so its gradient is 0
    old_values, returns = (torch.where(mask.bool(), x, values.detach()) for x in (old_values, returns))
    # BEGIN SOLUTION
    values_clipped = old_values + torch.clamp(values - old_values, -epsilon_value, epsilon_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * common.aggregate_loss(torch.max(unclipped, clipped), mask, loss_agg)
    with torch.no_grad():
        binds = (values - old_values).abs() > epsilon_value  # elsewhere the two differ by rounding alone
        stats = {"clip_frac": common.masked_mean(((clipped > unclipped) & binds).float(), mask)}
    return loss, stats
    # END SOLUTION


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over the valid tokens: 1 = the critic predicts the returns, 0 = no
    better than their mean, < 0 = worse than the mean."""
    def var(x):
        return common.masked_mean((x - common.masked_mean(x, mask)) ** 2, mask)
    return 1 - var(returns - values) / var(returns).clamp(min=1e-8)


class ValueModel(torch.nn.Module):
    """The critic: a sequence-classification model with one label (the policy's backbone plus a
    scalar
    head `score`, as reward models are stored), applied at every position. From a causal-LM
    checkpoint the backbone is loaded and the head newly initialised. In --torch_dtype. Given a LoRA
    config (the policy's --lora_r) only the adapter and the head train: the backbone stays a frozen
    copy, without gradients or AdamW state."""

    def __init__(self, path, torch_dtype="float32", gradient_checkpointing=False, lora=None):
        super().__init__()
        self.model, loaded = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=getattr(torch, torch_dtype), output_loading_info=True)
        if "score.weight" in loaded["missing_keys"]:  # what the load report above calls MISSING
            helpers.config.say("note: the critic's value head `score` is new, initialised at random: the load "
                               "report's MISSING score.weight is expected (docs/ppo.md)")
        helpers.models.disable_dropout(self.model)
        if gradient_checkpointing:
            self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            self.model = helpers.models.add_lora(self.model, lora)  # the adapter goes in, in place
        self.train()  # dropout is off; train mode only lets gradient checkpointing act

    def forward(self, input_ids, attention_mask, num_completion_tokens):
        """(B, C) values V_t of the prefix before each of the last C tokens (the state in which
        token t
        is chosen: the same positions whose logits give logp_t), in fp32."""
        c = num_completion_tokens
        model = self.model  # under LoRA, the model inside the adapter's wrapper:
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        position_ids = common.position_ids_from_mask(attention_mask)
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, use_cache=False).last_hidden_state
        return model.score(hidden[:, -(c + 1):-1]).squeeze(-1).float()


def load_critic(value_model, cfg, accelerator):
    """(critic, its optimizer): the value model and its AdamW at --critic_learning_rate, prepared."""
    optimizer, scheduler = helpers.models.make_optimizer(value_model, cfg, cfg.critic_learning_rate)
    critic, optimizer, scheduler = accelerator.prepare(value_model, optimizer, scheduler)
    return critic, optimizer


@torch.no_grad()
def critic_values(critic, rollout, cfg):
    """(B, T) values of the critic before each completion token, --micro_batch_size rows at a time."""
    return helpers.scoring_pass(rollout, cfg.micro_batch_size,
                                lambda ids, mask: critic(ids, mask, rollout.mask.shape[1])).clone()


def save_critic(cfg, accelerator, critic, tokenizer):
    """The critic (under LoRA merged: a whole critic), saved with save_pretrained in output_dir/final/critic."""
    helpers.models.save_model(accelerator, accelerator.unwrap_model(critic).model, tokenizer,
                              f"{cfg.output_dir}/final/critic", merge_lora=True)


class AdaptiveKLController:
    """Ziegler et al. (2019), section 2.2: move beta so that the KL per sequence tracks a target,
    beta
    <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon) after n samples."""

    def __init__(self, beta, target, horizon):
        self.value, self.target, self.horizon = beta, target, horizon

    def update(self, kl, n):
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n / self.horizon

    def state_dict(self):  # saved in resumable checkpoints (accelerator.register_for_checkpointing)
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def main():
    cfg = helpers.parse_config(Config)
    # ---- setup: accelerator, data, policy, critic, reference (PLUMBING: skip at first) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = helpers.load_data(cfg, accelerator)
    reward_fn = helpers.make_reward_fn(cfg, accelerator)
    set_seed(cfg.seed)  # the same initial weights on every rank (a LoRA adapter, the value head)
    policy, ref_model, optimizer = helpers.load_models(cfg, accelerator, reference=cfg.beta > 0)
    lora = helpers.models.lora_config(cfg, "SEQ_CLS") if cfg.lora_r > 0 else None
    value_model = ValueModel(cfg.model_name_or_path, lora=lora)  # the policy's backbone, a new head
    critic, critic_optimizer = load_critic(value_model, cfg, accelerator)
    kl_ctl = AdaptiveKLController(cfg.beta, cfg.kl_target, cfg.kl_horizon)
    accelerator.register_for_checkpointing(kl_ctl)
    prompts = helpers.prompt_sampler(train_data, cfg.batch_size, cfg, accelerator)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    start = helpers.resume(cfg, accelerator, prompts)  # --resume_from: its step, else 0
    logger = helpers.open_log(cfg, accelerator, start)
    if start == 0:  # held-out accuracy before training
        logger.log(0, helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    for step in helpers.steps(cfg, start, accelerator):
        started = time.time()
        # ---- rollout: one sampled response per prompt ----
        rollout = helpers.sample(policy, tokenizer, prompts.next(), cfg, accelerator)
        mask, B, T = rollout.mask, *rollout.mask.shape  # (B, T): 1 on each completion's tokens

        # ---- reward, and pi_old, V_old and pi_ref at rollout time, for every update below ----
        rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions)  # (B,)
        old_logp = helpers.score(policy, rollout, cfg)
        old_values = critic_values(critic, rollout, cfg)  # (B, T)
        ref_logp = helpers.score(ref_model, rollout, cfg, truncated=False) if cfg.beta > 0 else None

        # ---- advantages: per-token reward, GAE (the critic is the baseline), whitened ----
        kl = torch.zeros_like(old_logp) if ref_logp is None else common.kl_k1(old_logp, ref_logp)
        token_rewards = -kl_ctl.value * kl
        token_rewards[torch.arange(B), last_action(mask)] += rewards  # on the EOS or the last token
        adv, returns = gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
        # whitened over the global batch: every process's tokens (completions padded to one length)
        all_adv, all_mask = (accelerator.gather(accelerator.pad_across_processes(x, dim=1))
                             for x in (adv, mask))
        adv = common.masked_whiten(all_adv, all_mask)
        adv = adv.chunk(accelerator.num_processes)[accelerator.process_index][:, :T]

        # ---- update: num_epochs passes over num_mini_batches minibatches, one optimizer step of
        # each model per minibatch, summing its micro-batches' gradients; the loss: the clipped
        # policy loss plus vf_coef times the clipped value loss ----
        agg = common.Aggregation("token-mean")  # how the loss reduces its tokens, said once
        updates = []
        for epoch in range(cfg.num_epochs):
            order = torch.randperm(B, device=accelerator.device)
            for minibatch in order.chunk(cfg.num_mini_batches):
                num_tokens = accelerator.reduce(mask[minibatch].sum().float(), "mean")  # as DDP
                size = cfg.micro_batch_size or len(minibatch)  # rows of a forward/backward pass
                batches = [slice(i, i + size) for i in range(0, len(minibatch), size)]
                update_loss, update_stats = 0.0, []
                for part in batches:
                    rows = minibatch[part]
                    logp, entropy = token_logprobs(  # (b, T), with gradient
                        policy, rollout.input_ids[rows], rollout.attention_mask[rows], T, cfg.temperature,
                        with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                    # its part of the minibatch's loss: the weighted losses sum to the minibatch's
                    weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, len(minibatch))
                    mb_agg = agg._replace(weight=weight)
                    pg_loss, pg_stats = ppo_policy_loss(logp, old_logp[rows], adv[rows], mask[rows],
                                                        cfg.clip, mb_agg)
                    values = critic(rollout.input_ids[rows], rollout.attention_mask[rows], T)
                    vf_loss, vf_stats = ppo_value_loss(values, old_values[rows], returns[rows], mask[rows],
                                                       cfg.epsilon_value, mb_agg)
                    loss = pg_loss + cfg.vf_coef * vf_loss
                    last = part == batches[-1]  # DDP averages the gradients after the last one only
                    accelerator.sync_gradients = last
                    with nullcontext() if last else accelerator.no_sync(policy), \
                            nullcontext() if last else accelerator.no_sync(critic):
                        accelerator.backward(loss)
                    update_loss += loss.detach()
                    entropy = common.masked_mean(entropy, mask[rows])
                    share = mask[rows].sum() / mask[minibatch].sum().clamp(min=1)  # stats' weight
                    update_stats.append((share, {
                        "policy_loss": common.Sums((pg_loss.detach(),), float),  # the parts add up
                        "value_loss": common.Sums((vf_loss.detach(),), float),
                        "value_clip_frac": vf_stats["clip_frac"], **pg_stats, "entropy": entropy}))
                max_norm = cfg.max_grad_norm or float("inf")
                grad_norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm)
                critic_grad_norm = accelerator.clip_grad_norm_(critic.parameters(), max_norm)
                norms = torch.stack([grad_norm, critic_grad_norm])
                helpers.check_finite(accelerator, update_loss, norms, step)
                optimizer.step()
                critic_optimizer.step()
                optimizer.zero_grad()
                critic_optimizer.zero_grad()
                updates.append({"loss": update_loss, "grad_norm": grad_norm,
                                "critic_grad_norm": critic_grad_norm, **helpers.combine(update_stats)})
        stats = {key: torch.stack([torch.as_tensor(u[key]) for u in updates]).mean()
                 for key in updates[0]}

        # ---- log, evaluate, checkpoint (PLUMBING: docs/metrics.md says what each one means) ----
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/value_mean": common.masked_mean(old_values, mask),
            "train/return_mean": common.masked_mean(returns, mask),
            "train/explained_variance": explained_variance(old_values, returns, mask),
            "train/kl_seq": common.masked_sum(kl, mask) / B,
            "train/beta": kl_ctl.value,
            **{f"train/{key}": value for key, value in stats.items()},  # means over the updates
            **reward_stats,
        }
        if cfg.adaptive_kl:  # Ziegler et al.'s controller, on the KL averaged over every process
            kl_mean = accelerator.reduce(metrics["train/kl_seq"].float(), "mean").item()
            kl_ctl.update(kl_mean, B * accelerator.num_processes)
        due = step % cfg.eval_every == 0 or step == cfg.num_steps
        evaluation = helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator) if due else {}
        helpers.log_step(logger, step, metrics, rollout, rewards, started, evaluation)
        helpers.save_checkpoint(cfg, accelerator, step, policy, tokenizer, prompts)

    save_critic(cfg, accelerator, critic, tokenizer)  # beside the policy, in final/critic
    helpers.finish(cfg, accelerator, logger, policy, tokenizer, prompts)


if __name__ == "__main__":
    helpers.launch(main)  # one thread per process, the process group closed at the end
