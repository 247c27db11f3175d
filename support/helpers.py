"""The plain helpers of the lesson files (remax.py, rloo.py, grpo.py, dapo.py, ppo.py): data in, data out. Loading
(the accelerator, the data, the policy and its optimizer, the reference), the batch a step works on (`Rollout`, and
its micro-batches), sampling it, scoring it with no gradient, the metrics of an update, evaluation, logging,
checkpoints. None keeps state a loop does not see; the update itself (micro-batches, backward, clip, optimizer step)
is written out in each loop. The lab's engine (lab/engine.py) runs on the same pieces."""
import atexit
import copy
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

import common
from support import config, models, run, tasks
from support.config import (  # noqa: F401 (the lessons')
    AT_LEAST_ONE, EMBEDDED_TEACHER, FRACTION, NON_NEGATIVE, POSITIVE, PROBABILITY, TrainConfig, arg, check,
    check_rules, one_of)
from support.models import generate, token_logprobs
from support.tasks import make_reward_fn  # noqa: F401 (the lessons')

parse_config = config.parse_config


# ---- setup ----
def make_accelerator(cfg):
    """An Accelerator that falls back to CPU (gloo between processes) when there is no GPU, so `accelerate launch
    --multi_gpu --num_processes 2 x.py` (or `torchrun --nproc_per_node 2`) gives 2-process data parallelism on a
    laptop. (`accelerate launch --cpu --num_processes 2` starts ONE process in accelerate 1.x unless an MPI
    hostfile is given.) A DeepSpeed config (configs/zero2.yaml, zero3.yaml) stays DeepSpeed without a GPU too:
    DeepSpeed's CPU accelerator, gloo between processes; its settings come from the flags (deepspeed_settings)."""
    from accelerate import Accelerator

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true")
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    if deepspeed and not torch.cuda.is_available():
        from accelerate import PartialState

        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported, just below
        PartialState(backend="gloo")  # else accelerate finds no backend: every process would think it is rank 0
    # cpu=True would silently turn a DeepSpeed config into plain multi-process CPU data parallelism
    cpu = (not torch.cuda.is_available() or use_cpu) and not deepspeed
    accelerator = Accelerator(cpu=cpu, log_with=None if cfg.report_to == "none" else cfg.report_to,
                              project_dir=cfg.output_dir)
    if accelerator.is_main_process:
        config.lock_output_dir(cfg.output_dir)  # a second run on this --output_dir stops with one line
    if accelerator.state.deepspeed_plugin is not None:
        deepspeed_settings(accelerator.state.deepspeed_plugin.deepspeed_config, cfg, accelerator.num_processes)
    return accelerator


def deepspeed_settings(ds_config, cfg, num_processes):
    """Set what DeepSpeed reads from the flags, in place: the micro-batch (no dataloader is prepared, so DeepSpeed
    cannot infer it), clipping at --max_grad_norm (DeepSpeed clips inside its step), and one micro-batch per
    optimizer step as DeepSpeed counts them: the loops weigh and accumulate the micro-batches themselves, so
    DeepSpeed must not divide the loss again."""
    accumulation = ds_config.get("gradient_accumulation_steps", 1)
    if accumulation not in (1, "auto"):
        raise SystemExit(f"error: the DeepSpeed config's gradient_accumulation_steps is {accumulation}: set it to 1; "
                         "--micro_batch_size splits each batch into micro-batches and accumulates them.")
    ds_config["gradient_accumulation_steps"] = 1
    ds_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size or cfg.batch_size
    ds_config["train_batch_size"] = ds_config["train_micro_batch_size_per_gpu"] * num_processes
    ds_config["gradient_clipping"] = cfg.max_grad_norm  # 0 = off, as the flag
    return ds_config


def check_groups(cfg):
    """The group methods' --num_generations: G >= 2 samples per prompt (the group is the baseline), dividing
    --batch_size (batch_size / G prompts are sampled per step)."""
    G = cfg.num_generations
    check(G >= 2, f"--num_generations must be >= 2: the group is the baseline (got {G}).")
    check(cfg.batch_size % G == 0, f"--batch_size ({cfg.batch_size}) must be divisible by --num_generations ({G}): "
          "batch_size / num_generations prompts are sampled per step.")


