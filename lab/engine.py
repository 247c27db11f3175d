"""The engine behind every training loop: what a step needs in order to run at scale, and nothing of the
algorithm. The update itself is written out in each algorithm file, as nanoGPT writes gradient accumulation:

    for mb in trainer.micro_batches(rollout, agg):             # rows of one forward/backward; mb.agg: agg, weighted
        logp, entropy = trainer.policy_logprobs(rollout, mb)  # (b, T), with gradient
        loss, stats = losses.grpo_loss(logp, mb.of(old_logp), ..., mb.agg)  # the loss over these rows, aggregated once
        trainer.backward(loss, mb, stats)                     # DDP syncs on the last one
    update = trainer.step(policy)                             # clip, check finite, optimizer step, zero_grad

The aggregation is said once, in the micro_batches call: each micro-batch carries it with its weight
(common.Aggregation), so that the losses aggregated with it add up to the whole batch's loss and their gradients
to its gradient (tests/test_micro_batches.py). Around the update: loading, sampling (`generate`), scoring (one
method per role: `reference_logprobs`, `old_logprobs`, `sampler_logprobs`), and
the end of a step (`end_step`: metrics, evaluation, learning-rate schedules, checkpoints). --fast picks the
sampler and the scorer: lab/decode.py's (the default: support/models.py's, with the drawn log-probs, the viewer's
scores, the routing told its rows, fixed shapes on a GPU), or the plain definitions in common.py, which both are
tested equal to (tests/test_fast.py, tests/test_routing.py).
"""
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NamedTuple

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import common
from lab import async_sampling, checkpointer, corrections, decode, environments, pass_at_k, priority, routing
from lab import sampling, tasks, view, vllm_engine
from lab.step_metrics import StepTimer, rollout_metrics
from support import helpers, models, run
from support.helpers import micro_batches


def load_data(cfg, accelerator):
    """The tokenizer and the (train, eval) examples (the lab's: lab/tasks.py); the main process downloads first, the
    others read its cache. Data errors surface here, before any model loads."""
    with accelerator.main_process_first():
        tokenizer = models.load_tokenizer(cfg)
        train_data, eval_data = tasks.load_task(cfg, tokenizer)
    models.check_prompts_tokenize(tokenizer, train_data + eval_data, cfg, accelerator.is_main_process)
    priority.check_difficulty(cfg, train_data)  # --prompt_sampling curriculum: a number in --difficulty_column
    if cfg.sampler == "vllm":  # what the engine cannot do, and prompts it could not hold
        vllm_engine.check(cfg)
        vllm_engine.check_lengths(cfg, tokenizer, train_data + eval_data)
    with accelerator.main_process_first():
        environments.load(cfg, tokenizer, train_data)  # --environment, --tools: checked, a trial episode
    return tokenizer, train_data, eval_data


