"""The run's files in --output_dir: the metrics log (metrics.jsonl, a line on the console every --log_every steps),
summary.json and curves.png; and resumable checkpoints (save_checkpoint, load_checkpoint, find_checkpoint), with the
check that stops a run whose weights or logits are not finite. A resume loads no file in a way that can run code:
weights as safetensors, the optimizers', schedulers' and RNG states through torch's weights-only unpickler, and the
rest as JSON (`save_state`, `load_state`). The lab saves on a signal too: lab/checkpointer.py."""
import hashlib
import json
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from support import config, models
from support.models import save_model


# ---- the metrics log, the summary and the curves ----
def reduce_metrics(accelerator, metrics):
    """Mean of every scalar metric across ranks. The values stay on the device until one
    `tolist()`: a float() per metric would wait for the GPU once per metric."""
    keys = sorted(metrics)
    values = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32, device=accelerator.device).reshape(())
                          for k in keys])
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist()))


def shortened(text, limit, keep="start"):
    """text, or its first (keep "start") or last ("end") characters with '...' where the rest was cut."""
    if len(text) <= limit:
        return text
    return text[:limit - 3] + "..." if keep == "start" else "..." + text[-(limit - 3):]


class MetricLogger:
    """Every step to output_dir/metrics.jsonl (+ tensorboard/wandb); a console line every
    log_every steps. Only the main process writes."""

    def __init__(self, cfg, accelerator, start_step=0):
        self.cfg, self.accelerator = cfg, accelerator
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.start = time.time()
        if accelerator.is_main_process:
            os.makedirs(cfg.output_dir, exist_ok=True)
            kept = []  # a resumed run keeps the rows up to its checkpoint
            if start_step and os.path.exists(self.path):
                kept = [r for r in read_metrics(self.path) if r["step"] <= start_step]
            with open(self.path + ".tmp", "w") as f:  # replaced whole: a kill here loses no row
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.path + ".tmp", self.path)
            with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:  # the script tells runs apart
                json.dump({"script": config.script_name(), **asdict(cfg)}, f, indent=2)
        if cfg.report_to != "none":
            accelerator.init_trackers(os.path.basename(cfg.output_dir.rstrip("/")) or "run", config=asdict(cfg))

    def log(self, step, metrics, samples=()):
        """Write one row; every log_every steps also print it (without the KL when --beta is 0: no reference)
        and two (prompt, completion, reward) samples of different prompts above the progress bar."""
        metrics = {"step": step, "time/elapsed_s": round(time.time() - self.start, 3), **metrics}
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.report_to != "none":
            self.accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        if step > 0 and (step % self.cfg.log_every == 0 or step == self.cfg.num_steps):
            no_reference = getattr(self.cfg, "beta", None) == 0  # the KL is not measured: it is not printed
            shown = [f"{name} {metrics[key]:.4g}" for key, name in CONSOLE_KEYS
                     if key in metrics and not (no_reference and key in ("train/kl_seq", "train/kl_k3"))]
            if "time/step_s" in metrics:
                shown.append(f"{metrics['time/step_s']:.3g} s/step")
            tqdm.write(" | ".join([f"step {step}"] + shown))
            samples = list(samples)  # the first of two prompts: a group's samples are adjacent
            for prompt, completion, reward in samples[:1] + [s for s in samples if s[0] != samples[0][0]][:1]:
                tqdm.write(f"  sample {shortened(prompt, 60, keep='end')!r} -> {shortened(completion, 60)!r} "
                           f"reward {reward:.3g}")
        if "eval/accuracy" in metrics:
            accs = [f"{k[len('eval/acc_'):]} {v:.3g}" for k, v in metrics.items() if k.startswith("eval/acc_")]
            tqdm.write(" | ".join([f"eval {step}", f"accuracy {metrics['eval/accuracy']:.3f}"] + accs))

    def finish(self, model):
        """Write summary.json (held-out accuracy before/after, wall time, a weight checksum per
        rank: data-parallel replicas must agree) and curves.png."""
        with models.gathered_parameters(model):  # the whole weights under ZeRO-3, not this rank's shard
            checksum = torch.tensor([sum(p.detach().double().sum() + p.detach().double().abs().sum()
                                         for p in model.parameters())], device=self.accelerator.device)
        checksums = self.accelerator.gather(checksum).tolist()
        shards = models.sharding(model)  # what each rank holds: proves ZeRO sharded
        held = torch.tensor([[shards["params_local"], shards["optimizer_local"]]], dtype=torch.long,
                            device=self.accelerator.device)
        held = self.accelerator.gather(held).tolist()
        if not self.accelerator.is_main_process:
            return
        evals = [r for r in read_metrics(self.path) if "eval/accuracy" in r]
        summary = {"eval_accuracy_before": evals[0]["eval/accuracy"] if evals else None,
                   "eval_accuracy_after": evals[-1]["eval/accuracy"] if evals else None,
                   "wall_time_s": round(time.time() - self.start, 1), "num_processes": self.accelerator.num_processes,
                   "replica_weight_checksums": checksums,
                   "sharding": {"zero_stage": shards["zero_stage"], "params": shards["params"],
                                "trainable": shards["trainable"], "params_per_rank": [h[0] for h in held],
                                "optimizer_state_per_rank": [h[1] for h in held]}}
        with open(os.path.join(self.cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_metrics(self.path, os.path.join(self.cfg.output_dir, "curves.png"))
        print(f"held-out accuracy {summary['eval_accuracy_before']:.3f} -> {summary['eval_accuracy_after']:.3f} "
              f"in {summary['wall_time_s']:.0f}s; metrics, curves.png and summary.json in {self.cfg.output_dir}",
              flush=True)


# (metric, console name) of the metrics line; every metric is in metrics.jsonl and docs/metrics.md
CONSOLE_KEYS = (("train/reward", "reward"), ("train/correct", "correct"), ("train/kl_seq", "kl_seq"),
                ("train/kl_k3", "kl_k3"), ("train/entropy", "entropy"), ("train/grad_norm", "grad_norm"),
                ("train/completion_len", "len"), ("train/routing_mismatch", "routing_mismatch"))
PLOT_KEYS = ("train/reward", "eval/accuracy", "train/kl_seq", "train/entropy", "train/grad_norm",
             "train/completion_len")


def read_metrics(path):
    """The rows of a metrics.jsonl file; a last line that a killed run left unfinished is skipped."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def plot_metrics(jsonl_path, png_path, keys=PLOT_KEYS):
    """One panel per metric versus step, from a metrics.jsonl file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    fig, axes = plt.subplots(2, math.ceil(len(keys) / 2), figsize=(4 * math.ceil(len(keys) / 2), 6))
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


# ---- checkpoints ----
CHECKPOINT_PREFIX, PARTIAL_PREFIX = "checkpoint-", "tmp-checkpoint-"


def list_checkpoints(output_dir):
    """(complete, partial) checkpoint folders in output_dir. Complete: checkpoint-N with its
    trainer_state.json (written last), sorted by N. Partial: what a run stopped while saving left
    behind (tmp-checkpoint-N, or checkpoint-N without trainer_state.json)."""
    complete, partial = [], []
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    for name in names:
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(PARTIAL_PREFIX) and name[len(PARTIAL_PREFIX):].isdigit():
            partial.append(path)
        elif name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX):].isdigit():
            (complete if os.path.isfile(os.path.join(path, "trainer_state.json")) else partial).append(path)
    return sorted(complete, key=checkpoint_step), sorted(partial)


