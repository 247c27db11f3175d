"""TreePO's sampler (--sampler tree): each prompt's group sampled as a tree of shared segments. Every live branch
decodes --segment_len tokens, then forks into --branching copies of itself, --depth times (the first fork at the
prompt); the copies continue from a copy of the parent's keys and values (the cache is reordered with repeated
rows), so a shared prefix is decoded once. A branch that emits EOS is a leaf and leaves the batch; the leaves it
would have grown pass to its live relatives, or, when none is left, are sampled from the prompt itself. The leaves
are the group's completions; exploration.tree_ancestors reads the tree back from them for the advantage."""
from dataclasses import dataclass

import torch

import common
from lab import decode
from support import models


class Sampling:
    """The rollouts' sample function, counting what it decodes: the independent sampler (decode.generate or
    common.generate) or, with --sampler tree, `tree_generate` for the sampled groups (greedy decoding stays
    independent). `decoded`: the completion tokens decoded, `completions`: the completions made, since the last
    `metrics`."""

    def __init__(self, cfg, independent):
        self.cfg, self.independent, self.decoded, self.completions = cfg, independent, 0, 0

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1, greedy=False):
        if greedy or num_samples == 1 or self.cfg.sampler == "independent":
            ids = self.independent(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=num_samples,
                                   greedy=greedy)
            decoded = common.completion_mask(ids, tokenizer.eos_token_id).sum().item()  # finished rows stop
        else:
            with common.sampling_mode(model), models.gathered_parameters(model):
                ids, decoded = tree_generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples)
        if not greedy:
            self.count(decoded, len(ids))
        return ids

    def count(self, decoded, completions):
        """Add what a sampling outside this function decoded (an episode's actions: sampling.play)."""
        self.decoded, self.completions = self.decoded + decoded, self.completions + completions

    def metrics(self):
        """train/decoded_per_completion: completion tokens decoded per completion sampled since the last call."""
        out = {"train/decoded_per_completion": self.decoded / max(self.completions, 1)}
        self.decoded, self.completions = 0, 0
        return out


@dataclass
class Branch:
    prompt: int      # its prompt's index
    lineage: tuple   # the child index taken at each fork, for the leaves' order
    quota: int       # the leaves it is to grow


@torch.no_grad()
def tree_generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples):
    """(P * num_samples, C) completion ids, each prompt's num_samples leaves adjacent (in the tree's order: a
    branch's leaves together, then those sampled from the prompt after its tree died), padded after EOS; and the
    number of completion tokens decoded."""
    gen = common.generation_config(tokenizer, cfg)
    forks = [d * cfg.segment_len for d in range(cfg.depth)]
    leaves, missing, decoded = grow(model, prompt_ids, prompt_mask, [num_samples] * len(prompt_ids), gen, forks,
                                    cfg.branching)
    if any(missing):  # a tree whose branches all ended too early: its other leaves from the prompt, one fork
        more, _, extra = grow(model, prompt_ids, prompt_mask, missing, gen, [0], cfg.branching)
        leaves, decoded = [a + b for a, b in zip(leaves, more)], decoded + extra
    rows = [torch.tensor(tokens) for prompt_leaves in leaves for tokens in prompt_leaves]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
    return ids.to(prompt_ids.device), decoded


def grow(model, prompt_ids, prompt_mask, quotas, gen, forks, branching):
    """Grow each prompt's tree of quotas[p] leaves, forking every live branch at the token positions `forks` (into
    `branching` children, and into all its quota at the last fork). Returns (leaves: per prompt, each leaf's tokens
    in lineage order; missing: per prompt, the leaves not grown because every branch ended; decoded tokens)."""
    device = prompt_ids.device
    branches = [Branch(p, (), q) for p, q in enumerate(quotas) if q > 0]
    index = torch.tensor([b.prompt for b in branches], device=device)
    cache = decode.shared_prompt_cache(model, prompt_ids, prompt_mask, index)  # each prompt once (its routing told)
    attention_mask, tokens = prompt_mask[index], torch.zeros(len(index), 0, dtype=prompt_ids.dtype, device=device)
    inputs, positions = prompt_ids[index, -1:], common.position_ids_from_mask(prompt_mask)[index, -1:]
    found, missing, decoded = [[] for _ in quotas], [0] * len(quotas), 0
    for t in range(gen.max_new_tokens):
        if t in forks:  # each branch forks: its children continue from copies of its keys and values
            children, parents = [], []
            for i, b in enumerate(branches):
                k = b.quota if t == forks[-1] else min(branching, b.quota)
                for j in range(k):
                    children.append(Branch(b.prompt, b.lineage + (j,), b.quota // k + (j < b.quota % k)))
                    parents.append(i)
            rows = torch.tensor(parents, device=device)
            cache.reorder_cache(rows)
            branches, attention_mask, tokens, inputs, positions = children, attention_mask[rows], tokens[rows], \
                inputs[rows], positions[rows]
        out = model(input_ids=inputs, attention_mask=attention_mask, position_ids=positions, cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache, logits, decoded = out.cache, out.logits[:, -1].float(), decoded + len(branches)
        if t < (gen.min_new_tokens or 0):
            logits[:, gen.eos_token_id] = float("-inf")
        probs = torch.softmax(common.sampling_mask(logits / gen.temperature, gen.top_k or 0, gen.top_p), dim=-1)
        token = torch.multinomial(probs, num_samples=1).squeeze(1)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        ended = (token == gen.eos_token_id) | (t == gen.max_new_tokens - 1)
        for i in ended.nonzero().flatten().tolist():  # a leaf; the leaves it would have grown go to its relatives
            b = branches[i]
            found[b.prompt].append((b.lineage, tokens[i].tolist()))
            relatives = [r for j, r in enumerate(branches) if r.prompt == b.prompt and not ended[j]]
            for n in range(b.quota - 1):
                if relatives:
                    relatives[n % len(relatives)].quota += 1
                else:
                    missing[b.prompt] += 1
        keep = (~ended).nonzero().flatten()
        if len(keep) == 0:
            break
        cache.reorder_cache(keep)
        branches = [branches[i] for i in keep.tolist()]
        attention_mask = torch.cat([attention_mask[keep], attention_mask.new_ones(len(keep), 1)], dim=1)
        tokens, inputs, positions = tokens[keep], token[keep, None], positions[keep] + 1
    leaves = [[tokens for _, tokens in sorted(prompt_leaves)] for prompt_leaves in found]
    return leaves, missing, decoded
