"""The engine behind every training loop: what a step needs in order to run at scale, and nothing of
the algorithm.

An algorithm file writes its update as one loss over the whole batch,

    def loss_fn(logp, old_logp, adv, mask):      # (B, T) log-probs with grad, and the batch's tensors
        return grpo_loss(...)                     # -> (loss, stats)
    stats, logp = trainer.update(loss_fn, rollout, loss_agg, old_logp=old_logp, adv=adv, mask=rollout.mask)

and `Trainer.update` runs it: in micro-batches of --micro_batch_size rows (loss_fn gets the same rows of
every tensor passed by keyword), each loss weighted so that the weighted losses add up to the whole batch's
loss and their gradients to its gradient (common.micro_batch_weight, tests/test_micro_batches.py); gradients
synchronised across processes only on the last micro-batch; clipped; the loss and gradient norm checked
finite; one optimizer step. The log-probs it passes are support/fast.py's, proven equal to
common.token_logprobs. Around it: loading, sampling (`generate`), scoring (`logprobs`), and the end of a step
(`end_step`: metrics, evaluation, learning-rate schedules, checkpoints).
"""
import collections
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import common
from support import fast, models, run, tasks


def load_data(cfg, accelerator):
    """The tokenizer and the (train, eval) examples; the main process downloads first, the others read its
    cache. Data errors surface here, before any model loads."""
    with accelerator.main_process_first():
        tokenizer = models.load_tokenizer(cfg)
        train_data, eval_data = tasks.load_task(cfg, tokenizer)
    return tokenizer, train_data, eval_data


def load_models(cfg, accelerator):
    """The policy with its optimizer and schedule, prepared (DDP or DeepSpeed); the frozen reference when
    there is a KL term to it (--beta > 0; else None); the sampler's low-precision copy (--rollout_dtype, in
    the group methods; else None). Every rank starts from the same weights."""
    set_seed(cfg.seed)
    policy = models.load_model(cfg)
    ref_model = models.load_reference(cfg, policy) if getattr(cfg, "beta", 0) > 0 else None
    rollout_model = models.load_rollout_model(cfg, policy) if hasattr(cfg, "rollout_dtype") else None
    optimizer, scheduler = models.make_optimizer(policy, cfg)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    ref_model = models.prepare_frozen(accelerator, ref_model)
    if rollout_model is not None:
        rollout_model = rollout_model.to(accelerator.device)
    return policy, optimizer, scheduler, ref_model, rollout_model


@dataclass
class Rollout:
    """A sampled batch, one row per completion: its example, the prompt (left-padded) and the completion
    (padded after its first EOS), as ids and as text."""
    examples: list
    prompt_ids: torch.Tensor      # (B, P)
    prompt_mask: torch.Tensor     # (B, P), 0 on the left padding
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor            # (B, T), 1 up to and including the first EOS (common.completion_mask)
    completions: list

    def __len__(self):
        return len(self.examples)

    @property
    def input_ids(self):  # (B, P + T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self):  # (B, P + T)
        return torch.cat([self.prompt_mask, self.mask], dim=1)

    @property
    def prompts(self):
        return [ex["prompt"] for ex in self.examples]

    def select(self, keep):
        """The rows where keep (a (B,) bool tensor) is True."""
        rows = keep.nonzero().flatten()
        return Rollout([self.examples[i] for i in rows.tolist()], self.prompt_ids[rows], self.prompt_mask[rows],
                       self.completion_ids[rows], self.mask[rows], [self.completions[i] for i in rows.tolist()])

    @staticmethod
    def cat(rollouts, pad_token_id, limit=None):
        """The first `limit` rows (default: all) of several rollouts in one, padded as if sampled together:
        prompts on the left to the longest prompt, completions on the right to the widest completion."""
        parts, remaining = [], sum(map(len, rollouts)) if limit is None else limit
        for r in rollouts:
            if remaining > 0 and len(r) > 0:
                parts.append(r.select(torch.arange(len(r), device=r.mask.device) < remaining))
                remaining -= len(parts[-1])
        prompt_width = max(int(r.prompt_mask.sum(1).max()) for r in parts)  # the padding no row needs goes

        def pad(tensors, value, width=None, left=False):
            width = width or max(t.shape[1] for t in tensors)
            tensors = [t[:, -width:] if left else t for t in tensors]
            return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]),
                                                      value=value) for t in tensors])
        return Rollout([ex for r in parts for ex in r.examples],
                       pad([r.prompt_ids for r in parts], pad_token_id, prompt_width, left=True),
                       pad([r.prompt_mask for r in parts], 0, prompt_width, left=True),
                       pad([r.completion_ids for r in parts], pad_token_id),
                       pad([r.mask for r in parts], 0), [c for r in parts for c in r.completions])


