"""Sampling a rollout: the policy, or the sampler's copy of it (a lower precision, or the weights of k steps ago:
`load_rollout_model`, `sync_rollout_model`), generates completions of a batch of prompts with support/models.py's
decode loop or the plain common.generate, and a mixture of experts' routing is recorded as it samples
(lab/routing.py). The trainer (lab/engine.py) asks for a rollout once per step (DAPO: once per round of dynamic
sampling; ReMax: with the greedy completions) and trains on it."""
import collections
import copy
import functools
from contextlib import ExitStack

import torch

import agents
import common
from lab import async_sampling, routing, tasks, tree, vllm_engine
from support import models, reward_functions
from support.helpers import any_process
from lab.rollout import LabRollout


def rollout_sampler(trainer, policy, rollout_model, rollout_lag, sample):
    """The RolloutSampler (--sampler vllm: with a vLLM engine in its own process, lab/vllm_engine.py), or with
    --async_rollouts the sampler process's (lab/async_sampling.py, which then holds the engine)."""
    if trainer.cfg.async_rollouts:
        return async_sampling.AsyncRolloutSampler(trainer, policy, sample, play)
    accelerator = trainer.accelerator
    engine = vllm_engine.Engine(trainer.cfg, accelerator.device, accelerator.process_index) \
        if trainer.cfg.sampler == "vllm" else None
    return RolloutSampler(trainer, policy, rollout_model, rollout_lag, sample, engine)


