"""--async_rollouts K (docs/async.md): a sampler in its own process, with its own copy of the policy, samples the next
batches while the learner trains on this one, at most K optimizer steps ahead. The learner writes its weights into
shared memory after each step with a version (the steps done); the sampler reads the newest before each batch, and
waits when it would sample batch t with weights older than those after step t - 1 - K. Each rollout comes back with
the version that sampled it and the sampler's own log-probs (its scoring pass): the behaviour policy mu of the
decoupled objective, which TIS, the geometric mask, the veto and M2PO correct as with --rollout_lag.

The sampler never outlives the learner: it is a daemon process (ended when the learner exits normally) and checks
between waits that its parent still runs (a learner killed with SIGKILL). A sampler that dies stops the learner with
one line naming the cause."""
import collections
import os
import queue
import signal
import time
import traceback

import torch
import torch.multiprocessing as mp

import common
from support import fast, models, reward_functions, tasks, tree
from support.rollout import Rollout, micro_batches

POLL_S = 0.05  # how often a waiting process checks the other one


def check(cfg, accelerator):
    """Before any model loads: the combinations the sampler process does not support yet, one line each."""
    from transformers import AutoConfig

    refuse = [(accelerator.num_processes > 1, "several processes (DDP): run one learner process"),
              (accelerator.state.deepspeed_plugin is not None, "DeepSpeed: run without it"),
              (cfg.lora_r > 0, "--lora_r: train the whole model"),
              (cfg.rollout_lag > 0 or cfg.rollout_dtype != cfg.torch_dtype,
               "--rollout_lag or --rollout_dtype: the sampler process is the stale copy"),
              (cfg.resume_from != "", "--resume_from: the sampler's queue is not in the checkpoint"),
              (getattr(cfg, "budget", "uniform") != "uniform", "--budget knapsack: it allocates from fresh outcomes"),
              (getattr(cfg, "sampler", "independent") != "independent", "--sampler tree: the process samples each "
               "completion on its own")]
    model_config = AutoConfig.from_pretrained(cfg.model_name_or_path)
    refuse.append((any(getattr(model_config, name, 0) for name in ("num_experts", "num_local_experts")),
                   "a mixture-of-experts policy: its routing is not replayed across processes"))
    for refused, what in refuse:
        if refused:
            raise SystemExit(f"error: --async_rollouts does not run with {what}.")


class AsyncRolloutSampler:
    """The learner's side: starts the sampler process with the policy's weights (version 0), asks it for the
    batches of the next K + 1 steps, hands the trainer one per step, and publishes the weights after each step."""

    def __init__(self, trainer, policy, sample):
        self.trainer, self.ahead = trainer, trainer.cfg.async_rollouts
        self.params = [p for p in trainer.accelerator.unwrap_model(policy.model).parameters()]
        ctx = mp.get_context("spawn")
        self.weights = [p.detach().to("cpu", copy=True).share_memory_() for p in self.params]
        self.version, self.lock = ctx.Value("i", 0), ctx.Lock()
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.asked = collections.deque()  # the examples of the batches asked for, in order
        self.last = None  # this step's rollout and the sampler's seconds per phase for it
        self.sample = sample  # the prompt sampler's (tasks.PromptSampler.sample_with): the process reports to it
        self.process = ctx.Process(target=serve, daemon=True, name="sampler", args=(
            trainer.cfg, self.weights, self.version, self.lock, self.requests, self.results, os.getpid(),
            torch.get_num_threads()))
        self.process.start()

    def rollout(self, prompts):
        """This step's Rollout, sampled ahead (the learner's time/generation_s: its wait for it); asks for the batch
        K + 1 steps on (prompts.next(): its examples and the completions of each, budget.BudgetSampler). After the
        last step's batch the sampler process stops."""
        trainer, step = self.trainer, self.trainer.at_step
        if trainer.cfg.reward_fn:  # their trainer_state: the steps done so far
            reward_functions.trainer_state().global_step = step - 1
        last = min(step + self.ahead, trainer.cfg.num_steps)  # the first call asks for K + 1 batches
        while step + len(self.asked) <= last:
            self.asked.append(prompts.next())
            examples, num_samples = self.asked[-1]
            self.requests.put((step + len(self.asked) - 1, [ex["prompt"] for ex in examples], num_samples))
        with trainer.timer("generation"):
            (examples, num_samples), out = self.asked.popleft(), self.receive()
        if out["step"] != step:
            raise SystemExit(f"error: the sampler process sent the batch of step {out['step']} at step {step}.")
        if step == trainer.cfg.num_steps:
            self.requests.put("stop")
        device = trainer.accelerator.device
        prompt_ids, prompt_mask = out["prompt_ids"].to(device), out["prompt_mask"].to(device)
        completion_ids, mask = out["completion_ids"].to(device), out["mask"].to(device)
        rollout = Rollout([ex for ex in examples for _ in range(num_samples)], prompt_ids, prompt_mask,
                          completion_ids, mask, tasks.decode_completions(trainer.tokenizer, completion_ids, mask),
                          group_size=num_samples)
        rollout.sampler_logp = out["logp"].to(device)
        rollout.version = torch.full((len(rollout),), out["version"], device=device)  # the weights after that step
        trainer.generated += len(rollout)
        if isinstance(self.sample, tree.Sampling):  # train/decoded_per_completion: the tokens the process decoded
            self.sample.decoded, self.sample.completions = self.sample.decoded + int(mask.sum()), \
                self.sample.completions + len(mask)
        self.last = rollout, out["times"]
        return rollout

    def receive(self):
        """The next batch from the sampler process; its death (or an error it sent) stops the learner."""
        while True:
            try:
                out = self.results.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise SystemExit(f"error: the sampler process died (exit code {self.process.exitcode}) before "
                                     "sending its batch.") from None
        if "error" in out:
            raise SystemExit(f"error: the sampler process failed: {out['error']}")
        return out

    @torch.no_grad()
    def end_step(self, step):
        """After the step's update: its weights published for the sampler's next batch, and the step's metrics:
        train/staleness_mean and _max over the rollout's rows (the steps between the weights that sampled each row
        and the learner's), and the sampler's seconds per phase."""
        with self.lock:
            for shared, p in zip(self.weights, self.params):
                shared.copy_(p.detach())
            self.version.value = step
        (rollout, times), self.last = self.last, None
        staleness = (step - 1 - rollout.version).float()
        return {"train/staleness_mean": staleness.mean(), "train/staleness_max": staleness.max(),
                **{f"time/{phase}_s": seconds for phase, seconds in times.items()}}