def load_data(cfg, accelerator):
    """The tokenizer and the (train, eval) examples; the main process downloads first, the others read its cache."""
    with accelerator.main_process_first():
        tokenizer = models.load_tokenizer(cfg)
        try:
            train_data, eval_data = tasks.load_task(cfg, tokenizer)
        except SystemExit as e:  # a data error that names a lab flag: in a lesson script, which script has it
            raise SystemExit(config.where_the_flags_are(str(e))) from None
    models.check_prompts_tokenize(tokenizer, train_data + eval_data, cfg, accelerator.is_main_process)
    return tokenizer, train_data, eval_data


def load_models(cfg, accelerator, reference):
    """(policy, reference, optimizer): the policy (full or LoRA) and its AdamW, prepared (DDP or DeepSpeed), the same
    weights on every rank once main() has set the seed (set_seed(cfg.seed): a LoRA adapter's initial weights are
    drawn); the frozen reference pi_ref (None unless `reference`), in the policy's precision."""
    policy = models.load_model(cfg)
    ref_model = models.load_reference(cfg, policy) if reference else None
    optimizer, scheduler = models.make_optimizer(policy, cfg)  # a constant learning rate (lab: --warmup_steps)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    return policy, models.prepare_frozen(accelerator, ref_model), optimizer


def load_teacher(cfg, accelerator):
    """opd.py's frozen teacher (--teacher, any causal LM with the student's tokenizer), on the device and in the
    policy's precision as a reference is."""
    teacher_cfg = copy.copy(cfg)
    teacher_cfg.model_name_or_path, teacher_cfg.lora_r = cfg.teacher, 0
    return models.prepare_frozen(accelerator, models.load_model(teacher_cfg, trainable=False))


def prompt_sampler(train_data, num_prompts, cfg, accelerator):
    """Endless shuffled batches of num_prompts examples (.next()), each process from its own shard."""
    return tasks.PromptSampler(train_data, num_prompts, cfg.seed, accelerator.process_index, accelerator.num_processes)


# ---- the batch a step works on: the rollout, one row per completion, and its micro-batches ----
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
        parts = first_rows(rollouts, limit)
        width = prompt_width(parts)
        return Rollout([ex for r in parts for ex in r.examples],
                       pad([r.prompt_ids for r in parts], pad_token_id, width, left=True),
                       pad([r.prompt_mask for r in parts], 0, width, left=True),
                       pad([r.completion_ids for r in parts], pad_token_id), pad([r.mask for r in parts], 0),
                       [c for r in parts for c in r.completions])


def first_rows(rollouts, limit=None):
    """The rollouts cut to their first `limit` rows in all (default: all), the empty ones left out."""
    parts, remaining = [], sum(map(len, rollouts)) if limit is None else limit
    for r in rollouts:
        if remaining > 0 and len(r) > 0:
            parts.append(r.select(torch.arange(len(r), device=r.mask.device) < remaining))
            remaining -= len(parts[-1])
    return parts


def prompt_width(rollouts):
    """The longest prompt of the rollouts, in tokens: the left padding no row needs goes."""
    return max(int(r.prompt_mask.sum(1).max()) for r in rollouts)


def pad(tensors, value, width=None, left=False):
    """The tensors along dim 1, each padded with value to `width` (default: the widest) on the right (left: on the
    left, cut to its last `width` columns), concatenated along the rows."""
    width = width or max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        t = t[:, -width:] if left else t
        out.append(t.new_full((len(t), width, *t.shape[2:]), value))
        (out[-1][:, width - t.shape[1]:] if left else out[-1][:, :t.shape[1]]).copy_(t)
    return torch.cat(out)


def micro_batches(batch_size, micro_batch_size):
    """Slices of consecutive rows that cover range(batch_size), micro_batch_size rows each (the last may be
    smaller); 0 gives one slice, the whole batch."""
    size = micro_batch_size or batch_size
    return [slice(start, min(start + size, batch_size)) for start in range(0, batch_size, size)]


# ---- sampling and scoring, with no gradient ----
@torch.no_grad()
def sample(policy, tokenizer, examples, cfg, accelerator, num_samples=1, greedy=False):
    """A Rollout: num_samples completions of each example's prompt (or one greedy completion), each example's
    samples adjacent, with their mask (1 up to and including the first EOS) and their text."""
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples], accelerator.device)
    completion_ids = generate(accelerator.unwrap_model(policy), tokenizer, prompt_ids, prompt_mask, cfg,
                              num_samples=num_samples, greedy=greedy).clone()
    k = len(completion_ids) // len(examples)
    mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
    return Rollout([ex for ex in examples for _ in range(k)], prompt_ids.repeat_interleave(k, 0),
                   prompt_mask.repeat_interleave(k, 0), completion_ids, mask,
                   tasks.decode_completions(tokenizer, completion_ids, mask))