class RolloutSampler:
    """Samples with `policy` (a Trainable), unless `rollout_model` (its low-precision or stale copy) does, synced to
    it before each rollout: to this step's weights, or with `rollout_lag` k to those of k steps ago, or `engine`
    (--sampler vllm's vllm_engine.Engine) does, with the policy's weights of the step. `sample` is decode.generate
    or common.generate; `trainer` gives the timer, the step running, the context the passes run in (`inference`) and,
    when sampling fails, the check that stops a run whose weights broke. evaluation_sample: the held-out
    evaluation's sample function (the engine's, or the trainer's)."""

    rewound = None  # a checkpoint saves the prompt sampler's own state: no batch is drawn ahead (async_sampling's is)

    def __init__(self, trainer, policy, rollout_model, rollout_lag, sample, engine=None):
        self.trainer, self.policy, self.rollout_model, self.rollout_lag = trainer, policy, rollout_model, rollout_lag
        self.sample, self.moe, self.engine = sample, routing.is_moe(policy.model), engine
        self.evaluation_sample = trainer.sample if engine is None else engine.generate
        # rollout_lag k: (step, trainable weights) at the start of the last k + 1 steps; the oldest samples
        self.past_weights = collections.deque(maxlen=(rollout_lag or 0) + 1)

    def model(self, step, greedy):
        """The model that samples at `step`: the policy, or (not for a greedy completion) its copy synced to it."""
        model = self.trainer.accelerator.unwrap_model(self.policy.model)
        if self.rollout_model is None or greedy:
            return model
        weights = None
        if self.rollout_lag:  # the weights of k steps ago; saved once per step (DAPO samples in rounds)
            if not self.past_weights or self.past_weights[-1][0] != step:
                self.past_weights.append((step, trainable_weights(model, self.rollout_model.dtype)))
            weights = self.past_weights[0][1]
        return sync_rollout_model(self.rollout_model, model, weights)

    def staleness(self, step):
        """The optimizer steps between the weights that sampled at `step` and the trainer's (--rollout_lag)."""
        return step - self.past_weights[0][0] if self.past_weights else 0

    def rollout(self, prompts, greedy=False):
        """This step's rollout of prompts.next()'s examples (async_sampling.draw), with greedy (ReMax) their greedy
        completions as rollout.greedy."""
        examples, num_samples = async_sampling.draw(prompts)
        rollout = self.trainer.generate(examples, num_samples)
        rollout.greedy = self.trainer.generate(examples, greedy=True) if greedy else None
        return rollout

    def end_step(self, step):
        """After the step's updates (the engine takes the new weights before it samples again), its metrics: with
        --rollout_lag, train/staleness."""
        if self.engine is not None:
            self.engine.weights_changed()
        return {} if self.rollout_lag is None else {"train/staleness": self.staleness(step)}

    def close(self):
        """After the run: the engine's process ended."""
        if self.engine is not None:
            self.engine.close()

    @torch.no_grad()
    def generate(self, examples, num_samples=1, greedy=False):
        """A Rollout: num_samples completions of each example's prompt (or one greedy completion), each example's
        samples adjacent."""
        trainer = self.trainer
        cfg, tokenizer, accelerator = trainer.cfg, trainer.tokenizer, trainer.accelerator
        if cfg.reward_fn:  # their trainer_state: the steps done so far
            reward_functions.trainer_state().global_step = trainer.at_step - 1
        with trainer.timer("generation"):
            if trainer.environment is None:  # an episode's prompt is rendered with its environment (`play`)
                prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples],
                                                                 accelerator.device)
            model, error, episodes, drawn_logp = self.model(trainer.at_step, greedy), None, None, None
            try:
                with trainer.inference(), routing.record(model) if self.moe else ExitStack() as recording:
                    if self.engine is not None:  # --sampler vllm: the engine's draws, and their log-probs (mu)
                        completion_ids, drawn_logp = self.engine.generate(
                            model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples, greedy, logprobs=True)
                        if isinstance(self.sample, tree.Sampling) and not greedy:  # train/decoded_per_completion
                            self.sample.count(int(common.completion_mask(completion_ids, tokenizer.eos_token_id)
                                                  .sum()), len(completion_ids))
                    elif trainer.environment is None:
                        completion_ids = self.sample(model, tokenizer, prompt_ids, prompt_mask, cfg,
                                                     num_samples=num_samples, greedy=greedy)
                    else:  # episodes: the model's turns and the environment's replies (agents.py)
                        prompt_ids, prompt_mask, completion_ids, mask, token_mask, episodes = play(
                            model, tokenizer, trainer.environment, examples, cfg, num_samples, greedy)
                        if isinstance(self.sample, tree.Sampling) and not greedy:  # train/decoded_per_completion
                            self.sample.count(int(mask.sum()), len(completion_ids))
                completion_ids = completion_ids.clone()  # an ordinary tensor: the loss's input
            except (RuntimeError, SystemExit) as e:  # NaN probabilities (broken weights?), an environment's reset
                error = e  # that raised (its one line): every rank stops, not the one alone
            if any_process(accelerator, error is not None):
                # the weights are checked between saves only, so an update may have broken them: then every rank
                # stops with one message (run.finite_weights_and_logits); else the error stands
                trainer.ckpt.stop_if_broken(trainer.at_step - 1, model, tokenizer)
                raise error if error is not None else SystemExit(1)
            k = len(completion_ids) // len(examples)
            if episodes is None:
                mask = token_mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
            completions = tasks.decode_completions(tokenizer, completion_ids, token_mask, episodes)
        if episodes is None:
            prompt_ids, prompt_mask = prompt_ids.repeat_interleave(k, dim=0), prompt_mask.repeat_interleave(k, dim=0)
        experts = recording.layout(torch.cat([prompt_mask, mask], 1)) if self.moe else None  # the sampler's
        return LabRollout([ex for ex in examples for _ in range(k)], prompt_ids, prompt_mask, completion_ids, mask,
                          completions, experts, group_size=k, episodes=episodes,
                          token_mask=None if episodes is None else token_mask,
                          sampler_logp=None if greedy or drawn_logp is None else drawn_logp.clone())


