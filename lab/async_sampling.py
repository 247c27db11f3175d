"""--async_rollouts K (docs/async.md): a sampler in its own process, with its own copy of the policy, samples the next
batches while the learner trains on this one, at most K optimizer steps ahead. The learner writes its weights into
shared memory after each step with a version (the steps done); the sampler reads the newest before each batch, and
waits when it would sample batch t with weights older than those after step t - 1 - K. Each rollout comes back with
the version that sampled it and the log-probs of its draws under the distribution they were drawn from (the sampling
pass's own, decode.generate(logprobs=True); --fast False: a scoring pass): the behaviour policy mu of the decoupled
objective, which TIS, the geometric mask, the veto and M2PO correct as with --rollout_lag. With a KL term (beta > 0)
the frozen reference lives in the sampler process too, which scores each batch with it (rollout.ref_logp): the
learner keeps only its update. With an environment (--environment, --tools) the sampler process plays the episodes
and rewards them with their environments, which stay there. On the CPU the two processes split the cores
(`split_threads`).

The sampler never outlives the learner: it is a daemon process (ended when the learner exits normally), the kernel
kills it when the learner dies (PR_SET_PDEATHSIG, Linux), and it checks between waits that its parent still runs. A sampler that dies stops the learner with
one line naming the cause. Under DDP each learner process has a sampler process of its own, which samples its rank's
prompts with its rank's seed; the ranks' weights are equal after each step, and every rank takes as many batches
per step (DAPO's rounds are agreed by an all-reduce), so the versions and staleness are the same on every rank."""
import collections
import copy
import json
import os
import queue
import signal
import time
import traceback

import numpy as np
import torch
import torch.multiprocessing as mp

import common
from lab import decode, environments, routing, tasks, tool_process, tree, vllm_engine
from support import models, reward_functions
from lab.rollout import LabRollout
from support.helpers import micro_batches

POLL_S = 0.05  # how often a waiting process checks the other one


def check(cfg):
    """Before any model loads: the combinations the sampler process does not support yet, one line each."""
    refuse = [(getattr(cfg, "rollout_lag", 0) > 0 or getattr(cfg, "rollout_dtype", cfg.torch_dtype) != cfg.torch_dtype,
               "--rollout_lag or --rollout_dtype: the sampler process is the stale copy"),
              (getattr(cfg, "budget", "uniform") != "uniform", "--budget knapsack: it allocates from fresh outcomes"),
              (getattr(cfg, "sampler", "independent") == "tree", "--sampler tree: the process samples each "
               "completion on its own")]
    refuse.append((routing.names_moe(cfg.model_name_or_path),
                   "a mixture-of-experts policy: its routing is not replayed across processes"))
    for refused, what in refuse:
        if refused:
            raise SystemExit(f"error: --async_rollouts does not run with {what}.")


def draw(prompts):
    """prompts.next() as (examples, completions of each): a budget.BudgetSampler's pair, or a tasks.PromptSampler's
    examples with one completion each."""
    batch = prompts.next()
    return batch if isinstance(batch, tuple) else (batch, 1)