def checkpoint_step(path):
    return int(os.path.basename(os.path.normpath(path)).rsplit("-", 1)[1])


def trainer_state(cfg, step, world_size, script=None, files=None):
    """What trainer_state.json records: the step, what made the checkpoint (the script, the world size
    and every flag, the model among them), which a resume is checked against, and the size and SHA-256
    of every other file of the checkpoint (`files`, from file_records), which a resume verifies."""
    script = script or config.script_name()
    return {"step": step, "script": script, "world_size": world_size, "config": asdict(cfg), "files": files or {}}


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(folder):
    """{relative path: {"bytes", "sha256"}} of every file under folder but trainer_state.json."""
    records = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            if relative != "trainer_state.json":
                records[relative] = {"bytes": os.path.getsize(path), "sha256": sha256(path)}
    return dict(sorted(records.items()))


def verify_checkpoint(path):
    """None when every file that trainer_state.json recorded when the checkpoint was written is there
    with its size and SHA-256; else what is wrong, naming the first damaged file. Sizes first: a missing
    or truncated file is found without reading the others."""
    state_file = os.path.join(path, "trainer_state.json")
    state = config.read_json(state_file)
    if "files" not in state:
        return f"{state_file} is unreadable or lists no files to verify"
    for relative, record in state["files"].items():
        file = os.path.join(path, relative)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != record["bytes"]:
            return f"{file} has {os.path.getsize(file)} bytes, {record['bytes']} were written"
    for relative, record in state["files"].items():
        if sha256(os.path.join(path, relative)) != record["sha256"]:
            return f"{os.path.join(path, relative)} differs from the file written (SHA-256 mismatch)"
    return None