def play(model, tokenizer, environment, examples, cfg, num_samples=1, greedy=False, logprobs=False):
    """agents.play_episodes of num_samples episodes of each example (one greedy episode each), each example's
    adjacent, in calls of at most --generation_batch_size episodes, each turn sampled by agents.CachedTurns or
    (--fast False) the plain agents.sample_turn_plain; under ZeRO-3 the weights gathered once.
    Returns (prompt_ids, prompt_mask, completion_ids, mask, token_mask, episodes), on the model's device, the
    calls' padded as if played together; with logprobs also the (B, T) log-probs of the actions as they were drawn
    (CachedTurns.drawn_logprobs; None under --fast False)."""
    k = 1 if greedy else num_samples
    n = max(1, cfg.generation_batch_size // k) if cfg.generation_batch_size else len(examples)
    device, played, drawn = next(model.parameters()).device, [], []
    with common.sampling_mode(model), models.gathered_parameters(model):
        for i in range(0, len(examples), n):
            sample_turn = agents.CachedTurns(model, tokenizer, cfg, environment.stop_ids, greedy, logprobs) \
                if cfg.fast else agents.sample_turn_plain(model, tokenizer, cfg, environment.stop_ids, greedy)
            played.append(agents.play_episodes(sample_turn, environment, tokenizer,
                                               [ex for ex in examples[i:i + n] for _ in range(k)], cfg.max_new_tokens,
                                               cfg.max_turns))
            drawn.append(sample_turn.drawn_logprobs(played[-1][3]) if logprobs and cfg.fast else None)
    width = max(p[0].shape[1] for p in played)  # the prompts: left-padded to the widest
    prompt_ids = torch.cat([torch.nn.functional.pad(p[0], (width - p[0].shape[1], 0), value=tokenizer.pad_token_id)
                            for p in played])
    prompt_mask = torch.cat([torch.nn.functional.pad(p[1], (width - p[1].shape[1], 0)) for p in played])
    completion_ids, mask, token_mask = (common.pad_completions([p[j] for p in played], pad)
                                        for j, pad in ((2, tokenizer.pad_token_id), (3, 0), (4, 0)))
    tensors = (prompt_ids, prompt_mask, completion_ids, mask, token_mask)
    out = (*(t.to(device) for t in tensors), [e for p in played for e in p[5]])
    if not logprobs:
        return out
    return (*out, None if drawn[0] is None else common.pad_completions(drawn, 0.0).to(device))


def greedy_play(environment, cfg):
    """tasks.evaluate's `play`: one greedy episode of each example (None without an environment)."""
    return None if environment is None else functools.partial(play, environment=environment, cfg=cfg, greedy=True)


def load_rollout_model(cfg, policy):
    """With --rollout_dtype other than --torch_dtype, or --rollout_lag > 0, a frozen copy of the policy in
    --rollout_dtype that does the sampling, as an inference engine beside the trainer would; else None.
    Call before accelerator.prepare(policy) and sync it before each rollout."""
    if cfg.rollout_dtype == cfg.torch_dtype and cfg.rollout_lag == 0:
        return None
    if any(hasattr(p, "ds_id") for p in policy.parameters()):
        raise SystemExit(ZERO3_ERROR)
    return copy.deepcopy(policy).to(getattr(torch, cfg.rollout_dtype)).eval().requires_grad_(False)


ZERO3_ERROR = ("error: --rollout_dtype and --rollout_lag copy the whole policy, which ZeRO-3 shards: use ZeRO-2 "
               "or DDP.")


@torch.no_grad()
def trainable_weights(model, dtype):
    """A copy of the model's trainable weights (all, or the LoRA adapter's) in `dtype`: the state a
    --rollout_lag sampler is synced to k steps later."""
    return [p.detach().to(dtype, copy=True) for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def sync_rollout_model(rollout_model, policy, weights=None):
    """Copy the trainer's current weights into the sampler, cast to its dtype; with `weights` (the
    trainable_weights of an earlier step, --rollout_lag) the trainable ones come from there. Returns it."""
    saved = None if weights is None else iter(weights)
    for target, source in zip(rollout_model.parameters(), policy.parameters(), strict=True):
        if hasattr(source, "ds_id"):
            raise SystemExit(ZERO3_ERROR)
        target.copy_(next(saved) if saved is not None and source.requires_grad else source)
    return rollout_model