class AsyncRolloutSampler:
    """The learner's side: starts the sampler process, keeps up to K + 1 batches asked for (each request carries the
    learner's version then: the sampler waits for those weights or newer), hands the trainer one per call (DAPO:
    one per round), and publishes the weights that train after each step (under --lora_r the adapter's). A batch
    asked for at step t is taken by step t + K (every step takes one at least), so it is at most K steps stale.
    play: sampling.play, for the sampler process (lab/sampling.py imports this module)."""

    def __init__(self, trainer, policy, sample, play):
        self.trainer, self.ahead = trainer, trainer.cfg.async_rollouts
        # the weights that train, by name: the whole model's, or under --lora_r only the adapters'
        self.model = trainer.accelerator.unwrap_model(policy.model)
        self.names, self.params = zip(*[(name, p) for name, p in self.model.named_parameters() if p.requires_grad])
        ctx = mp.get_context("spawn")
        with models.gathered_parameters(self.model):  # ZeRO-3: each weight whole for the copy (every rank at once)
            self.weights = [p.detach().to("cpu", copy=True).share_memory_() for p in self.params]
        self.version, self.lock = ctx.Value("i", -1), ctx.Lock()  # -1: nothing published yet
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.asked = collections.deque()  # the (examples, completions of each, greedy) asked for, in order
        self.received = []  # this step's batches: (version per row, the sampler's seconds per phase)
        self.sample = sample  # the prompt sampler's (tasks.PromptSampler.sample_with): the process reports to it
        self.evaluation_sample = trainer.sample  # the learner evaluates with its own (the process holds any engine)
        self.timeline = trainer.accelerator.is_main_process and os.path.join(trainer.cfg.output_dir, "timeline.jsonl")
        self.sampler_spans = []  # (phase, start, end), wall clock, as the learner's timer.spans (bench/async.py)
        threads = split_threads(trainer.accelerator.device)
        self.process = ctx.Process(target=serve, daemon=True, name="sampler", args=(
            trainer.cfg, trainer.cfg.seed + trainer.accelerator.process_index, dict(zip(self.names, self.weights)),
            self.version, self.lock, self.requests, self.results, os.getpid(), threads, str(trainer.accelerator.device),
            tasks.reward_scorer, play))
        self.process.start()

    def rollout(self, prompts, greedy=False):
        """The next Rollout asked for (the learner's time/generation_s: its wait for it), with greedy its greedy
        completions (rollout.greedy, the same weights); first asks for more, up to K + 1 batches (prompts.next():
        async_sampling.draw), none past the last step's."""
        trainer, step = self.trainer, self.trainer.at_step
        if trainer.cfg.reward_fn:  # their trainer_state: the steps done so far
            reward_functions.trainer_state().global_step = step - 1
        if self.version.value < 0:  # the first call: the weights at the start (--resume_from: the checkpoint's)
            trainer.timer.spans = []
            self.publish(step - 1)
        while len(self.asked) < min(self.ahead + 1, trainer.cfg.num_steps - step + 1):
            state = copy.deepcopy(prompts.state_dict())  # before the draw: a checkpoint taken while it is ahead
            examples, num_samples = draw(prompts)
            self.asked.append((examples, num_samples, greedy, state))
            self.requests.put((step - 1, examples, num_samples, greedy))
        with trainer.timer("generation"):
            (examples, num_samples, greedy, _), out = self.asked.popleft(), tensors(self.receive())
        rollout = self.unpack(examples, num_samples, out)
        rollout.sampler_logp = out["logp"].to(rollout.mask.device)
        rollout.ref_logp = None if out["ref_logp"] is None else out["ref_logp"].to(rollout.mask.device)
        rollout.version = torch.full((len(rollout),), out["version"], device=rollout.mask.device)
        rollout.greedy = self.unpack(examples, 1, out["greedy"]) if greedy else None  # the same weights
        if isinstance(self.sample, tree.Sampling):  # train/decoded_per_completion: the tokens the process decoded
            self.sample.decoded, self.sample.completions = self.sample.decoded + int(rollout.mask.sum()), \
                self.sample.completions + len(rollout)
        self.received.append((rollout.version, out["times"]))
        self.sampler_spans += out["spans"]
        return rollout

    def rewound(self):
        """The prompt sampler's state before the oldest batch asked for and not yet taken (None: nothing is ahead),
        which a checkpoint saves: the resumed run draws those prompts again, and so trains on the prompts of the
        run it continues, in the same order (sampled with the checkpoint's weights)."""
        return self.asked[0][3] if self.asked else None

    def unpack(self, examples, num_samples, batch):
        """A Rollout of one of the sampler's batches (`draw_batch`'s, with its texts and rewards), on the learner's
        device, each prompt's num_samples rows adjacent; its rewards: None with --reward_model (the learner's)."""
        trainer, device = self.trainer, self.trainer.accelerator.device
        prompt_ids, prompt_mask, completion_ids, mask, token_mask = (batch[key].to(device) for key in (
            "prompt_ids", "prompt_mask", "completion_ids", "mask", "token_mask"))
        trainer.generated += len(completion_ids)
        rollout = LabRollout([ex for ex in examples for _ in range(num_samples)], prompt_ids, prompt_mask,
                             completion_ids, mask, batch["completions"], group_size=num_samples,
                             episodes=batch["episodes"], token_mask=None if batch["episodes"] is None else token_mask)
        rewards = batch["rewards"]
        rollout.rewards = None if rewards is None else (rewards[0].to(device), rewards[1].to(device), *rewards[2:])
        return rollout

    def receive(self):
        """The next batch from the sampler process; its death (or an error it sent) stops the learner."""
        while True:
            try:
                out = self.results.get(timeout=POLL_S)
                break
            except queue.Empty:
                pass
            except (ConnectionError, EOFError):  # a batch half sent: the process died while its feeder wrote it
                self.process.join(timeout=10)
                if self.process.is_alive():
                    raise
            if not self.process.is_alive():
                raise SystemExit(f"error: the sampler process died (exit code {self.process.exitcode}) before "
                                 "sending its batch.") from None
        if "error" in out:
            raise SystemExit(out["error"])
        return out

    @torch.no_grad()
    def publish(self, version):
        """The learner's weights into shared memory, for the sampler's next batch, with their version (steps done)."""
        with self.trainer.timer("publish"), models.gathered_parameters(self.model), self.lock:  # ZeRO-3: once
            for shared, p in zip(self.weights, self.params):
                shared.copy_(p.detach())
            self.version.value = version

    def close(self):
        """After the last step: the sampler process stopped and joined (several learner processes leave with os._exit,
        which ends no daemon process). Once: the trainer's finish calls it again."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.requests.put("stop")
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for channel in (self.requests, self.results):
            channel.close()
            channel.join_thread()
        # their semaphores released now: os._exit would leave them to the resource tracker, which warns
        self.process = self.requests = self.results = self.version = self.lock = None

    def end_step(self, step):
        """After the step's update: its weights published, and the step's metrics: train/staleness_mean and _max
        over the rows sampled for it (the steps between the weights that sampled each row and the learner's), the
        sampler's seconds per phase for them; the step's spans appended to output_dir/timeline.jsonl."""
        if step < self.trainer.cfg.num_steps:
            self.publish(step)
        else:
            self.close()
        staleness = (step - 1 - torch.cat([version for version, _ in self.received])).float()
        times = collections.Counter()
        for _, phases in self.received:
            times.update(phases)
        self.received = []
        if self.timeline:
            with open(self.timeline, "a") as f:
                f.write(json.dumps({"step": step, "learner": self.trainer.timer.spans,
                                    "sampler": self.sampler_spans}) + "\n")
        self.trainer.timer.spans, self.sampler_spans = [], []
        return {"train/staleness_mean": staleness.mean(), "train/staleness_max": staleness.max(),
                **{f"time/{phase}_s": seconds for phase, seconds in times.items()}}


def serve(cfg, seed, weights, version, lock, requests, results, parent_pid, threads, device, reward_scorer, play):
    """The sampler process: for each request (the learner's version then, examples, G, greedy), wait for those
    weights or newer, load the newest, sample G completions per prompt or play G episodes (`draw_batch`; with greedy
    also each prompt's greedy one, the same weights), score them with the reference (with a KL term: as the learner's
    trainer.reference_logprobs would, at the sampling temperature on the whole distribution), reward them
    (reward_scorer: tasks.reward_scorer, the learner's reward function; not with --reward_model, which stays in the
    learner's process), and send them with the version that sampled them (also the reward functions'
    trainer_state().global_step) and the wall-clock spans of each phase. It samples on the learner's device (a GPU:
    the same one), reads the weights from shared CPU memory and sends CPU arrays. seed: the one its learner's rank
    samples with in a synchronous run (cfg.seed + its process index). play: sampling.play, which plays an
    environment's episodes (passed in: lab/sampling.py imports this module)."""
    from transformers.utils import logging

    tool_process.die_with_parent()  # killed with the learner, even in the middle of a batch
    leave_if_orphaned(parent_pid)  # (the learner may have gone before that line)
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the learner, which saves and ends; then so does this
    # no progress bar: its tqdm lock is a named semaphore, which a sampler killed would leave for the learner to report
    logging.disable_progress_bar()
    try:
        tokenizer, model = models.load_tokenizer(cfg), models.load_model(cfg, trainable=False)
        if cfg.lora_r > 0:  # the policy's adapter, frozen here: the learner publishes its weights only
            model = models.add_lora(model, models.lora_config(cfg, "CAUSAL_LM")).eval().requires_grad_(False)
        model = model.to(device)
        reference = None
        if holds_reference(cfg):  # under LoRA the policy with its adapter off, as the learner's would be
            reference = models.load_reference(cfg, model).to(device)
        params, have = [dict(model.named_parameters())[name] for name in weights], -1
        weights = list(weights.values())
        score = decode.token_logprobs if cfg.fast else common.token_logprobs
        environment = environments.load(cfg, tokenizer)  # --environment / --tools: the episodes are played here
        # --sampler vllm: the engine draws for this process, taking each version of the weights it publishes
        engine = vllm_engine.Engine(cfg, torch.device(device), seed - cfg.seed) if cfg.sampler == "vllm" else None
        reward = None if cfg.reward_model else reward_scorer(cfg, device)  # one reward model: the learner's
        torch.manual_seed(seed)  # the seed this rank's learner samples with in a synchronous run (LoRA's init drew)
        while (request := receive(requests, parent_pid)) != "stop":
            oldest, examples, num_samples, greedy = request
            spans, start = [], time.time()
            while version.value < oldest:  # bounded staleness: the learner's weights when it asked, or newer
                leave_if_orphaned(parent_pid)
                time.sleep(POLL_S)
            with lock, torch.no_grad():  # no_grad: peft's disable_adapter (the reference) makes the adapter trainable
                if version.value != have:
                    have = version.value
                    for p, w in zip(params, weights, strict=True):
                        p.copy_(w)
                    if engine is not None:
                        engine.weights_changed()
            spans.append(("wait", start, time.time()))
            with torch.inference_mode():
                out = draw_batch(model, tokenizer, environment, play, examples, num_samples, cfg, device, engine)
                out["greedy"] = draw_batch(model, tokenizer, environment, play, examples, 1, cfg, device, engine,
                                           greedy=True) if greedy else None
                spans.append(("generation", spans[-1][2], time.time()))
                ids, n = torch.cat([out["prompt_ids"], out["completion_ids"]], 1), out["mask"].shape[1]
                attention = torch.cat([out["prompt_mask"], out["token_mask"]], 1)

                def scored(by, **sampling):  # by's (B, T) log-probs of the completions, micro-batch by micro-batch
                    return torch.cat([score(by, ids[s], attention[s], n, cfg.temperature, **sampling)
                                      for s in micro_batches(len(ids), cfg.micro_batch_size)])
                if out["logp"] is None:  # the plain definition (--fast False): a pass that scores the draws
                    out["logp"] = scored(model, top_k=cfg.top_k, top_p=cfg.top_p)
                out["ref_logp"] = None if reference is None else scored(reference)
                spans.append(("scoring", spans[-1][2], time.time()))
            reward_functions.trainer_state().global_step = have
            for batch, rows in ((out, [ex for ex in examples for _ in range(num_samples)]), (out["greedy"], examples)):
                if batch is not None:
                    batch["completions"] = tasks.decode_completions(tokenizer, batch["completion_ids"],
                                                                    batch["token_mask"], batch["episodes"])
                    batch["rewards"] = None if reward is None else reward(rows, batch["completions"])
                    for episode in batch["episodes"] or []:  # the environments stay here; their records go
                        episode.env = None
            spans.append(("reward", spans[-1][2], time.time()))
            results.put({**arrays(out), "version": have, "spans": spans,
                         "times": {f"sampler_{phase}": end - begin for phase, begin, end in spans}})
        results.cancel_join_thread()  # "stop": the learner takes no more batches, so one sent ahead need not wait
        if engine is not None:
            engine.close()
    except (Exception, SystemExit) as e:  # one line for the learner to print (an environment's is one already)
        results.put({"error": str(e) if isinstance(e, SystemExit) else f"error: the sampler process failed: "
                     f"{type(e).__name__}: {e} (in {traceback.extract_tb(e.__traceback__)[-1].name})"})
        time.sleep(1)  # the queue's feeder thread sends it before the process ends


def draw_batch(model, tokenizer, environment, play, examples, num_samples, cfg, device, engine=None, greedy=False):
    """num_samples completions of each example's prompt (greedy: one greedy completion), or with an environment its
    episodes (play: sampling.play), each example's rows adjacent: a dict of per-row prompt_ids, prompt_mask,
    completion_ids, mask (the actions), token_mask, episodes (None without an environment) and logp, the log-probs
    of the draws taken as they were drawn (decode.generate(logprobs=True), agents.CachedTurns, a vLLM engine's: mu at no
    extra pass), else None (--fast False: scored after; greedy: not needed). engine: --sampler vllm's, or None."""
    if environment is not None:  # logp: the actions' log-probs as drawn (None under --fast False; greedy: none)
        played = play(model, tokenizer, environment, examples, cfg, num_samples, greedy, logprobs=not greedy)
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "mask", "token_mask", "episodes", "logp")
        return {"logp": None, **dict(zip(keys, played))}
    k = 1 if greedy else num_samples
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples], device)
    if engine is not None:
        completion_ids, logp = engine.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, k, greedy, logprobs=True)
        logp = None if greedy else logp
    elif cfg.fast and not greedy:
        completion_ids, logp = decode.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, k, logprobs=True)
    else:
        sample = decode.generate if cfg.fast else common.generate
        completion_ids, logp = sample(model, tokenizer, prompt_ids, prompt_mask, cfg, k, greedy=greedy), None
    mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
    return {"prompt_ids": prompt_ids.repeat_interleave(k, dim=0), "prompt_mask": prompt_mask.repeat_interleave(k, 0),
            "completion_ids": completion_ids, "mask": mask, "token_mask": mask, "episodes": None, "logp": logp}


