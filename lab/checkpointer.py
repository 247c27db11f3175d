"""The lab's checkpoints: the shared ones (support/run.py: complete or absent, verified on resume), and a
run that saves and stops on Ctrl-C or SIGTERM, stops on a non-finite loss or gradient norm naming its last good
state, and rides out fp16 loss-scale overflows."""
import os
import signal

import torch
from tqdm.auto import tqdm

from support import run

# Under fp16 mixed precision a GradScaler multiplies the loss by a scale (2**16 at first) and halves it at
# every overflow, skipping that step: a few skips are routine, this many in a row is a diverging run.
MAX_SKIPPED_STEPS = 20
PROBE_PROMPTS = 1  # training prompts whose logits are checked before every save (one finds an overflow)


class Checkpointer:
    """Resumable checkpoints: output_dir/checkpoint-N holds accelerate's state (every prepared
    model, optimizer and scheduler, and every rank's RNG states), each rank's prompt-sampler
    state, the policy as save_pretrained (+ tokenizer) so that `from_pretrained(checkpoint-N/model)`
    loads it, and trainer_state.json (the step, what made the checkpoint, and every other file's size
    and SHA-256, which a resume verifies first), written last.
    A checkpoint is written as tmp-checkpoint-N and renamed once every rank has finished, so a
    killed run never leaves a checkpoint-N that is half-written; only the newest
    --save_total_limit are kept. Ctrl-C or SIGTERM saves, then stops. No checkpoint and no final
    model is written from weights or logits that are not finite: they are checked before each save.

        ckpt = Checkpointer(cfg, accelerator, sampler)
        start = ckpt.resume()                    # 0, or the step of --resume_from
        for step in range(start + 1, ...):
            ...
            ckpt.check_finite(step, loss, grad_norm, policy, tokenizer)  # before optimizer.step()
            ...
            if ckpt.step_end(step, policy, tokenizer):   # checks and saves every --save_steps (checks at the last)
                break                                    # a signal arrived: saved, stop
    """

    def __init__(self, cfg, accelerator, sampler, rewound=None):
        """rewound: None, or () -> the prompt sampler's state to save in place of its own, or None for its own
        (--async_rollouts: its state before the batches drawn ahead, which the resumed run draws again)."""
        self.cfg, self.accelerator, self.sampler, self.rewound = cfg, accelerator, sampler, rewound
        self.probe_prompts = [ex["prompt"] for ex in sampler.examples[:PROBE_PROMPTS]]  # read before each save
        self.stop_requested = False
        self.stop_agreed = (None, False)  # (step, whether a signal arrived on any rank), from saves_after
        self.skipped_steps = 0  # fp16 loss-scale overflows in a row
        self.last_saved = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request_stop)

    def _request_stop(self, signum, frame):
        if self.stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop_requested = True
        print(f"\nsignal {signum}: saving a checkpoint at the end of this step (Ctrl-C again to quit now)", flush=True)

    def resume(self):
        """run.load_checkpoint's step (0: none) for this run's prompt sampler."""
        return run.load_checkpoint(self.cfg, self.accelerator, self.sampler)

    def save(self, step, policy, tokenizer):
        """run.save_checkpoint, with the prompt sampler's state (or its state before the batches drawn ahead)."""
        state = (self.rewound and self.rewound()) or self.sampler.state_dict()
        path = run.save_checkpoint(self.cfg, self.accelerator, step, policy, tokenizer, state)
        self.last_saved = step
        return path

    def check_finite(self, step, loss, grad_norm, policy, tokenizer):
        """Call between clipping and optimizer.step(): a NaN/inf loss or gradient norm (on any rank)
        saves the last good state (the weights before this update) and stops the run with a message;
        unless those weights are themselves broken (the update of step - 1 broke them, and no save
        followed it to check them): then the run stops as stop_broken(step - 1) says, saving nothing.
        Under fp16 loss scaling (accelerate's GradScaler, or DeepSpeed's own) an inf gradient norm is a
        loss-scale overflow that the optimizer step skips while lowering the scale: the run stops only
        after MAX_SKIPPED_STEPS in a row. A grad_norm of None (DeepSpeed reports none before its first
        step) counts as finite."""
        device = self.accelerator.device
        norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, device=device)
        bad = torch.stack([~torch.isfinite(loss.detach().to(device)).all(), ~torch.isfinite(norm).all()]).float()
        bad_loss, bad_norm = (self.accelerator.reduce(bad, reduction="sum") > 0).tolist()
        if not (bad_loss or bad_norm):
            self.skipped_steps = 0
            return
        if not bad_loss and run.loss_scaling(self.accelerator):
            self.skipped_steps += 1
            if self.skipped_steps < MAX_SKIPPED_STEPS:
                return
        path = self._last_good(step - 1)
        if path is None:  # checked like every save: weights an earlier update broke are no good state
            self.stop_if_broken(step - 1, policy, tokenizer)
            path = self.save(step - 1, policy, tokenizer)
        norm = norm.tolist()  # PPO passes (policy, critic)
        if self.skipped_steps >= MAX_SKIPPED_STEPS:
            self.stop(f"error: {self.skipped_steps} steps in a row up to step {step} overflowed the fp16 loss "
                      f"scale (gradient norm {norm}) and were skipped; the last good state is in {path}. Lower "
                      "--learning_rate, or train in bfloat16 (accelerate launch --mixed_precision bf16).")
        self.stop(f"error: non-finite loss ({loss.item()}) or gradient norm ({norm}) at step {step}; the update "
                  f"was not applied and the last good state is in {path}. Lower --learning_rate, keep "
                  "--max_grad_norm on, or check the rewards.")

    def _last_good(self, step):
        """checkpoint-N if this run has just saved it: the same weights, with the exact RNG states."""
        path = os.path.join(self.cfg.output_dir, f"{run.CHECKPOINT_PREFIX}{step}")
        return path if self.last_saved == step and os.path.isdir(path) else None

    def stop(self, message, agreed=True):
        """Stop with an `error:` line: printed by the main process when every rank stops together (`agreed`: the
        others exit with status 1 and say nothing), else by the rank that found it."""
        raise SystemExit(message if self.accelerator.is_main_process or not agreed else 1)

    def stop_broken(self, step, agreed=True):
        """Stop the run: the update of `step` left the policy's weights or logits non-finite, although its loss
        and gradient norm were finite. Names the newest checkpoint written before it."""
        earlier = [p for p in run.list_checkpoints(self.cfg.output_dir)[0] if run.checkpoint_step(p) < step]
        good = earlier[-1] if earlier else self.cfg.resume_from
        where = (f"the last good state is in {good}" if good else
                 "no checkpoint was saved before it (--save_steps N keeps one every N steps)")
        self.stop(f"error: the update of step {step} made the policy's weights or logits non-finite (its loss and "
                  f"gradient norm were finite); {where}. Lower --learning_rate (or raise --warmup_steps).", agreed)

    def saves_after(self, step):
        """Whether a save follows this step, the same answer on every rank: a checkpoint every --save_steps
        or when a signal arrived (on any rank: one all-reduce, whose answer step_end keeps), the final model
        after the last step. The weights are checked before it (step_end)."""
        requested = torch.tensor(float(self.stop_requested), device=self.accelerator.device)
        self.stop_agreed = (step, bool(self.accelerator.reduce(requested, reduction="sum") > 0))
        return self.stop_agreed[1] or self._checkpoint_due(step) or step == self.cfg.num_steps

    def _checkpoint_due(self, step):
        return bool(self.cfg.save_steps) and step % self.cfg.save_steps == 0

    def step_end(self, step, policy, tokenizer, finite=None):
        """After the update, before the next sampling. When a save follows (saves_after): stop if the
        weights or the logits are no longer finite (`finite`: finite_weights_and_logits's verdict, computed
        here if not given), naming the newest checkpoint as the last good state; then write the checkpoint
        when due or when a signal arrived (on any rank). Between saves nothing is checked here: sampling
        from broken weights stops the run (the engine's generate), and so does a non-finite loss
        (check_finite). True means stop now."""
        if self.stop_agreed[0] != step:
            self.saves_after(step)
        stop, checkpoint = self.stop_agreed[1], self.stop_agreed[1] or self._checkpoint_due(step)
        if checkpoint or step == self.cfg.num_steps:
            self.stop_if_broken(step, policy, tokenizer, finite)
        if checkpoint:
            path = self.save(step, policy, tokenizer)
            if self.accelerator.is_main_process:
                tqdm.write(f"checkpoint: {path}")
        return stop

    def stop_if_broken(self, step, policy, tokenizer, finite=None):
        """stop_broken(step) on every rank when the weights or logits are not finite on one of them
        (`finite`: this rank's finite_weights_and_logits verdict, computed here if not given)."""
        if not run.all_finite(self.accelerator, policy, tokenizer, self.probe_prompts, finite):
            self.stop_broken(step)