def any_process(accelerator, flag):
    """True on every process when `flag` is True on one of them."""
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "sum") > 0)


def mean_over_processes(accelerator, value):
    """The mean of a scalar over the processes."""
    return accelerator.reduce(torch.as_tensor(value, dtype=torch.float32, device=accelerator.device), "mean").item()


def fewest(accelerator, n):
    """The smallest of the processes' values of the integer n."""
    return min(accelerator.gather(torch.tensor([n], device=accelerator.device)).tolist())


def backward(accelerator, models, loss, sync):
    """accelerator.backward for one micro-batch of an update. Gradients of micro-batches add up locally;
    only the last one (sync=True) synchronises them across processes: DDP all-reduces, and DeepSpeed
    reduces and steps its optimizer inside this call."""
    accelerator.sync_gradients = sync
    with ExitStack() as stack:
        if not sync:
            for model in models:
                stack.enter_context(accelerator.no_sync(model))
        accelerator.backward(loss)


def combine(stats, token_shares):
    """One value per statistic from the micro-batches' values: a mean weighted by each micro-batch's share of
    the tokens (exact for a mean over tokens, as the clip fractions and KL estimates are; a mean over
    sequences is exact with one micro-batch, the default), the max of *_max and the min of *_min; a tensor
    with one value per row is concatenated."""
    out = {}
    for key in stats[0]:
        values = [s[key] for s in stats]
        if torch.is_tensor(values[0]) and values[0].dim() > 0:
            out[key] = torch.cat(values)
        elif key.endswith("_max") or key.endswith("_min"):
            values = torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in values])
            out[key] = values.max() if key.endswith("_max") else values.min()
        else:
            out[key] = sum(share * v for share, v in zip(token_shares, values))
    return out