@torch.no_grad()
def score(model, rollout, cfg, truncated=True):
    """(B, T) log-probs of the rollout's completions under `model`, --micro_batch_size rows at a time: at the
    sampling temperature, and (truncated) on the top-k / top-p distribution that was sampled; the reference is
    scored on its whole distribution."""
    sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p} if truncated else {}
    num_tokens = rollout.mask.shape[1]
    return scoring_pass(rollout, cfg.micro_batch_size, lambda ids, mask: token_logprobs(
        model, ids, mask, num_tokens, cfg.temperature, **sampling)).clone()


def scoring_pass(rollout, micro_batch_size, fn):
    """fn(input_ids, attention_mask) over the rollout's micro-batches of rows, concatenated along the rows."""
    return torch.cat([fn(rollout.input_ids[rows], rollout.attention_mask[rows])
                      for rows in micro_batches(len(rollout), micro_batch_size)])


def any_process(accelerator, flag):
    """True on every process when `flag` is True on one of them."""
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "sum") > 0)


def fewest(accelerator, n):
    """The smallest of the processes' values of the integer n."""
    return min(accelerator.gather(torch.tensor([n], device=accelerator.device)).tolist())


def fill_batch(rounds, n, cfg, tokenizer, step):
    """DAPO's dynamic sampling: the first n rows the rounds kept (n: as many on every process, the fewest any kept,
    at most --batch_size: they step together), as one (rollout, rewards, correct) padded as if sampled together, or
    three Nones when n is 0 (every process skips the step); the rounds' mean reward_stats; and the metrics of the
    sampling. rounds: (rollout, rewards, correct, keep: (B,) bool, reward_stats) of each round. Warns when
    --max_sampling_rounds ended before this process's batch was full."""
    kept = [(rollout.select(keep), rewards[keep], correct[keep]) for rollout, rewards, correct, keep, _ in rounds]
    held, sampled = sum(len(rollout) for rollout, _, _ in kept), torch.cat([r[1] for r in rounds])
    if held < cfg.batch_size:
        print(f"warning: step {step}: --max_sampling_rounds {cfg.max_sampling_rounds} reached with "
              f"{held // cfg.num_generations} groups kept on this process; " +
              ("skipping the step" if n == 0 else "training on those") +
              ". Raise --max_sampling_rounds to fill the batch.", file=sys.stderr, flush=True)
    stats = [r[4] for r in rounds]
    reward_stats = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
    metrics = {"train/skipped_step": float(n == 0), "train/sampling_rounds": len(rounds),
               "train/groups_dropped": (len(sampled) - held) // cfg.num_generations,
               "train/groups_kept": n // cfg.num_generations,
               "train/reward_sampled": sampled.mean()}
    if n == 0:
        return None, None, None, reward_stats, metrics
    rollouts = [rollout for rollout, _, _ in kept]  # the rollouts' own cat: the lab's keep more of each row
    rollout = type(rollouts[0]).cat(rollouts, tokenizer.pad_token_id, limit=n)
    rewards, correct = torch.cat([r for _, r, _ in kept])[:n], torch.cat([c for _, _, c in kept])[:n]
    return rollout, rewards, correct, reward_stats, metrics


# ---- the update's numbers ----
def combine(shares_and_stats):
    """One value per statistic of an update from its micro-batches' (token share, stats): a plain value is a mean
    over the micro-batch's tokens, combined by the token shares; a common.Extreme takes the max or min; a
    common.Sums adds its sums over the micro-batches, then finishes (a fraction of sequences, an effective sample
    size): each the same with or without --micro_batch_size."""
    out = {}
    for key in shares_and_stats[0][1] if shares_and_stats else ():
        values = [stats[key] for _, stats in shares_and_stats]
        if isinstance(values[0], common.Extreme):
            stacked = torch.stack([torch.as_tensor(v.value, dtype=torch.float32) for v in values])
            out[key] = stacked.max() if values[0].reduce == "max" else stacked.min()
        elif isinstance(values[0], common.Sums):
            out[key] = values[0]._replace(sums=[sum(parts) for parts in zip(*(v.sums for v in values))]).value()
        else:
            out[key] = sum(share * v for (share, _), v in zip(shares_and_stats, values))
    return out


