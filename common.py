"""The math the five algorithms share, and the two model calls at its heart. KL estimators, masking, loss
aggregation and reward-to-go are pure functions: tensors in, tensors out. `token_logprobs` scores completions and
`generate` samples them, written plainly as the definition (same temperature, same masks: what is sampled is what
is scored); the loops run support/models.py's versions, tested equal. The plumbing lives in support/; the corrections
of a sampler that is not the learner, in lab/corrections.py. Equations and sign conventions: docs/algorithms.md."""
from contextlib import contextmanager
from typing import NamedTuple

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------------------
# KL estimators (docs/algorithms.md, "KL estimators"). Samples y ~ q = pi_theta, per token logp = log q(y), ref_logp =
# log p(y) with p = pi_ref; each estimates KL(q || p). The gradient statements below hold for ONE categorical (the
# state held fixed). For a sequence, a per-token term in the loss holds the prefixes fixed and drops each token's
# effect on the KL of later tokens: only k1 folded into the reward (with reward-to-go, or summed over the sequence)
# gives the gradient of the sequence KL(pi_theta || pi_ref). tests/test_kl.py proves both by enumerating every
# sequence of a 2-token model.
# ----------------------------------------------------------------------------------------
def kl_k1(logp, ref_logp):
    """k1 = log q - log p, per token.
    Value: unbiased for KL(q||p), but can be negative and has high variance.
    As a loss term (gradient through logp): E[grad k1] = 0, so it does nothing useful.
    As a detached penalty in the reward: E[k1 * score] = grad KL(q||p); for a sequence, the reward-to-go of the
    per-token k1 gives the sequence-KL gradient (ReMax; PPO at gamma = lam = 1), and so does the whole-sequence
    sum times the sequence score, in expectation (RLOO). Exactly so when the loss divides by a constant
    (seq-mean-token-sum-norm; RLOO's sum over tokens): a token-mean divides by the batch's token count, a ratio
    estimator biased at small batches, and seq-mean-token-mean weighs each sequence by 1/|y|."""
    # BEGIN SOLUTION
    return logp - ref_logp
    # END SOLUTION


def kl_k2(logp, ref_logp):
    """k2 = 0.5 (log q - log p)^2, per token.
    Value: biased (third order in the log-ratio), low variance, >= 0.
    As a loss term on one categorical: E[grad k2] = grad KL(q||p), the reverse-KL gradient (per token on a
    sequence: the per-state reverse KL with the states held fixed).
    As a detached penalty in the reward: a wrong gradient."""
    # BEGIN SOLUTION
    return 0.5 * (logp - ref_logp) ** 2
    # END SOLUTION


def kl_k3(logp, ref_logp):
    """k3 = p/q - log(p/q) - 1, per token ("low_var_kl"; Schulman's estimator).
    Value: unbiased for KL(q||p), >= 0, low variance. With q truncated by top-k / top-p and p not, E_q[k3] =
    KL(q||p) - p(outside the kept set): an underestimate (E_q[p/q] < 1).
    As a loss term on one categorical: E[grad k3] = grad KL(p||q), the FORWARD-KL gradient (GRPO's loss term; per
    token on a sequence it is the per-state forward KL, states fixed).
    As a detached penalty in the reward: a wrong gradient. Not clamped (verl clamps the log-ratio to +-20 and k3
    to 10): where a clamp binds the gradient is 0 and the blow-up is hidden."""
    # BEGIN SOLUTION
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1
    # END SOLUTION


def kl_penalty(logp, ref_logp, estimator="k3"):
    """Per-token KL term for a loss, gradient through logp: k1, k2 or k3 of (logp, ref_logp), by the estimator's
    name. The lab weights it by the ratio pi_theta / pi_old (lab/losses.py, ratio_weighted_kl)."""
    # BEGIN SOLUTION
    kl = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}[estimator]
    return kl(logp, ref_logp)
    # END SOLUTION


# ---- Masking and loss aggregation -------------------------------------------------
def masked_sum(x, mask, dim=None):
    """Sum of x where mask is 1 (masked entries may hold anything, even NaN)."""
    # BEGIN SOLUTION
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)
    # END SOLUTION