class Trainer:
    """The run around one algorithm's loop: resume, timing, sampling, scoring, the update, logging and
    checkpoints. `critic` (PPO) is a second model trained by the same losses, with its own optimizer."""

    def __init__(self, cfg, accelerator, tokenizer, sampler, eval_data, policy, optimizer, scheduler,
                 rollout_model=None, critic=None, critic_optimizer=None, critic_scheduler=None):
        self.cfg, self.accelerator, self.tokenizer, self.eval_data = cfg, accelerator, tokenizer, eval_data
        self.policy, self.rollout_model, self.critic = policy, rollout_model, critic
        self.models = (policy,) if critic is None else (policy, critic)
        self.optimizers = (optimizer,) if critic is None else (optimizer, critic_optimizer)
        self.schedulers = (scheduler,) if critic is None else (scheduler, critic_scheduler)
        set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
        self.ckpt = run.Checkpointer(cfg, accelerator, sampler)
        self.start_step = self.ckpt.resume()
        self.logger = run.MetricLogger(cfg, accelerator, self.start_step)
        if self.start_step == 0:
            self.logger.log(0, tasks.evaluate(policy, tokenizer, eval_data, cfg, accelerator))
        self.timer, self.generated, self.step = run.StepTimer(), 0, self.start_step + 1
        # --rollout_lag k: (step, trainable weights) at the start of the last k + 1 steps; the oldest samples
        self.past_weights = collections.deque(maxlen=getattr(cfg, "rollout_lag", 0) + 1)
        # sampling and scoring record no gradient: inference mode is cheaper than no_grad (their outputs are
        # cloned into ordinary tensors before a loss reads them). Not under DeepSpeed: ZeRO-3 gathers weights
        # inside these passes, and one it keeps gathered must not become an inference tensor.
        self.inference = torch.no_grad if accelerator.state.deepspeed_plugin is not None else torch.inference_mode

    def steps(self):
        """The step numbers still to run, with a progress bar on the main process."""
        name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        return tqdm(range(self.start_step + 1, self.cfg.num_steps + 1), desc=name,
                    disable=not self.accelerator.is_main_process)

    @torch.no_grad()
    def generate(self, examples, num_samples=1, greedy=False):
        """Sample num_samples completions of each example's prompt (or one greedy completion) with the
        current policy, or with its copy (--rollout_dtype, --rollout_lag) synced to it: to the current weights, or
        with --rollout_lag k to those of k steps ago (fewer in the first k steps, and in the first k after a
        resume). Rows: each example's samples adjacent."""
        cfg, tokenizer = self.cfg, self.tokenizer
        tasks.TRAINER_STATE.global_step = self.step - 1  # reward functions' trainer_state: the steps done so far
        with self.timer("generation"):
            prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples],
                                                             self.accelerator.device)
            model = self.accelerator.unwrap_model(self.policy)
            if self.rollout_model is not None and not greedy:  # the sampler gets this step's weights, in its dtype
                weights = None
                if cfg.rollout_lag > 0:  # or those of k steps ago; saved once per step (DAPO samples in rounds)
                    if not self.past_weights or self.past_weights[-1][0] != self.step:
                        self.past_weights.append((self.step, models.trainable_weights(model, self.rollout_model.dtype)))
                    weights = self.past_weights[0][1]
                model = models.sync_rollout_model(self.rollout_model, model, weights)
            # NaN or inf probabilities: an update broke the weights (they are checked before saves only,
            # run.Checkpointer.step_end). Every rank stops, those whose own prompts still sampled too.
            broken = False
            try:
                with self.inference():
                    completion_ids = fast.generate(model, tokenizer, prompt_ids, prompt_mask, cfg,
                                                   num_samples=num_samples, greedy=greedy)
                completion_ids = completion_ids.clone()  # an ordinary tensor: the loss's input
            except RuntimeError as e:
                if "probability tensor" not in str(e):
                    raise
                broken = True
            if any_process(self.accelerator, broken):
                self.ckpt.stop_broken(self.step - 1)
            k = len(completion_ids) // len(examples)
            mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
            completions = tasks.decode_completions(tokenizer, completion_ids, mask)
        self.generated += len(completion_ids)
        return Rollout([ex for ex in examples for _ in range(k)], prompt_ids.repeat_interleave(k, dim=0),
                       prompt_mask.repeat_interleave(k, dim=0), completion_ids, mask, completions)

    def keep_sampling(self, kept, rounds):
        """DAPO's dynamic sampling: whether to sample another round, given the (rollout, rewards, correct) kept so
        far. Until --max_sampling_rounds, while some process holds fewer than --batch_size rows: every process
        samples as many rounds (under ZeRO-3 each generate is a collective)."""
        full = sum(len(rollout) for rollout, _, _ in kept) >= self.cfg.batch_size
        return rounds < self.cfg.max_sampling_rounds and any_process(self.accelerator, not full)

    def kept_batch(self, kept, step):
        """The kept rows as one (rollout, rewards, correct), the same number on every process (the fewest kept,
        at most --batch_size: under ZeRO-3 each forward is a collective, and DDP steps together); three Nones
        when a process kept nothing, so that every process skips the step. A batch left short warns."""
        cfg, accelerator = self.cfg, self.accelerator
        held = sum(len(rollout) for rollout, _, _ in kept)
        n = fewest(accelerator, min(held, cfg.batch_size))
        if held < cfg.batch_size:
            print(f"warning: step {step} (rank {accelerator.process_index}): --max_sampling_rounds "
                  f"{cfg.max_sampling_rounds} reached with {held // cfg.num_generations} of "
                  f"{cfg.batch_size // cfg.num_generations} groups with mixed {cfg.dynamic_sampling_metric}; "
                  + ("skipping the step (a process kept no group)" if n == 0 else "training on those")
                  + ". Raise --max_sampling_rounds to fill the batch.", file=sys.stderr, flush=True)
        if n == 0:
            return None, None, None
        rollout = Rollout.cat([rollout for rollout, _, _ in kept], self.tokenizer.pad_token_id, limit=n)
        return rollout, torch.cat([r for _, r, _ in kept])[:n], torch.cat([c for _, _, c in kept])[:n]

    def logprobs(self, model, rollout, sampling_mask=True):
        """(B, T) log-probs of the rollout's completions under `model` (None gives None), in micro-batches,
        at the sampling temperature, and (sampling_mask) on the truncated distribution that was sampled."""
        if model is None:
            return None
        cfg, n = self.cfg, rollout.mask.shape[1]
        sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p} if sampling_mask else {}
        return self._scoring_pass(
            rollout, lambda ids, mask: fast.token_logprobs(model, ids, mask, n, cfg.temperature, **sampling))

    def values(self, critic, rollout):
        """(B, T) values of the critic (PPO's ValueModel) before each completion token, in micro-batches."""
        return self._scoring_pass(rollout, lambda ids, mask: critic(ids, mask, rollout.mask.shape[1]))

    def _scoring_pass(self, rollout, fn):
        """fn(input_ids, attention_mask) over the rollout's micro-batches, concatenated, with no gradient."""
        with self.timer("scoring"):
            with self.inference():
                out = torch.cat([fn(rollout.input_ids[mb], rollout.attention_mask[mb])
                                 for mb in common.micro_batches(len(rollout), self.cfg.micro_batch_size)])
            return out.clone()  # an ordinary tensor, which the loss may keep for its backward

    def update(self, loss_fn, rollout, loss_agg, rows=None, **batch):
        """One optimizer step on the loss `loss_fn(logp, **batch) -> (loss, stats)`, written for the whole
        batch, over the rollout's rows (all, or `rows`, a PPO minibatch's indices).

        loss_fn is called once per micro-batch with that micro-batch's log-probs (with gradient) and its rows of
        every tensor in `batch` (None stays None); its loss is weighted by common.micro_batch_weight for
        `loss_agg`, so the gradients add up to those of the loss over all the rows (over every process: DDP
        averages them, and token-mean divides by the mean token count per process). Returns the step's
        statistics (loss_fn's, combined as `combine` says; the weighted loss; entropy; each model's gradient
        norm before clipping) and the (B, T) log-probs, detached."""
        cfg, accelerator = self.cfg, self.accelerator
        input_ids, attention_mask, mask = rollout.input_ids, rollout.attention_mask, rollout.mask
        T = mask.shape[1]
        index = torch.arange(len(rollout), device=mask.device) if rows is None else rows
        num_tokens = accelerator.reduce(mask[index].sum().float(), reduction="mean")  # per process, over every one
        micro_batches = common.micro_batches(len(index), cfg.micro_batch_size)
        with self.timer("forward_backward"):
            loss, logps, entropies, stats, shares = 0.0, [], [], [], []
            for mb in micro_batches:
                r = index[mb]
                logp, entropy = fast.token_logprobs(self.policy, input_ids[r], attention_mask[r], T, cfg.temperature,
                                                    with_entropy=True, top_k=cfg.top_k, top_p=cfg.top_p)
                mb_loss, mb_stats = loss_fn(logp, **{k: None if v is None else v[r] for k, v in batch.items()})
                weight = common.micro_batch_weight(mask[r], loss_agg, num_tokens, len(index))
                backward(accelerator, self.models, weight * mb_loss, sync=mb.stop == len(index))
                loss = loss + weight * mb_loss.detach()
                logps.append(logp.detach())
                entropies.append(entropy)
                stats.append(mb_stats)
                shares.append(mask[r].sum() / mask[index].sum().clamp(min=1))
            logp, entropy = torch.cat(logps), torch.cat(entropies)
        with self.timer("optimizer"):
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norms = [accelerator.clip_grad_norm_(model.parameters(), max_norm) for model in self.models]
            # a non-finite loss or gradient norm saves the last good state and stops, before the update
            self.ckpt.check_finite(self.step, loss, grad_norms[0] if len(grad_norms) == 1 else torch.stack(grad_norms),
                                   self.policy, self.tokenizer)
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad()
        stats = {"loss": loss, "entropy": common.masked_mean(entropy, mask[index]), "grad_norm": grad_norms[0],
                 **combine(stats, shares)}
        if self.critic is not None:
            stats["critic_grad_norm"] = grad_norms[1]
        return stats, logp

    def end_step(self, step, metrics, rollout=None, rewards=None):
        """After the step's updates: the learning-rate schedules step (once per rollout batch, so
        --warmup_steps counts steps in every script), the weights and logits are checked finite when a save
        follows (a checkpoint, or the final model after the last step), the metrics (with the engine's:
        sequences generated, completion length, phase times) are averaged over processes and logged with two
        samples, a held-out evaluation runs when due, a checkpoint is written when due.
        Returns True when the run must stop (a signal arrived; the checkpoint is written)."""
        cfg, accelerator = self.cfg, self.accelerator
        for scheduler in self.schedulers:
            scheduler.step()
        finite = None  # no save follows: broken weights stop the next sampling, or the next loss
        if self.ckpt.saves_after(step):  # the same on every rank: under ZeRO-3 the probe's forward is a collective
            with self.timer("checks"):  # the update left finite weights, and finite logits on a training prompt
                finite = run.finite_weights_and_logits(accelerator.unwrap_model(self.policy), self.tokenizer,
                                                       self.ckpt.probe_prompts)
        metrics = {**metrics, "train/generated": self.generated, **self.timer.metrics()}
        if hasattr(cfg, "rollout_lag"):  # the steps between the sampler's weights and the trainer's (group methods)
            metrics["train/staleness"] = step - self.past_weights[0][0] if self.past_weights else 0
        self.generated = 0
        samples = []
        if rollout is not None:
            lengths = rollout.mask.sum(1).float()
            metrics["train/completion_len"] = lengths.mean()
            metrics["time/tokens_per_s"] = lengths.sum() / metrics["time/step_s"]
            samples = zip(rollout.prompts, rollout.completions, rewards.tolist())
        metrics = run.reduce_metrics(accelerator, metrics)
        if step % cfg.eval_every == 0 or step == cfg.num_steps:
            metrics.update(tasks.evaluate(self.policy, self.tokenizer, self.eval_data, cfg, accelerator))
        self.logger.log(step, metrics, samples=samples)
        self.step = step + 1
        return self.ckpt.step_end(step, self.policy, self.tokenizer, finite)

    def finish(self):
        """Summary and curves, the final model (and PPO's critic) with save_pretrained, and the process group
        closed on every rank."""
        cfg, accelerator = self.cfg, self.accelerator
        self.logger.finish(self.policy)
        if cfg.save_model:
            models.save_model(accelerator, self.policy, self.tokenizer, f"{cfg.output_dir}/final", cfg.merge_lora)
        if cfg.save_model and self.critic is not None:  # under LoRA merged: a whole critic either way
            critic = accelerator.unwrap_model(self.critic).model
            models.save_model(accelerator, critic, self.tokenizer, f"{cfg.output_dir}/final/critic", merge_lora=True)
        accelerator.wait_for_everyone()
        accelerator.end_training()  # close the process group on every rank before the interpreter exits
