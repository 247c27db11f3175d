"""The batch a training step works on: the sampled rollout (`Rollout`, one row per completion), and the rows of each
forward/backward pass of its update (`micro_batches`). The lab's rollouts keep more of each row: lab/rollout.py."""
from dataclasses import dataclass

import torch


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