def holds_reference(cfg):
    """Whether the sampler process holds the frozen reference: with a KL term to it (beta > 0), which is when the
    loops load one (engine.load_models then leaves it out of the learner's process)."""
    return getattr(cfg, "beta", 0) > 0


def split_threads(device):
    """The sampler process's threads; on the CPU the learner gives it half of its own (at least one each), so the
    two processes do not fight over the same cores (each with all of them, both run slower than one alone)."""
    threads = torch.get_num_threads()
    if device.type != "cpu":
        return threads
    torch.set_num_threads(max(1, threads - threads // 2))
    return max(1, threads // 2)


def arrays(x):
    """A CPU tensor as a numpy array, which the queue pickles by value (a torch tensor would go through a shared-
    memory file per tensor: milliseconds per batch); a tuple or dict: each of its items; anything else: itself."""
    if isinstance(x, dict):
        return {key: arrays(value) for key, value in x.items()}
    if isinstance(x, tuple):
        return tuple(map(arrays, x))
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


def tensors(x):
    """arrays' inverse, in the learner's process."""
    if isinstance(x, dict):
        return {key: tensors(value) for key, value in x.items()}
    if isinstance(x, tuple):
        return tuple(map(tensors, x))
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def receive(requests, parent_pid):
    """The learner's next request, waiting as long as the learner runs."""
    while True:
        leave_if_orphaned(parent_pid)
        try:
            return requests.get(timeout=POLL_S)
        except queue.Empty:
            pass


def leave_if_orphaned(parent_pid):
    """Exit when the learner that started this process has gone (its children are adopted: the parent id changes)."""
    if os.getppid() != parent_pid:
        os._exit(0)
