"""On-policy distillation (Thinking Machines, 2025; Qwen3's strong-to-weak distillation; GKD,
Agarwal et al., 2024, with beta = 1): the student samples, a frozen teacher scores each drawn token.

For each prompt x the student pi_s samples G responses y_1..y_G; the teacher pi_T (the same
tokenizer) scores each drawn token, and the student minimises the reverse KL to it on its own
samples, E_{y ~ pi_s} sum_t KL(pi_s(.|s_t) || pi_T(.|s_t)), student first: mode-seeking, it learns
where the teacher puts its mass on the states it visits itself. A dense reward, no verifier:

    A_t = -lambda (log pi_s(y_t) - log pi_T(y_t)) + w A_i     (A_i the task's RLOO advantage)

Loss: -A_t * log pi_s(y_t), A_t detached, summed over each completion's tokens, one on-policy update
per batch. Each A_t is minus k1 of the reverse KL at s_t: unbiased for KL(pi_s || pi_T) at s_t; as
an advantage its gradient is that per-state KL's gradient with the states held fixed (a discount
of 0, as Tinker's cookbook), biased for the sequence KL, whose gradient needs the return (the sum
over t' >= t). --full_vocab_kl: the exact per-state KL over the vocabulary instead (no sampling).

    accelerate launch opd.py                                     # embedded student and teacher
    python opd.py --reward_weight 1                              # plus the task's reward
    python opd.py --full_vocab_kl                                # the whole vocabulary

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
    teacher: str = arg(helpers.EMBEDDED_TEACHER, "The frozen teacher, with the student's tokenizer.")
    num_generations: int = arg(4, "G: completions per prompt, >= 2 (batch_size / G prompts).")
    num_steps: int = arg(100, "Optimizer steps (one rollout batch each).")
    kl_coef: float = arg(1.0, "lambda: weight of the reverse KL in each token's advantage.")
    reward_weight: float = arg(0.0, "w: weight of the task's RLOO advantage (0: distil only).")
    full_vocab_kl: bool = arg(False, "The exact reverse KL over the vocabulary, not k1.")

    def __post_init__(self):
        super().__post_init__()
        helpers.check_groups(self)  # G >= 2, dividing --batch_size
        helpers.check_rules(self, kl_coef=helpers.NON_NEGATIVE, reward_weight=helpers.NON_NEGATIVE)
        helpers.check(not self.full_vocab_kl or (self.top_k == 0 and self.top_p == 1.0), "--full_vocab_kl "
                      "sums over the whole vocabulary: sample with --top_k 0 --top_p 1.")
        helpers.models.check_same_tokenizer(self.model_name_or_path, self.teacher)  # before models load
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


def opd_advantages(logp, teacher_logp, task_adv, kl_coef=1.0, reward_weight=0.0):
    """Per-token advantages (B, T), detached: A_t = -lambda (log pi_s(y_t) - log pi_T(y_t)) + w A_i.

    logp: (B, T) the student's log-probs of its drawn tokens (detached here); teacher_logp: (B, T)
    the teacher's of the same tokens; task_adv: (B,) each sequence's task advantage, on each of its
    tokens. log pi_s - log pi_T is k1 of KL(pi_s || pi_T) at the drawn token (common.kl_k1): a
    token the teacher finds likelier than the student gains, one it finds unlikelier loses. The
    padding may hold anything: the loss masks it."""
    # BEGIN SOLUTION
    reverse_kl = logp.detach() - teacher_logp  # (B, T): student first
    return -kl_coef * reverse_kl + reward_weight * task_adv[:, None]
    # END SOLUTION


def opd_loss(logp, adv, mask, loss_agg="seq-mean-token-sum", full_kl=None, kl_coef=1.0):
    """REINFORCE on per-token advantages: loss_t = -A_t log pi_s(y_t), aggregated over the mask.

    logp: (B, T) with gradient; adv: (B, T) detached (its padding may hold anything, even NaN: it
    never reaches the gradient); full_kl: None or (B, T) the exact reverse KL at each position
    (full_reverse_kl, with gradient), added as lambda * full_kl (then adv leaves the KL out).
    loss_agg: common.aggregate_loss's mode or a micro-batch's Aggregation. Returns (loss, stats):
    adv_token_mean (the advantages' mean over the tokens), full_kl (its mean, when given)."""
    # BEGIN SOLUTION
    adv = torch.where(mask.bool(), adv, 0.0)  # (B, T): NaN * 0 would be NaN in the gradient
    per_token = -adv * logp
    if full_kl is not None:
        per_token = per_token + kl_coef * full_kl
    loss = common.aggregate_loss(per_token, mask, loss_agg)
    stats = {"adv_token_mean": common.masked_mean(adv, mask)}
    if full_kl is not None:
        stats["full_kl"] = common.masked_mean(full_kl.detach(), mask)
    return loss, stats
    # END SOLUTION


def full_reverse_kl(logprobs, teacher_logprobs):
    """KL(pi_s || pi_T) at each position: sum_v pi_s(v) (log pi_s(v) - log pi_T(v)). (B, T, V)
    log-probs in, (B, T) out, the gradient through the student's (TRL's GKD, beta = 1): on each
    state, the expectation of the sampled estimator's gradient over the drawn token."""
    # BEGIN SOLUTION
    return (logprobs.exp() * (logprobs - teacher_logprobs)).sum(-1)
    # END SOLUTION


def vocab_kl(policy, teacher, input_ids, attention_mask, T, temperature):
    """(b, T) full_reverse_kl at each completion position, over the vocabulary both models share
    (one may pad its embedding past the tokenizer), the student's side with gradient: a second
    forward of the student beside token_logprobs', for clarity."""
    def logits_of(model):  # (b, T, V) at the sampling temperature: position t predicts token t + 1
        position_ids = common.position_ids_from_mask(attention_mask)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return logits.logits[:, -T - 1:-1].float() / temperature
    student = logits_of(policy)
    with torch.no_grad():
        teacher_logits = logits_of(teacher)
    V = min(student.shape[-1], teacher_logits.shape[-1])
    return full_reverse_kl(student[..., :V].log_softmax(-1), teacher_logits[..., :V].log_softmax(-1))


def main():
    cfg = helpers.parse_config(Config)
    # ---- setup: accelerator, data, student and optimizer, teacher (PLUMBING: skip at first) ----
    accelerator = helpers.make_accelerator(cfg)
    tokenizer, train_data, eval_data = helpers.load_data(cfg, accelerator)
    reward_fn = helpers.make_reward_fn(cfg, accelerator)
    set_seed(cfg.seed)  # the same initial weights on every rank (a LoRA adapter is drawn)
    policy, _, optimizer = helpers.load_models(cfg, accelerator, reference=False)
    teacher = helpers.load_teacher(cfg, accelerator)  # frozen, as a reference is
    G = cfg.num_generations
    prompts = helpers.prompt_sampler(train_data, cfg.batch_size // G, cfg, accelerator)
    set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
    start = helpers.resume(cfg, accelerator, prompts)  # --resume_from: its step, else 0
    logger = helpers.open_log(cfg, accelerator, start)
    ceiling = helpers.evaluate(teacher, tokenizer, eval_data, cfg, accelerator)["eval/accuracy"]
    accelerator.print(f"teacher: held-out accuracy {ceiling:.3f}")
    if start == 0:  # held-out accuracy before training
        logger.log(0, helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator))

    for step in helpers.steps(cfg, start, accelerator):
        started = time.time()
        # ---- rollout: a group of G sampled responses per prompt, each group's rows adjacent ----
        rollout = helpers.sample(policy, tokenizer, prompts.next(), cfg, accelerator, num_samples=G)
        mask, B, T = rollout.mask, *rollout.mask.shape  # (B, T): 1 on each completion's tokens

        # ---- reward, and the teacher's log-probs of the drawn tokens ----
        rewards, correct, reward_stats = reward_fn(rollout.examples, rollout.completions)  # (B,)
        teacher_logp = helpers.score(teacher, rollout, cfg, truncated=False)  # (B, T) log pi_T(y_t)

        # ---- update: one on-policy optimizer step, summing its micro-batches' gradients ----
        agg = common.Aggregation("seq-mean-token-sum")  # how the loss reduces its tokens, said once
        num_tokens = accelerator.reduce(mask.sum().float(), "mean")  # per process, as DDP averages
        size = cfg.micro_batch_size or B  # rows of a forward/backward pass (0: the whole batch)
        batches = [slice(i, i + size) for i in range(0, B, size)]
        for epoch in range(1):  # on-policy: one update per batch (GRPO: mu)
            update_loss, update_stats, kl_seq = 0.0, [], 0.0
            task_adv = []
            for rows in batches:
                logp, entropy = token_logprobs(  # (b, T), with gradient
                    policy, rollout.input_ids[rows], rollout.attention_mask[rows], T, cfg.temperature,
                    with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                kl = common.kl_k1(logp.detach(), teacher_logp[rows])  # (b, T): k1 of the reverse KL
                # ---- advantages: minus the KL to the teacher at each token, plus w A_i ----
                task_adv.append(rloo_advantages(rewards[rows], G))
                kl_coef = 0.0 if cfg.full_vocab_kl else cfg.kl_coef  # the exact KL replaces k1
                adv = opd_advantages(logp, teacher_logp[rows], task_adv[-1], kl_coef, cfg.reward_weight)
                full_kl = None
                if cfg.full_vocab_kl:  # (b, T), with gradient
                    full_kl = vocab_kl(policy, teacher, rollout.input_ids[rows],
                                       rollout.attention_mask[rows], T, cfg.temperature)
                # its part of the batch's loss: the weighted losses sum to the batch's
                weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, B)
                mb_agg = agg._replace(weight=weight)
                loss, stats = opd_loss(logp, adv, mask[rows], mb_agg, full_kl, cfg.kl_coef)
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
        task_adv = torch.cat(task_adv)

        # ---- log, evaluate, checkpoint (PLUMBING: docs/metrics.md says what each one means) ----
        grouped = rewards.view(-1, G)
        metrics = {
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/correct": correct.mean(),
            "train/frac_zero_std_groups": (grouped == grouped[:, :1]).all(1).float().mean(),
            "train/adv_mean": task_adv.mean(),
            "train/adv_std": task_adv.std(),
            "train/adv_abs_max": task_adv.abs().max(),
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

    accuracy = helpers.evaluate(policy, tokenizer, eval_data, cfg, accelerator)["eval/accuracy"]
    accelerator.print(f"held-out accuracy: student {accuracy:.3f}, teacher {ceiling:.3f}")
    helpers.finish(cfg, accelerator, logger, policy, tokenizer, prompts)


if __name__ == "__main__":
    helpers.launch(main)  # one thread per process, the process group closed at the end
