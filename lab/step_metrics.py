"""The lab's measures of a step: the wall time of each of its phases (StepTimer), and what its rollout held
(rollout_metrics: lengths, tokens per second, an environment's turns and tool calls). The lesson files log the
step's time and completion length alone (support/helpers.log_step)."""
import time
from contextlib import contextmanager

import torch

from lab import environments


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
    """The engine's metrics of a step's rollout: completion length, tokens per second and, of episodes, their turns,
    tool calls and cuts (a mixture of experts' train/routing_mismatch: lab/routing.py)."""
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
            environments.warn_once("episodes cut", f"{metrics['train/truncated_frac']:.0%} of this step's episodes "
                                   "were cut before they ended (by --max_new_tokens, the episode's budget of turns "
                                   "and replies, or by --max_turns): raise them if the model needs the room (said "
                                   "once).")
    return metrics
