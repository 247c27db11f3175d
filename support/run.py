"""The run around the loop: phase timer, metric reduction and logging, summary and plots. Checkpoints and
resume are in support/checkpoint.py."""
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from support import config, models, routing

WARNED = set()  # the keys of the warnings this process has printed (warn_once)


def warn_once(key, line):
    """Print a warning line once per process."""
    if key not in WARNED:
        WARNED.add(key)
        print(f"warning: {line}", flush=True)


class StepTimer:
    """Wall time of each phase of a step: `with timer("generation"): ...`; metrics() gives
    time/<phase>_s and resets. On a GPU it synchronises so the time is the GPU's too."""

    def __init__(self):
        self.times, self.spans = {}, None  # spans: a list to record (phase, start, end) in wall-clock seconds

    @contextmanager
    def __call__(self, phase):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start, wall = time.perf_counter(), time.time()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start
        if self.spans is not None:
            self.spans.append((phase, wall, time.time()))

    def metrics(self):
        out, self.times = {f"time/{k}_s": v for k, v in self.times.items()}, {}
        out["time/step_s"] = sum(out.values())
        return out


def rollout_metrics(rollout, step_s):
    """The engine's metrics of a step's rollout: completion length, tokens per second and, on a mixture of experts,
    train/routing_mismatch over the positions that predict a completion token."""
    lengths = rollout.mask.sum(1).float()  # the model's tokens
    metrics = {"train/completion_len": lengths.mean(), "time/tokens_per_s": lengths.sum() / step_s}
    if rollout.episodes is not None:  # an environment's episodes (agents.py): per episode, over the batch
        episodes = rollout.episodes
        metrics.update({"train/turns": sum(e.num_turns for e in episodes) / len(episodes),
                        "train/tool_calls": sum(len(e.tool_calls) for e in episodes) / len(episodes),
                        "train/tool_errors": sum(e.tool_errors for e in episodes) / len(episodes),
                        "train/truncated_frac": sum(e.truncated for e in episodes) / len(episodes),
                        "train/env_token_frac": 1 - rollout.mask.sum() / rollout.token_mask.sum().clamp(min=1)})
        if metrics["train/truncated_frac"] > 0.5:  # a run whose episodes are mostly cut says so once
            warn_once("episodes cut", f"{metrics['train/truncated_frac']:.0%} of this step's episodes were cut "
                      "before they ended (by --max_new_tokens, the episode's budget of turns and replies, or by "
                      "--max_turns): raise them if the model needs the room (said once).")
    if rollout.live_routing is not None:
        predicting = torch.nn.functional.pad(rollout.mask, (rollout.prompt_ids.shape[1] - 1, 1))
        metrics["train/routing_mismatch"] = routing.mismatch(rollout.routing[0], rollout.live_routing, predicting)
    return metrics


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