@dataclass
class Trainable:
    """A model being trained (prepared: DDP or DeepSpeed), its optimizer and its learning-rate schedule."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    name: str = "policy"  # its gradient norm is logged as train/grad_norm (the policy's) or train/<name>_grad_norm


class Models(NamedTuple):
    policy: Trainable
    ref_model: torch.nn.Module | None      # the frozen reference pi_ref
    rollout_model: torch.nn.Module | None  # the sampler's copy of the policy


def load_models(cfg, accelerator, reference, rollout_copy=False):
    """The policy with its optimizer and schedule, prepared (DDP or DeepSpeed); the frozen reference when asked
    for (a KL term to it), else None; with rollout_copy, the sampler's own copy of the policy when
    --rollout_dtype or --rollout_lag asks for one (sampling.load_rollout_model), else None. Every rank starts
    from the same weights."""
    if cfg.async_rollouts:  # what the sampler process does not support, refused before any model loads
        async_sampling.check(cfg)
    set_seed(cfg.seed)
    policy = models.load_model(cfg)
    if cfg.keep_routing != "none":
        routing.check_moe(policy)
    # --async_rollouts: the sampler process holds the reference and scores each batch with it (rollout.ref_logp;
    # async_sampling.holds_reference: beta > 0, when every loop asks for one)
    ref_model = models.load_reference(cfg, policy) if reference and not cfg.async_rollouts else None
    # --sampler vllm: the engine holds the sampler's copy (in --rollout_dtype), in its own process
    rollout_model = sampling.load_rollout_model(cfg, policy) if rollout_copy and cfg.sampler != "vllm" else None
    optimizer, scheduler = models.make_optimizer(policy, cfg)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    ref_model = models.prepare_frozen(accelerator, ref_model)
    if rollout_model is not None:
        rollout_model = rollout_model.to(accelerator.device)
    return Models(Trainable(policy, optimizer, scheduler), ref_model, rollout_model)


def mean_over_processes(accelerator, value):
    """The mean of a scalar over the processes."""
    return accelerator.reduce(torch.as_tensor(value, dtype=torch.float32, device=accelerator.device), "mean").item()


@dataclass
class MicroBatch:
    """The rows of one forward/backward pass of an update, what the update needs of them, and what their forward
    keeps for their backward: trainer.policy_logprobs scores them once, trainer.backward ends them."""
    rows: torch.Tensor    # (b,) indices into the rollout
    mask: torch.Tensor    # (b, T) their completion mask
    agg: common.Aggregation      # the update's loss aggregation; its weight: their loss's part of the update's loss
    share: torch.Tensor   # their share of the update's tokens (the weight of their statistics)
    last: bool            # the last micro-batch of the update: gradients are synchronised after it
    stage: str = "new"    # "new" -> "scored" (policy_logprobs) -> "done" (backward)
    routing: object = None         # a mixture-of-experts policy's routing.Pass, open until the backward
    logp: torch.Tensor = None      # the log-probs scored with gradient, kept for the rollout viewer's push

    def __len__(self):
        return len(self.rows)

    def of(self, x):
        """These rows of a per-row tensor of the batch ((B,) or (B, T)); None stays None."""
        return None if x is None else x[self.rows]


def clip_grad_norms(accelerator, trainables, max_norm):
    """Clip each trainable's gradient norm to max_norm; returns the norms before clipping. Under fp16 loss
    scaling accelerate's clip_grad_norm_ unscales the gradients of every optimizer at each call, so a second
    trainable would be unscaled twice (torch refuses): with several, they are unscaled once, then clipped."""
    if accelerator.scaler is None or len(trainables) == 1:
        return [accelerator.clip_grad_norm_(t.model.parameters(), max_norm) for t in trainables]
    accelerator.unscale_gradients()
    return [torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm) for t in trainables]


def step_optimizers(accelerator, trainables):
    """Each trainable's optimizer steps, then its gradients are zeroed. One fp16 loss scaler serves every
    optimizer, as torch's recipe for several: each steps (skipped when its gradients overflowed), then the scale
    is updated once. accelerate's optimizer step updates the scale after its own step, so the others step first,
    through the scaler, and the policy's step (accelerate's) updates it."""
    if accelerator.scaler is not None:
        for t in trainables[1:]:
            accelerator.scaler.step(t.optimizer.optimizer)  # the optimizer inside accelerate's wrapper
        trainables[0].optimizer.step()
    else:
        for t in trainables:
            t.optimizer.step()
    for t in trainables:
        t.optimizer.zero_grad()


class Trainer:
    """The run around one algorithm's loop: sampling (lab/sampling.py), scoring, the update's pieces (micro-batches,
    backward, step), timing, logging, evaluation, checkpoints. `rollout_model`, `rollout_lag`: the sampler's copy of
    `policy` (a Trainable) and its staleness; `others`: Trainables stepped with the policy (PPO's critic); `viewer`
    (lab/view.py) watches what the step computed; `environment`: the episodes' (agents.py), or None."""

    def __init__(self, cfg, accelerator, tokenizer, sampler, eval_data, policy, rollout_model=None,
                 rollout_lag=None, others=()):
        self.cfg, self.accelerator, self.tokenizer, self.eval_data = cfg, accelerator, tokenizer, eval_data
        self.policy, self.rollout_model, self.trainables = policy, rollout_model, (policy, *others)
        self.moe = routing.is_moe(policy.model)  # keep routing: docs/stability.md
        # --fast False: the plain definitions (same draws, same values)
        self.sample = decode.generate if cfg.fast else common.generate
        self.score = decode.token_logprobs if cfg.fast else decode.plain_token_logprobs
        self.environment = environments.load(cfg, tokenizer)  # --environment, --tools
        self.rollout_sampler = sampling.rollout_sampler(self, policy, rollout_model, rollout_lag,
                                                        sampler.sample_with(self.sample))  # --sampler tree: trees
        set_seed(cfg.seed + accelerator.process_index)  # each rank samples different completions
        self.ckpt = checkpointer.Checkpointer(cfg, accelerator, sampler, self.rollout_sampler.rewound)
        self.logger, self.viewer, self.start_step, self.at_step = None, None, 0, 1  # at_step: the step running
        self.timer, self.generated, self.update_loss, self.update_stats = StepTimer(), 0, 0.0, []  # this step's
        # sampling and scoring record no gradient: inference mode, cheaper than no_grad (the outputs are cloned before
        # a loss reads them); not under DeepSpeed, whose ZeRO-3 gathers weights that must not become inference tensors
        self.inference = torch.no_grad if accelerator.state.deepspeed_plugin is not None else torch.inference_mode

    def resume(self):
        """Load the checkpoint --resume_from names (its RNG states replace the seeds) and return its step (0: none);
        open the metrics log (a resumed run keeps its rows up to that step) and the rollout viewer."""
        self.start_step = self.ckpt.resume()
        self.logger = run.MetricLogger(self.cfg, self.accelerator, self.start_step)
        self.viewer = view.Watcher(self.cfg, self.accelerator, self.tokenizer, self.start_step)
        return self.start_step

    def evaluate(self, step=None):
        """Held-out greedy accuracy (or of greedy episodes), --eval_samples' pass@k: logged at `step` (0: the start)."""
        metrics = tasks.evaluate(self.policy.model, self.tokenizer, self.eval_data, self.cfg, self.accelerator,
                                 generate=self.rollout_sampler.evaluation_sample,
                                 play=sampling.greedy_play(self.environment, self.cfg))
        metrics.update(pass_at_k.evaluate(self, self.eval_data, self.cfg.eval_samples) if self.cfg.eval_samples else {})
        return metrics if step is None else self.logger.log(step, metrics)

    def steps(self):
        """The step numbers still to run, with a progress bar on the main process."""
        self.at_step, name = self.start_step + 1, os.path.splitext(os.path.basename(sys.argv[0]))[0]
        return tqdm(range(self.at_step, self.cfg.num_steps + 1), desc=name, disable=self.accelerator.process_index > 0)

    # ---- sampling and scoring, with no gradient ----
    def generate(self, examples, num_samples=1, greedy=False):
        """num_samples completions of each example's prompt (or one greedy completion), each example's adjacent."""
        rollout = self.rollout_sampler.generate(examples, num_samples, greedy)
        self.generated += len(rollout)
        return rollout

    def rollout(self, prompts, greedy=False):
        """A rollout of prompts.next()'s examples (greedy: with rollout.greedy), sampled now or ahead (async)."""
        return self.rollout_sampler.rollout(prompts, greedy)

    def reference_logprobs(self, ref_model, rollout):
        """(B, T) log-probs of the completions under the frozen reference (None: None), on its whole distribution
        (--async_rollouts: scored in the sampler process, which holds it: async_sampling.holds_reference)."""
        logp = rollout.ref_logp if ref_model is None else self._logprobs(ref_model, rollout, False)
        return logp if logp is None else self.viewer.scored(self.at_step, "ref_logp", rollout, logp)

    def old_logprobs(self, rollout):
        """(B, T) log-probs under the policy before the update (pi_old), scored as it samples; a mixture of experts
        replays the sampler's experts under --keep_routing r3, and keeps its own for r2 (rollout.old_routing)."""
        with routing.Pass(self.policy.model, rollout, torch.arange(len(rollout), device=rollout.mask.device),
                          self.cfg.keep_routing) if self.moe else ExitStack() as routing_pass:
            logp = self._logprobs(self.policy.model, rollout)
        if self.moe:
            rollout.old_routing = routing_pass.used()
        return self.viewer.scored(self.at_step, "old_logp", rollout, logp)

    def sampler_logprobs(self, rollout):
        """(B, T) log-probs under the sampler's copy, scored as it samples (a mixture of experts with the experts it
        sampled with); None when the policy samples itself; --async_rollouts: the sampler process's, scored there."""
        if self.rollout_model is None:
            return rollout.sampler_logp
        with routing.replay(self.rollout_model, *rollout.routing) if self.moe else ExitStack():
            logp = self._logprobs(self.rollout_model, rollout)
        return self.viewer.scored(self.at_step, "rollout_logp", rollout, logp)

    def _logprobs(self, model, rollout, sampling_mask=True):
        """At the sampling temperature, and (sampling_mask) on the truncated distribution that was sampled."""
        cfg, n = self.cfg, rollout.mask.shape[1]
        sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p} if sampling_mask else {}
        return self._scoring_pass(rollout, lambda ids, mask: self.score(model, ids, mask, n, cfg.temperature,
                                                                        **sampling))

    def values(self, value_model, rollout):
        """(B, T) values of a critic, value_model(input_ids, attention_mask, T), before each completion token."""
        return self._scoring_pass(rollout, lambda ids, mask: value_model(ids, mask, rollout.mask.shape[1]))

    def _scoring_pass(self, rollout, fn):
        """fn(input_ids, attention_mask) over the rollout's micro-batches, concatenated, with no gradient."""
        with self.timer("scoring"), self.inference():
            out = helpers.scoring_pass(rollout, self.cfg.micro_batch_size, fn)
        return out.clone()  # an ordinary tensor, which the loss may keep for its backward

    # ---- the update: micro-batches, backward, step ----
    def micro_batches(self, rollout, loss_agg, rows=None):
        """The micro-batches of one optimizer step over the rollout's rows (all, or `rows`: a PPO minibatch),
        --micro_batch_size rows each. loss_agg, the update's common.Aggregation (or its mode), said here once: each
        micro-batch carries it as mb.agg with its weight (common.micro_batch_weight; token-mean: over the mean token
        count per process, as DDP averages), so the losses aggregated with it add up to the batch's loss."""
        agg, mask = common.Aggregation(loss_agg) if isinstance(loss_agg, str) else loss_agg, rollout.mask
        index = torch.arange(len(rollout), device=mask.device) if rows is None else rows
        num_tokens = self.accelerator.reduce(mask[index].sum().float(), reduction="mean")
        total, out = mask[index].sum().clamp(min=1), []
        for s in micro_batches(len(index), self.cfg.micro_batch_size):
            rows = index[s]
            weight = common.micro_batch_weight(mask[rows], agg.mode, num_tokens, len(index))
            out.append(MicroBatch(rows, mask[rows], agg._replace(weight=weight), mask[rows].sum() / total,
                                  s.stop == len(index)))
        return out

    def policy_logprobs(self, rollout, mb):
        """(b, T) log-probs of the micro-batch's completions under the policy, with gradient, and their entropies,
        scored as sampled (temperature, top-k, top-p). Once per micro-batch: what the forward keeps for the
        backward (a mixture of experts' routing, the viewer's log-probs) stays on `mb` until trainer.backward."""
        cfg = self.cfg
        if mb.stage != "new":
            raise SystemExit(f"error: trainer.policy_logprobs: this micro-batch (rows {loop_rows(mb)}) was already "
                             "scored; score each micro-batch once, then trainer.backward(loss, mb).")
        try:  # the routing is held open until the backward, which may run checkpointed layers again
            mb.routing = routing.Pass(self.policy.model, rollout, mb.rows, cfg.keep_routing) if self.moe else None
        except RuntimeError as e:
            raise SystemExit(f"error: trainer.policy_logprobs: {e}.") from None
        recording = self.viewer.due(self.at_step)
        kept_sizes = [] if recording and (cfg.top_k > 0 or cfg.top_p < 1) else None
        with self.timer("forward_backward"):
            logp, entropy = self.score(self.policy.model, rollout.input_ids[mb.rows], rollout.attention_mask[mb.rows],
                                       rollout.mask.shape[1], cfg.temperature, with_entropy=True, top_k=cfg.top_k,
                                       top_p=cfg.top_p, kept_sizes=kept_sizes)
        mb.stage = "scored"
        if recording:  # backward keeps the gradient at logp (the push)
            mb.logp = logp
            self.viewer.forward(rollout, mb, logp, entropy, kept_sizes)
        return logp, entropy

    def backward(self, loss, mb, stats=None, per_row=None):
        """Backpropagate the micro-batch's loss (aggregated with mb.agg: its part of the update's loss). Only the last
        micro-batch synchronises the gradients across processes (DeepSpeed also steps its optimizer there). stats:
        the loss's statistics (combine); per_row: (b,) or (b, T) values for the viewer (Correction.per_row)."""
        accelerator = self.accelerator
        if mb.stage != "scored":
            raise SystemExit(f"error: trainer.backward: the micro-batch (rows {loop_rows(mb)}) was " +
                             ("already back-propagated." if mb.stage == "done" else
                              "not scored: call trainer.policy_logprobs(rollout, mb) first."))
        with self.timer("forward_backward"), ExitStack() as stack:
            accelerator.sync_gradients = mb.last
            if not mb.last:
                for trainable in self.trainables:
                    stack.enter_context(accelerator.no_sync(trainable.model))
            accelerator.backward(loss)
        mb.stage = "done"
        if mb.routing is not None:
            mb.routing.close()
        if mb.logp is not None:
            self.viewer.backward(mb, per_row)
        self.update_loss = self.update_loss + loss.detach()
        self.update_stats.append((mb.share, stats or {}))

    def step(self, *trainables):
        """One optimizer step of each trainable: clip its gradient norm to --max_grad_norm, check the loss and the
        norms finite (else save the last good state and stop, before any update), step, zero the gradients. Returns
        the loss, each model's gradient norm before clipping (Trainable.name) and the micro-batches' statistics."""
        cfg, accelerator = self.cfg, self.accelerator
        with self.timer("optimizer"):
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            norms = clip_grad_norms(accelerator, trainables, max_norm)
            self.ckpt.check_finite(self.at_step, self.update_loss, norms[0] if len(norms) == 1 else torch.stack(norms),
                                   self.policy.model, self.tokenizer)
            step_optimizers(accelerator, trainables)
        stats = {"loss": self.update_loss,
                 **{"grad_norm" if t is self.policy else f"{t.name}_grad_norm": n for t, n in zip(trainables, norms)}}
        stats.update(helpers.combine(self.update_stats))
        self.update_loss, self.update_stats = 0.0, []
        return stats

    # ---- the end of a step ----
    def end_step(self, step, metrics, rollout=None, rewards=None, adv=None, tokens=None):
        """After the step's updates: the viewer records (adv: (B,) or (B, T); tokens: more (B, T) values), the
        schedules step (once per rollout batch), the weights are checked finite when a save follows, the metrics
        (with the engine's) are averaged over processes and logged with two samples, an evaluation and a checkpoint
        run when due. Returns True when the run must stop (a signal arrived; the checkpoint is written)."""
        cfg, accelerator = self.cfg, self.accelerator
        self.viewer.end_step(step, rollout, rewards, adv, {**(tokens or {}), **routing.viewed(rollout)})
        for trainable in self.trainables:
            trainable.scheduler.step()
        finite = None  # no save follows: broken weights stop the next sampling, or the next loss
        if self.ckpt.saves_after(step):  # the same on every rank: under ZeRO-3 the probe's forward is a collective
            with self.timer("checks"):  # the update left finite weights, and finite logits on a training prompt
                finite = run.finite_weights_and_logits(accelerator.unwrap_model(self.policy.model),
                                                              self.tokenizer, self.ckpt.probe_prompts)
        metrics = {**metrics, "train/generated": self.generated, **self.timer.metrics(),
                   **self.rollout_sampler.end_step(step)}  # --rollout_lag, --async_rollouts: the staleness
        self.generated, samples = 0, []
        if rollout is not None:
            metrics.update({**rollout_metrics(rollout, metrics["time/step_s"]), **routing.rollout_metrics(rollout)})
            samples = zip(rollout.prompts, rollout.completions, rewards.tolist())
        metrics = run.reduce_metrics(accelerator, metrics)
        if step % cfg.eval_every == 0 or step == cfg.num_steps:
            metrics.update(self.evaluate())
        self.logger.log(step, metrics, samples=samples)
        self.at_step = step + 1
        return self.ckpt.step_end(step, self.policy.model, self.tokenizer, finite)

    def finish(self):
        """Summary and curves, the final policy saved, the trackers closed (the process: helpers.launch)."""
        cfg, accelerator = self.cfg, self.accelerator
        self.rollout_sampler.close()  # --sampler vllm's engine, --async_rollouts' process
        self.logger.finish(self.policy.model)
        if self.viewer.enabled:
            print(f"the rollouts, token by token: {os.path.join(cfg.output_dir, 'rollouts.html')}", flush=True)
        if cfg.save_model:
            models.save_model(accelerator, self.policy.model, self.tokenizer, f"{cfg.output_dir}/final", cfg.merge_lora)
        accelerator.wait_for_everyone()
        for tracker in accelerator.trackers:  # --report_to's (accelerator.end_training would also close the group)
            tracker.finish()