def masked_mean(x, mask, dim=None):
    """Mean of x where mask is 1; an all-masked slice gives 0."""
    # BEGIN SOLUTION
    return masked_sum(x, mask, dim) / masked_sum(torch.ones_like(x), mask, dim).clamp(min=1)
    # END SOLUTION


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the masked entries (std with Bessel's correction, as TRL); shift_mean=False adds back
    the mean (only the scale changes)."""
    # BEGIN SOLUTION
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / (n - 1).clamp(min=1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
    # END SOLUTION


def completion_mask(completion_ids, eos_token_id):
    """1 up to and including the first EOS, 0 after it; a completion with no EOS (cut at max length) keeps all."""
    # BEGIN SOLUTION
    is_eos = completion_ids == eos_token_id
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before t
    return (eos_before == 0).long()
    # END SOLUTION


class Aggregation(NamedTuple):
    """How a loss reduces its per-token terms, said once per update (the loop's trainer.micro_batches call): a mode
    of LOSS_AGG_MODES, seq-mean-token-sum-norm's max_len (None: T), and the micro-batch's weight (its part of the
    update's loss, micro_batch_weight; 1: the whole batch). The loss, the weight and the viewer read it there."""
    mode: str
    max_len: int | None = None
    weight: torch.Tensor | float = 1.0


def aggregate_loss(per_token_loss, mask, mode, max_len=None):
    """Reduce a (B, T) per-token loss to a scalar.

    token-mean:               sum over all tokens / number of tokens (DAPO; ReMax code).
    seq-mean-token-mean:      mean over sequences of each sequence's token mean (GRPO paper).
    seq-mean-token-sum:       mean over sequences of each sequence's token sum (RLOO: the sequence is one action).
    seq-mean-token-sum-norm:  mean over sequences of (token sum / max_len), max_len a constant
                              (Dr. GRPO: no per-sequence length normalisation). Default T.
    `mode` may be an Aggregation (or a tuple of its fields): its mode and max_len, the result times its weight.
    """
    if isinstance(mode, tuple):  # a micro-batch's Aggregation: its aggregate, weighted to its part of the loss
        mode, max_len, weight = Aggregation(*mode)
        return weight * aggregate_loss(per_token_loss, mask, mode, max_len)
    # BEGIN SOLUTION
    if mode == "token-mean":
        return masked_sum(per_token_loss, mask) / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token_loss, mask, dim=1).mean()
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token_loss, mask, dim=1).mean()
    if mode == "seq-mean-token-sum-norm":
        max_len = per_token_loss.shape[1] if max_len is None else max_len
        return (masked_sum(per_token_loss, mask, dim=1) / max_len).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGG_MODES}")
    # END SOLUTION


class Clip(NamedTuple):
    """A surrogate's clip: the ratio in [1 - low, 1 + high]; level "sequence": one ratio per sequence, the geometric
    mean of its tokens' (GSPO). cfg.clip: the loss and the viewer read it there."""
    low: float
    high: float
    level: str = "token"


def clipped_surrogate(ratio, adv, clip):
    """PPO's clipped surrogate per token (Schulman et al., 2017, eq. 7): min(rho A, clip(rho, 1 - low, 1 + high) A),
    the pessimistic bound of rho A. Once rho has moved past the clip in the direction A favours (above 1 + high with
    A > 0, below 1 - low with A < 0) the clipped term wins and the gradient is 0. ratio, adv: broadcastable, e.g.
    (B, T) and (B, 1); clip: a Clip. Minus it is the loss."""
    clip = Clip(*clip)  # a Clip, or its fields as a plain tuple
    # BEGIN SOLUTION
    return torch.min(ratio * adv, torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv)
    # END SOLUTION


def clip_stats(ratio, log_ratio, adv, mask, clip):
    """A clipped surrogate's statistics, means over the mask's tokens: clip_frac_low (rho < 1 - low with A < 0) and
    clip_frac_high (rho > 1 + high with A > 0), the tokens the clip silences; approx_kl, k3 of the token ratio,
    exp(log_ratio) - 1 - log_ratio, an estimate of KL(pi_old || pi_theta). Shapes as clipped_surrogate's."""
    clip = Clip(*clip)  # a Clip, or its fields as a plain tuple
    # BEGIN SOLUTION
    with torch.no_grad():
        return {
            "clip_frac_low": masked_mean(((ratio < 1 - clip.low) & (adv < 0)).float(), mask),
            "clip_frac_high": masked_mean(((ratio > 1 + clip.high) & (adv > 0)).float(), mask),
            "approx_kl": masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),
        }
    # END SOLUTION


def per_sequence(loss_agg):
    """loss_agg counting each sequence once (seq-mean-token-mean), a micro-batch's weight kept (the same b / B)."""
    mode = "seq-mean-token-mean"
    return Aggregation(*loss_agg)._replace(mode=mode) if isinstance(loss_agg, tuple) else mode


def micro_batch_weight(mask, loss_agg, num_tokens, num_sequences):
    """Weight of a micro-batch's loss, aggregated over it alone (mask: its (b, T)), such that the weighted losses
    of all micro-batches add up to the whole batch's loss (so do their gradients): token-mean divides by the whole
    batch's num_tokens (under data parallelism the mean per process, as DDP averages the gradients); every other
    mode is a mean over the batch's num_sequences."""
    return mask.sum() / num_tokens if loss_agg == "token-mean" else mask.shape[0] / num_sequences


def reward_to_go(x, mask):
    """Per-token sum over t' >= t of x[t'] (masked), i.e. the return with gamma = 1."""
    # BEGIN SOLUTION
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])
    # END SOLUTION