def check_finite(accelerator, loss, grad_norm, step):
    """Stop every rank, before the optimizer step, when the loss or the gradient norm is not finite on one of them
    (under fp16 loss scaling an inf norm is an overflow the optimizer step skips: not an error)."""
    norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, device=accelerator.device)
    bad = ~torch.isfinite(loss.detach()).all() | (~torch.isfinite(norm).all() & ~run.loss_scaling(accelerator))
    if accelerator.reduce(bad.float(), reduction="sum") > 0:
        raise SystemExit(f"error: non-finite loss ({loss.item()}) or gradient norm ({norm.tolist()}) at step {step}; "
                         "the update was not applied. Lower --learning_rate, keep --max_grad_norm on, or check the "
                         "rewards.")


# ---- the run: steps, evaluation, logging, checkpoints ----
resume = run.load_checkpoint  # the step to start after: 0, or --resume_from's, its state and prompt order loaded
open_log = run.MetricLogger  # output_dir/metrics.jsonl: a resumed run keeps its rows up to its step


def steps(cfg, start_step, accelerator):
    """The step numbers still to run, with a progress bar on the main process."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return tqdm(range(start_step + 1, cfg.num_steps + 1), desc=name, disable=accelerator.process_index > 0)


evaluate = tasks.evaluate  # held-out greedy accuracy of the policy, overall and per family (eval/acc_<family>)


def log_step(logger, step, metrics, rollout, rewards, started, evaluation=None):
    """Average the step's metrics over the processes, add the completions' length and the step's seconds, and log
    them (with the evaluation's when there is one) and two samples (none when rollout is None: a step skipped).
    `started`: time.time() when the step began."""
    metrics = {**metrics, "time/step_s": time.time() - started}
    samples = ()
    if rollout is not None:
        metrics["train/completion_len"] = rollout.mask.sum(1).float().mean()
        samples = zip(rollout.prompts, rollout.completions, rewards.tolist())
    metrics = run.reduce_metrics(logger.accelerator, metrics)
    logger.log(step, {**metrics, **(evaluation or {})}, samples=samples)


def save_checkpoint(cfg, accelerator, step, policy, tokenizer, prompts):
    """Every --save_steps: output_dir/checkpoint-N, complete or absent, from finite weights only."""
    if cfg.save_steps and step % cfg.save_steps == 0:
        check_weights(accelerator, step, policy, tokenizer, prompts)
        run.save_checkpoint(cfg, accelerator, step, policy, tokenizer, prompts.state_dict())


def check_weights(accelerator, step, policy, tokenizer, prompts):
    """Stop every rank when the policy's weights, or its logits on a training prompt, are not finite on one."""
    if not run.all_finite(accelerator, policy, tokenizer, [ex["prompt"] for ex in prompts.examples[:1]]):
        raise SystemExit(f"error: the update of step {step} made the policy's weights or logits non-finite; nothing "
                         "was saved from them. Lower --learning_rate.")


def finish(cfg, accelerator, logger, policy, tokenizer, prompts):
    """summary.json and curves.png, and the final policy saved (output_dir/final, from finite weights only)."""
    logger.finish(policy)
    check_weights(accelerator, cfg.num_steps, policy, tokenizer, prompts)
    models.save_model(accelerator, policy, tokenizer, f"{cfg.output_dir}/final")
    accelerator.wait_for_everyone()


# ---- the process ----
def launch(main):
    """Run main() as one process of a run: the only code that controls the process, called by each script's
    `if __name__ == "__main__"` (importing a script, or calling its main() from a test, does none of it).

    - One CPU thread for this process and those it starts, as `accelerate launch` and torchrun give every process
      they start, unless OMP_NUM_THREADS says otherwise: the process starts again (os.execv, the same command) with
      OMP_NUM_THREADS=1, read by torch at import (docs/troubleshooting.md: why, and what it measured).
    - The process group closed on every rank at the end, after an error too (close_process_group, registered with
      atexit so that it runs after the interpreter has printed the error); several processes then leave at once
      (leave_run), with exit code 0 after main() returned, 1 after an error."""
    if not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    atexit.register(close_process_group, code=1)  # main() did not return: an error, already printed
    main()
    close_process_group(code=0)


def close_process_group(code):
    """Close the process group, if there is one, and with several processes leave (leave_run) with `code`."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        num_processes = torch.distributed.get_world_size()
        torch.distributed.destroy_process_group()
        leave_run(num_processes, code)


def leave_run(num_processes, code=0):
    """The last call of a run on every rank, after the process group is closed. One process returns. Several
    leave at once (os._exit(code), after flushing what they printed) rather than tear the interpreter down, where a
    gloo worker thread still releasing a finished collective's tensors aborts the rank (SIGABRT) after a complete
    run, about once in 50 two-process runs on 2 busy cores (docs/scaling.md)."""
    if num_processes > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