def serve(cfg, weights, version, lock, requests, results, parent_pid, threads):
    """The sampler process: for each request (step, prompts, G), wait for weights no older than step - 1 - K, load
    the newest, sample G completions per prompt and score them, and send them with that version."""
    from transformers.utils import logging

    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the learner, which saves and ends; then so does this
    # no progress bar: its tqdm lock is a named semaphore, which a sampler killed would leave for the learner to report
    logging.disable_progress_bar()
    try:
        torch.manual_seed(cfg.seed)  # the seed the learner samples with in a synchronous run
        tokenizer, model = models.load_tokenizer(cfg), models.load_model(cfg, trainable=False)
        params, have = list(model.parameters()), -1
        sample, score = (fast.generate, fast.token_logprobs) if cfg.fast else (common.generate, common.token_logprobs)
        while (request := receive(requests, parent_pid)) != "stop":
            step, prompts, num_samples = request
            start = time.perf_counter()
            while version.value < step - 1 - cfg.async_rollouts:  # bounded staleness: at most K steps behind
                leave_if_orphaned(parent_pid)
                time.sleep(POLL_S)
            with lock:
                if version.value != have:
                    have = version.value
                    for p, w in zip(params, weights, strict=True):
                        p.copy_(w)
            waited, start = time.perf_counter() - start, time.perf_counter()
            with torch.inference_mode():
                prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, prompts, "cpu")
                completion_ids = sample(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=num_samples)
                mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
                prompt_ids, prompt_mask = (x.repeat_interleave(num_samples, dim=0) for x in (prompt_ids, prompt_mask))
                sampled = time.perf_counter() - start
                ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1)
                logp = torch.cat([score(model, ids[s], attention[s], mask.shape[1], cfg.temperature, top_k=cfg.top_k,
                                        top_p=cfg.top_p) for s in micro_batches(len(ids), cfg.micro_batch_size)])
            results.put({"step": step, "version": have, "prompt_ids": prompt_ids.clone(),
                         "prompt_mask": prompt_mask.clone(), "completion_ids": completion_ids.clone(),
                         "mask": mask.clone(), "logp": logp.clone(), "times": {
                             "sampler_wait": waited, "sampler_generation": sampled,
                             "sampler_scoring": time.perf_counter() - start - sampled}})
    except Exception as e:  # one line for the learner to print
        results.put({"error": f"{type(e).__name__}: {e} (in {traceback.extract_tb(e.__traceback__)[-1].name})"})
        time.sleep(1)  # the queue's feeder thread sends it before the process ends


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