# ---- Statistics whose micro-batches combine (support/helpers.py's combine) ----
class Extreme(NamedTuple):  # a statistic whose micro-batches combine by their max or min
    value: torch.Tensor
    reduce: str  # "max" or "min"


class Sums(NamedTuple):
    """A statistic that is finish(*sums) of sums over the update's rows or tokens: its micro-batches add their sums,
    so its value is the whole batch's with or without --micro_batch_size."""
    sums: tuple
    finish: object = torch.div

    def value(self):
        return self.finish(*self.sums)


# ---- Log-probs and generation -----------------------------------------------------
def position_ids_from_mask(attention_mask):
    """Positions that skip left padding, the same ones `generate` uses."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sampling_mask(logits, top_k=0, top_p=1.0):
    """The logits the sampler draws from: top-k, then top-p (nucleus) on the tempered logits, the rest set to -inf,
    as transformers' TopKLogitsWarper and TopPLogitsWarper (ties at the k-th value are kept; the most likely token
    always is). (..., V) in, out."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p  # the tail whose mass is at most 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, with_entropy=False,
                   top_k=0, top_p=1.0):
    """(B, C) log-probs of the last C = num_completion_tokens tokens of `input_ids` under `model`, at the sampling
    temperature, in fp32: log softmax(logits / T) at each sampled token; with `with_entropy` also the (B, C)
    entropies (no gradient). With top_k / top_p, of the truncated, renormalised distribution the sampler drew from
    (DeepSeek-V3.2's "keep sampling mask", recomputed from the model scored); the reference takes the defaults. The
    definition; the loops run support/models.py's, equal."""
    c = num_completion_tokens
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).logits  # (B, T, V)
    logits = logits[:, -c - 1:-1].float() / temperature  # (B, C, V): position t predicts token t + 1
    targets = input_ids[:, -c:, None]  # (B, C, 1)
    if top_k > 0 or top_p < 1.0:
        # the sampled token stays in: a rounding difference from generate() must not give log 0
        kept = sampling_mask(logits.detach(), top_k, top_p).isfinite().scatter(-1, targets, True)  # (B, C, V)
        logits = logits.masked_fill(~kept, float("-inf"))
    logprobs = torch.log_softmax(logits, -1)  # (B, C, V)
    logp = logprobs.gather(-1, targets).squeeze(-1)  # (B, C)
    if not with_entropy:
        return logp
    with torch.no_grad():  # (B, C): sum of -p log p, 0 where p = 0
        return logp, torch.special.entr(logprobs.exp()).sum(-1)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1, greedy=False):
    """Sample `num_samples` completions per left-padded prompt (or one greedy completion), in generate calls of at
    most --generation_batch_size sequences: (B * num_samples, C) ids, each prompt's samples adjacent, padded after
    EOS. The sampler is exactly temperature, top-k and top-p, as token_logprobs scores it: the generation config is
    built whole and the checkpoint's (its repetition penalty, min_p) set aside. A bare, unwrapped or peft model.
    The definition; the loops run support/models.py's, equal to it (tests/test_fast.py)."""
    gen = generation_config(tokenizer, cfg, greedy, num_return_sequences=1 if greedy else num_samples)
    n = max(1, cfg.generation_batch_size // gen.num_return_sequences) if cfg.generation_batch_size else len(prompt_ids)
    with sampling_mode(model):
        chunks = [model.generate(input_ids=prompt_ids[i:i + n], attention_mask=prompt_mask[i:i + n],
                                 generation_config=gen)[:, prompt_ids.shape[1]:]  # (n * K, C), K adjacent
                  for i in range(0, len(prompt_ids), n)]
    return pad_completions(chunks, tokenizer.pad_token_id)


def generation_config(tokenizer, cfg, greedy=False, num_return_sequences=1):
    """The whole generation config of the sampler: the library's defaults plus exactly --temperature, --top_k,
    --top_p and --max_new_tokens (greedy: argmax decoding), nothing from the checkpoint."""
    from transformers import GenerationConfig

    sampling = {} if greedy else {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
    return GenerationConfig(do_sample=not greedy, max_new_tokens=cfg.max_new_tokens,
                            num_return_sequences=num_return_sequences, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, **sampling)


@contextmanager
def sampling_mode(model):
    """Eval mode and the checkpoint's generation_config.json (its min_p...) set aside, for a bare or peft model."""
    from transformers import GenerationConfig

    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a peft wrapper
    checkpoint_config, hf_model.generation_config = hf_model.generation_config, GenerationConfig()
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        hf_model.generation_config = checkpoint_config
        model.train(was_training)


def pad_completions(chunks, pad_token_id):
    """Several generate calls' completions in one (B, C) tensor, each padded after its EOS to the widest."""
    width = max(chunk.shape[1] for chunk in chunks)
    return torch.cat([torch.nn.functional.pad(chunk, (0, width - chunk.shape[1]), value=pad_token_id)
                      for chunk in chunks])