def m2po_keep(trainer, rollout, old_logp, rollout_logp):
    """M2PO's (B, T) keep mask of this process's rows of the global batch (corrections.m2po_mask at --m2po_tau over
    every process's tokens, as AReaL masks the whole batch), computed once before the update: of log(pi_old / mu), the
    trainer's log-probs at the update's start (old_logp, or scored now when the loop has none) over the sampler's.
    The same for every micro-batch size, every process count, every epoch and every PPO minibatch. None when
    --m2po_tau is 0 or the policy samples itself."""
    if trainer.cfg.m2po_tau == 0 or rollout_logp is None:
        return None
    old_logp = trainer.old_logprobs(rollout) if old_logp is None else old_logp
    accelerator, (B, T) = trainer.accelerator, rollout.mask.shape
    log_ratio, mask = old_logp - rollout_logp, rollout.mask
    if accelerator.num_processes > 1:  # every process's rows, padded (mask 0) to the widest batch and completion
        log_ratio, mask = (accelerator.gather(accelerator.pad_across_processes(
            accelerator.pad_across_processes(x, dim=0), dim=1)) for x in (log_ratio, mask))
    keep = corrections.m2po_mask(log_ratio, mask, trainer.cfg.m2po_tau)
    start = accelerator.process_index * len(keep) // accelerator.num_processes  # this process's rows
    return keep[start:start + B, :T]


def over_updates(updates, micro_batches):
    """One value per statistic of a step of several updates (PPO: num_epochs x num_mini_batches). updates: what
    trainer.step returned for each, averaged over them. micro_batches: every update's micro-batches' (token count,
    stats) of the statistics that are the batch's: a token mean over the whole batch (each micro-batch weighted by
    its tokens over all the passes' tokens, not by its share of its minibatch), the max of the maxima, an effective
    sample size or a fraction from every pass's sums, in place of the means over the updates."""
    stats = {key: torch.stack([torch.as_tensor(u[key]) for u in updates]).mean() for key in updates[0]}
    total = sum(tokens for tokens, _ in micro_batches)
    return {**stats, **helpers.combine([(tokens / max(total, 1), s) for tokens, s in micro_batches])}


def loop_rows(mb):
    """The micro-batch's rows, as an error message names them."""
    return f"{int(mb.rows[0])}-{int(mb.rows[-1])}" if len(mb.rows) else "none"