def find_checkpoint(cfg, world_size, script=None):
    """(path, error) for --resume_from: the checkpoint to load ('' for none) once its files verify and it
    suits this run, or the error line that says why not. --resume_from latest is the newest checkpoint in
    --output_dir that verifies: damaged ones are skipped with a warning. Without --resume_from an
    --output_dir holding checkpoints is refused: this run's first save would delete them; one holding a finished run
    (no checkpoints) is replaced, with a note. Warnings and notes go to stderr."""
    script = script or config.script_name()
    complete, partial = list_checkpoints(cfg.output_dir)
    if not cfg.resume_from:
        if complete:
            return "", (f"error: --output_dir {cfg.output_dir!r} holds checkpoints of an earlier run (newest "
                        f"{os.path.basename(complete[-1])}): continue it with --resume_from latest, or give another "
                        "--output_dir.")
        if os.path.exists(os.path.join(cfg.output_dir, "summary.json")):  # written at a run's end
            config.say(f"note: --output_dir {cfg.output_dir!r} holds a finished run of {script}: this run replaces "
                       "it (give another --output_dir to keep it).")
        return "", None
    if cfg.resume_from == "latest":
        if partial:
            config.say(f"warning: ignoring partial checkpoints {[os.path.basename(p) for p in partial]} in "
                 f"{cfg.output_dir} (a run stopped while writing them); the next save deletes them.")
        path = ""
        for candidate in reversed(complete):
            problem = verify_checkpoint(candidate)
            if problem is None:
                path = candidate
                break
            config.say(f"warning: --resume_from latest: skipping the damaged {os.path.basename(candidate)}: {problem}.")
        if not path and complete:
            return "", (f"error: --resume_from latest: no checkpoint in {cfg.output_dir} verifies (each is damaged, "
                        "see the warnings above): start a new run with another --output_dir.")
        if not path:
            config.say(f"note: --resume_from latest: no complete checkpoint in {cfg.output_dir}, starting at step 0.")
            return "", None
    else:
        path = cfg.resume_from
        problem = verify_checkpoint(path)
        if problem:
            return "", (f"error: --resume_from {path!r} is damaged: {problem}. Give another checkpoint "
                        "(--resume_from latest skips damaged ones).")
    pickles = sorted(name for name in os.listdir(path) if name.startswith("custom_checkpoint_"))
    if pickles:
        return "", (f"error: --resume_from {path!r} holds {pickles[0]}, a pickle of a registered object, which a "
                    "resume never loads (unpickling can run any code); this version keeps that state as JSON "
                    "(custom_state_N.json): start a new run from its weights with --model_name_or_path "
                    f"{os.path.join(path, 'model')}.")
    state = config.read_json(os.path.join(path, "trainer_state.json"))
    if state["script"] != script:
        return "", (f"error: --resume_from {path!r} was written by {state['script']}, not {script}: resume it "
                    f"with {state['script']}, or start a new run from its weights with --model_name_or_path "
                    f"{os.path.join(path, 'model')}.")
    if state["world_size"] != world_size:
        return "", (f"error: --resume_from {path!r} was written by {state['world_size']} processes and this run "
                    f"has {world_size}: launch it with --num_processes {state['world_size']} (every rank's sampler "
                    "and random state is in the checkpoint, and --batch_size is per process).")
    saved, now = state["config"], json.loads(json.dumps(asdict(cfg)))
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    refused = [f"--{k} ({saved[k]!r} there, {now[k]!r} here)" for k in changed if k not in config.RESUMABLE_CHANGES]
    if refused:
        return "", (f"error: --resume_from {path!r}: this run differs from the checkpoint in {', '.join(refused)}; "
                    "give the checkpoint's values, or start a new run from its weights with --model_name_or_path "
                    f"{os.path.join(path, 'model')}.")
    notes = [f"--{k} {saved[k]!r} -> {now[k]!r}" for k in changed if k not in ("resume_from", "output_dir")]
    if notes:
        config.say(f"note: resuming {path} with {', '.join(notes)}.")
    return path, None


def load_checkpoint(cfg, accelerator, prompts):
    """The step to start after: 0, or the step of the checkpoint find_checkpoint picks for --resume_from, whose
    state is then loaded (accelerate's: models, optimizers, schedulers, every rank's RNG states; and the prompt
    sampler's). The main process verifies the checkpoint (and sets cfg.resume_from to it); an error stops every
    rank."""
    found = [find_checkpoint(cfg, accelerator.num_processes) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(found)
    path, error = found[0]
    if error:
        raise SystemExit(error if accelerator.is_main_process else 1)
    cfg.resume_from = path
    if not path:
        return 0
    load_state(accelerator, path)
    with open(os.path.join(path, f"sampler_rank{accelerator.process_index}.json")) as f:
        prompts.load_state_dict(json.load(f))
    with open(os.path.join(path, "trainer_state.json")) as f:
        step = json.load(f)["step"]
    if accelerator.is_main_process:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def save_checkpoint(cfg, accelerator, step, policy, tokenizer, prompts_state):
    """Write tmp-checkpoint-N (accelerate's state, each rank's prompt-sampler state, the policy as save_pretrained
    in model/, trainer_state.json last), rename it checkpoint-N when every rank is done, then drop the partial
    folders of killed runs and the checkpoints beyond --save_total_limit. Returns its path."""
    path = os.path.join(cfg.output_dir, f"{CHECKPOINT_PREFIX}{step}")
    tmp = os.path.join(cfg.output_dir, f"{PARTIAL_PREFIX}{step}")
    main = accelerator.is_main_process
    if main and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a killed run
    accelerator.wait_for_everyone()
    save_state(accelerator, tmp)
    with open(os.path.join(tmp, f"sampler_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(prompts_state, f)
    save_model(accelerator, policy, tokenizer, os.path.join(tmp, "model"))
    accelerator.wait_for_everyone()  # every rank's files are on disk
    if main:  # trainer_state.json, last, records the size and checksum of every other file
        state = trainer_state(cfg, step, accelerator.num_processes, files=file_records(tmp))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
        prune(cfg, keep=path)
    accelerator.wait_for_everyone()
    return path


@contextmanager
def set_aside(accelerator):
    """The objects registered with accelerator.register_for_checkpointing, taken out of accelerate's list while the
    block runs (save_state, load_state: they keep them as JSON; accelerate would pickle them, and load them with
    weights_only=False) and put back after it, however it ends."""
    registered = accelerator._custom_objects
    objects = list(registered)
    registered.clear()
    try:
        yield objects
    finally:
        registered.extend(objects)


def save_state(accelerator, path):
    """accelerator.save_state(path), but each registered object's state_dict() (plain numbers) written as JSON,
    custom_state_N.json, by the main process."""
    with set_aside(accelerator) as objects:
        accelerator.save_state(path)
    if accelerator.is_main_process:
        for index, obj in enumerate(objects):
            with open(os.path.join(path, f"custom_state_{index}.json"), "w") as f:
                json.dump(obj.state_dict(), f)


def load_state(accelerator, path):
    """accelerator.load_state(path), then each registered object's state from its JSON: SystemExit with one line when
    it is not the same keys with values of the same types as the object's own state_dict()."""
    with set_aside(accelerator) as objects:
        accelerator.load_state(path)
    for index, obj in enumerate(objects):
        file = os.path.join(path, f"custom_state_{index}.json")
        state, own = config.read_json(file), obj.state_dict()
        if not isinstance(state, dict) or state.keys() != own.keys() or \
                any(type(state[k]) is not type(own[k]) or state[k] != state[k] for k in own):  # (NaN)
            raise SystemExit(f"error: --resume_from {path!r}: {file} is missing or is not the state of "
                             f"{type(obj).__name__} (keys {sorted(own)}).")
        obj.load_state_dict(state)


def prune(cfg, keep):
    """Delete the partial checkpoints, and the complete ones beyond --save_total_limit but `keep`."""
    complete, partial = list_checkpoints(cfg.output_dir)
    older = [p for p in complete if p != keep]
    limit = cfg.save_total_limit
    beyond = older[:max(0, len(older) - (limit - 1))] if limit else []
    for old in partial + beyond:
        shutil.rmtree(old, ignore_errors=True)


def all_finite(accelerator, policy, tokenizer, prompts, finite=None):
    """Whether the policy's weights and logits on `prompts` are finite on every rank (`finite`: this rank's
    finite_weights_and_logits verdict, computed here if not given)."""
    if finite is None:
        finite = finite_weights_and_logits(accelerator.unwrap_model(policy), tokenizer, prompts)
    broken = torch.tensor(float(not finite), device=accelerator.device)
    return not accelerator.reduce(broken, reduction="sum") > 0


def loss_scaling(accelerator):
    """Whether fp16 loss scaling skips the steps whose gradients overflow."""
    deepspeed_fp16 = accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "fp16"
    return accelerator.scaler is not None or deepspeed_fp16


def finite_weights_and_logits(model, tokenizer, prompts):
    """True when every trainable weight (this rank's shard under ZeRO-3) is finite and so are the
    logits on `prompts` (training prompts). A weight is tested by its fp32 sum, into which a NaN or inf
    propagates (a sum overflows only for weights near fp32's limit, as broken as an inf; one
    reduction costs a fraction of an elementwise isfinite). Weights of ~1e30 are finite, yet the
    logits overflow and sampling fails, hence the forward pass; it takes real prompts because a lone
    EOS token can still give finite logits, and left-pads them by one more token, as sampling's batches
    are padded: the weights AdamW leaves at --learning_rate 1e30 give NaN logits under a padding mask
    and finite ones on an unpadded prompt."""
    with torch.no_grad():
        weights = [getattr(p, "ds_tensor", p).sum(dtype=torch.float32)
                   for p in model.parameters() if p.requires_grad]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        input_ids = torch.nn.functional.pad(enc["input_ids"], (1, 0), value=tokenizer.pad_token_id)
        attention_mask = torch.nn.functional.pad(enc["attention_mask"], (1, 0), value=0)
        device = next(model.parameters()).device
        # the last position sees every earlier one, so its logits carry a NaN from anywhere in the prompt
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       use_cache=False, logits_to_keep=1).logits
        return bool(torch.stack(weights).isfinite().all()) and bool(torch.isfinite(logits).all())
