"""Hints for the exercises, in two levels.

    python classroom/hint.py NAME        # the step-by-step for one exercise (the second level)
    python classroom/hint.py --list      # every exercise with its stars and first-level hint

The first level is what the student copy shows in place of each solution (`# HINT:` lines): what to
compute, where docs/algorithms.md gives the equation, the shapes, and the traps to think about,
never the code. The second level, printed on request, walks through the computation step by step.

The stars are counted from the first level, not guessed: one star for the computation, one more when
it has a trap (a mask, NaN in the padding, an off-by-one, a detach, a tie), one more when it needs a
derivation or a loop to get right (`work` below). make_student_copy.py checks that its table agrees.
"""
import argparse
import sys
from dataclasses import dataclass, field


@dataclass
class Hint:
    compute: str  # what to compute, in words
    where: str  # the section of docs/algorithms.md (or the docstring) with the equation
    shapes: str
    traps: list = field(default_factory=list)  # what a plausible wrong answer gets wrong
    work: str = ""  # a derivation or a loop the exercise asks for, if any
    steps: list = field(default_factory=list)  # the second level: step by step

    @property
    def stars(self):
        return 1 + bool(self.traps) + bool(self.work)

    def first_level(self, name):
        """The `# HINT:` lines of the student copy (without the prefix)."""
        lines = [f"compute {self.compute}.", f"equation: {self.where}.", f"shapes: {self.shapes}."]
        lines += [f"think about: {trap}." for trap in self.traps]
        if self.work:
            lines.append(f"the work: {self.work}.")
        lines.append(f"stuck? python classroom/hint.py {name} gives the steps.")
        return lines


KL = "docs/algorithms.md, KL estimators"
MASKS = "docs/algorithms.md, Notation and sign conventions"
STATS_TRAP = "the statistics average over the completion's tokens only; padding may hold anything, NaN included"

HINTS = {
    "kl_k1": Hint(
        "the k1 estimate of KL(pi || ref) for each token, from the two log-probs", KL,
        "logp and ref_logp of any one shape; the result has that shape",
        steps=["k1 is the log of pi / ref evaluated at the sampled token.",
               "Both arguments are already logs: subtract, elementwise."]),
    "kl_k2": Hint(
        "the k2 estimate (half the squared log-ratio) for each token", KL,
        "logp and ref_logp of any one shape; the result has that shape",
        steps=["Take the log-ratio of pi to ref, elementwise.", "Square it and halve it."]),
    "kl_k3": Hint(
        "Schulman's k3 estimate for each token, from the ratio ref / pi", KL,
        "logp and ref_logp of any one shape; the result has that shape",
        traps=["which way round the ratio goes: k3 must be unbiased for KL(pi || ref) under samples of pi"],
        steps=["Let r = ref / pi at the sampled token; its log is ref_logp - logp.",
               "k3 = r - log r - 1: non-negative, zero when the two agree.",
               "Check: E_pi[r] = 1, so E_pi[k3] = E_pi[-log r] = KL(pi || ref)."]),
    "kl_penalty": Hint(
        "the per-token KL term of a loss: k1, k2 or k3, chosen by name", KL,
        "(B, T) log-probs in, (B, T) out",
        steps=["Pick kl_k1, kl_k2 or kl_k3 by the estimator's name.", "Apply it to (logp, ref_logp)."]),
    "masked_sum": Hint(
        "the sum of x over the entries where mask is 1, over everything or along one dim", MASKS,
        "x and mask of one shape; a scalar for dim=None, else x's shape without dim",
        traps=["masked entries may hold NaN or inf, and NaN * 0 is NaN"],
        steps=["Replace the entries where mask is 0 by zeros with torch.where (not by multiplying).",
               "Sum everything when dim is None, else along dim."]),
    "masked_mean": Hint(
        "the mean of x over the entries where mask is 1", MASKS,
        "as masked_sum",
        traps=["a row with no valid entry must give 0, not 0 / 0"],
        steps=["Divide masked_sum(x, mask, dim) by the number of valid entries along the same dim.",
               "Count them with masked_sum too, and clamp the count at 1 so an empty row gives 0."]),
    "masked_whiten": Hint(
        "x shifted and scaled to mean 0 and standard deviation 1 over the valid entries",
        "the docstring (TRL's masked_whiten) and docs/algorithms.md, PPO",
        "x and mask of one shape; the result has that shape",
        traps=["the mean and the variance are over the valid entries only",
               "the variance uses Bessel's correction (divide by n - 1)",
               "with shift_mean=False the mean is added back, yet the padding is still 0"],
        steps=["mean = masked mean of x; n = number of valid entries.",
               "var = masked sum of (x - mean)^2 divided by n - 1 (at least 1).",
               "whitened = (x - mean) / sqrt(var + eps); add the mean back when shift_mean is False.",
               "Put 0 wherever mask is 0, last, so nothing leaks into the padding."]),
    "completion_mask": Hint(
        "which tokens of each completion count: those up to and including its first EOS", MASKS,
        "(B, T) token ids in, a (B, T) 0/1 long tensor out",
        traps=["the first EOS itself is kept; later EOS tokens and the padding are not",
               "a completion without EOS keeps every token; one whose EOS is in the last column too",
               "each row is its own sequence"],
        steps=["is_eos = ids == eos_token_id.",
               "For each position count the EOS tokens strictly before it, along the sequence (dim 1):",
               "a cumulative sum minus the position's own EOS.",
               "Keep a token when that count is 0."]),
    "aggregate_loss": Hint(
        "one scalar from a (B, T) per-token loss, in four ways", MASKS + " (loss aggregation)",
        "(B, T) loss and mask in, a scalar out; max_len an int or None (the lines above the solution unpack a "
        "micro-batch's Aggregation)",
        traps=["padding may hold NaN and never counts",
               "seq-mean-token-sum-norm divides by a constant: max_len, or the batch width T when None, "
               "never each row's length nor the longest row",
               "an unknown mode is an error, not a default"],
        steps=["token-mean: the masked sum of the whole batch over the number of valid tokens.",
               "seq-mean-token-mean: each row's masked mean, then the mean over rows.",
               "seq-mean-token-sum: each row's masked sum, then the mean over rows.",
               "seq-mean-token-sum-norm: each row's masked sum divided by max_len (T if None), then the mean.",
               "Otherwise raise ValueError naming LOSS_AGG_MODES."]),
    "reward_to_go": Hint(
        "for every token the sum of x over it and the valid tokens after it", KL + " (the k1 penalty as a reward)",
        "(B, T) in, (B, T) out",
        traps=["padding may hold NaN", "the sum runs along each row, never into the next row",
               "the token itself is included"],
        steps=["Zero x where mask is 0 with torch.where.",
               "A suffix sum along dim 1: flip the rows, cumulative sum, flip back."]),
    "clipped_surrogate": Hint(
        "PPO's clipped surrogate of each token: the smaller of the ratio times the advantage and the clipped ratio "
        "times the advantage", "docs/algorithms.md, PPO (the clipped surrogate), and the docstring",
        "ratio and adv broadcastable, e.g. (B, T) and (B, 1); a clip with low and high; out, their broadcast shape",
        traps=["the pessimistic bound is a min, not a max, and it takes the unclipped term too",
               "the range is [1 - clip.low, 1 + clip.high]: two epsilons, the low one below"],
        steps=["clipped = clamp(ratio, 1 - clip.low, 1 + clip.high).",
               "Return min(ratio * adv, clipped * adv), elementwise."]),
    "clip_stats": Hint(
        "how often the clip binds on each side, and k3 of the token ratio, over the valid tokens",
        "docs/metrics.md (clip_frac_low, clip_frac_high, approx_kl), and the docstring",
        "ratio, log_ratio, mask (B, T), adv (B, 1) or (B, T); a dict of three scalars",
        traps=["a side counts only where the clip binds for that sign of A: below with A < 0, above with A > 0",
               STATS_TRAP],
        steps=["Without gradient (torch.no_grad).",
               "clip_frac_low: masked mean of (ratio < 1 - clip.low and adv < 0) as a float.",
               "clip_frac_high: masked mean of (ratio > 1 + clip.high and adv > 0) as a float.",
               "approx_kl: masked mean of exp(log_ratio) - 1 - log_ratio (the token ratio's, even at GSPO's "
               "sequence level)."]),
    "truncated_is_weight": Hint(
        "the truncated importance weight pi_train / pi_rollout of each token",
        "docs/algorithms.md, Off-policy corrections", "(B, T) in, (B, T) out",
        traps=["it is a weight, not a path for the gradient", "only large ratios are capped"],
        steps=["ratio = exp(logp - rollout_logp).", "Cap it from above at cap.", "Detach it."]),
    "geometric_sequence_mask": Hint(
        "which sequences off-policy masking keeps (1.0) or drops (0.0)",
        "docs/algorithms.md, Off-policy corrections", "(B, T) log-probs and mask and (B,) advantages in, (B,) out",
        traps=["the drift is a mean over the valid tokens, so padding and length must not matter",
               "only a drift above delta counts (the docstring says which way round the log-ratio goes), "
               "and only for a negative advantage"],
        steps=["drift_i = masked mean over t of (old_logp - logp), detached: one number per row.",
               "Drop row i (0.0) when adv_i < 0 and drift_i > delta; keep it (1.0) otherwise.",
               "Return it in logp's dtype."]),
    "ratio_weighted_kl": Hint(
        "the per-token KL term of a loss on tokens sampled by pi_old: the named estimator times the ratio pi / pi_old",
        KL + " (the ratio-weighted estimators)",
        "(B, T) log-probs in, (B, T) out",
        traps=["the ratio must keep its gradient through logp (a detached ratio keeps k3's forward-KL gradient)"],
        work="for k3, the ratio times ref / pi is ref / pi_old: write the product so that float32 keeps its "
             "gradient where the reference is far more likely than the policy",
        steps=["ratio = exp(logp - old_logp), not detached.",
               "For k1 and k2: the ratio times common.kl_penalty(logp, ref_logp, estimator).",
               "For k3: ratio * ref/pi is ref/pi_old, which has no gradient through logp, so ratio * k3 expands to "
               "ref/pi_old - ratio * (log(ref/pi) + 1): the same value, written from the log-probs, with nothing "
               "large left to cancel in float32 (the plain product's gradient is two such terms that do).",
               "Check: on-policy (old_logp = logp's value) the value is k3's and the gradient k2's."]),
    "remax_advantages": Hint(
        "ReMax's advantage: each sampled reward against the greedy completion's reward",
        "docs/algorithms.md, ReMax", "(B,) and (B,) in, (B,) out",
        steps=["Subtract the greedy reward from the sampled one."]),
    "remax_loss": Hint(
        "REINFORCE with the k1 penalty folded into a per-token return, and its mean return",
        "docs/algorithms.md, ReMax (G_t), and the docstring",
        "logp, kl, mask (B, T), adv (B,); a scalar loss and a dict of scalars",
        traps=["the return of token t counts the penalty of t and of the tokens after it, not before",
               "the return is a constant of the loss (no gradient through it)",
               STATS_TRAP + "; return_mean is a mean over tokens, not over rows"],
        steps=["G = adv[:, None] - beta * reward_to_go(kl, mask), detached.",
               "loss = aggregate_loss(-G * logp, mask, loss_agg) (loss_agg may be a micro-batch's Aggregation).",
               "stats: return_mean = masked mean of G over all valid tokens of the batch."]),
    "rloo_advantages": Hint(
        "RLOO's advantage: each reward against the mean of the other rewards of its group",
        "docs/algorithms.md, RLOO", "(B,) rewards with each group's G samples adjacent in, (B,) out",
        traps=["the mean leaves the sample itself out (G - 1 others)", "groups are adjacent runs of G"],
        steps=["View the rewards as (B / G, G): one row per prompt.",
               "The others' mean is (row sum - r) / (G - 1).",
               "Subtract it from r and flatten back to (B,)."]),
    "rloo_loss": Hint(
        "REINFORCE with the whole completion as one action, and the mean sequence log-prob",
        "docs/algorithms.md, RLOO, and the docstring", "logp, mask (B, T), adv (B,); a scalar and a dict",
        traps=["a sequence's log-prob is a sum over its valid tokens (padding may hold -inf or NaN)",
               "the advantage is a constant of the loss"],
        steps=["seq_logp = masked sum of logp along dim 1 (for the statistic).",
               "loss = aggregate_loss(-adv.detach()[:, None] * logp, mask, loss_agg): seq-mean-token-sum, the mean "
               "over rows of each row's sum.",
               "stats: seq_logp_mean = mean of seq_logp, detached."]),
    "grpo_advantages": Hint(
        "GRPO's group-normalised advantage, with three ways to scale it",
        "docs/algorithms.md, GRPO, and the docstring", "(B,) rewards with each group's G samples adjacent in, (B,) out",
        traps=["the std has Bessel's correction (ddof 1) and eps is added to it",
               "a group whose rewards are all equal gets exactly 0, although its float mean may round",
               "'batch' divides by the std of the whole batch, 'none' does not divide"],
        steps=["View the rewards as (B / G, G); adv = r - row mean.",
               "Set adv to exactly 0 in rows whose rewards are all equal.",
               "'group': divide by (row std + eps); 'batch': by (std of all B rewards + eps); 'none': leave it;",
               "anything else: ValueError. Flatten back to (B,)."]),
    "grpo_loss": Hint(
        "the clipped surrogate plus beta times the KL term per token, aggregated, and five statistics",
        "docs/algorithms.md, GRPO (the loss), KL estimators (the KL term), and the docstring",
        "logp, old_logp, ref_logp, mask (B, T), adv (B,); a scalar loss and a dict of scalars",
        traps=["the ratio is pi_theta / pi_old",
               "at importance_sampling_level='sequence' (GSPO) each sequence has one ratio, the geometric mean of "
               "its tokens' ratios, and its surrogate counts once while the KL term stays per token",
               STATS_TRAP],
        work="two levels of ratio, and at the sequence level two aggregations: the surrogate's and the KL term's",
        steps=["log_ratio = logp - old_logp; ratio = exp(log_ratio); A = adv[:, None] (one advantage per row).",
               "At clip.level 'sequence': ratio = exp(masked mean over the row of log_ratio), the same on "
               "every token of the row.",
               "surrogate = clipped_surrogate(ratio, A, clip) (common.py).",
               "kl = kl_penalty(logp, ref_logp, kl_estimator), 0 without ref.",
               "loss = aggregate_loss(-surrogate + beta * kl, mask, loss_agg); at sequence level the "
               "surrogate's part with per_sequence(loss_agg) (once per sequence) and the KL's with loss_agg.",
               "stats, without gradient: clip_stats(ratio, log_ratio, A, mask, clip) (clip_frac_low, "
               "clip_frac_high, approx_kl), and the masked means kl_k3 (kl_k3(logp, ref_logp)) and kl_term (kl)."]),
    "dynamic_sampling_filter": Hint(
        "which groups DAPO keeps: those whose correctness is mixed", "docs/algorithms.md, DAPO",
        "(B,) 0/1 correctness with each group's G samples adjacent in, (B / G,) bool out",
        traps=["an all-right group is dropped as well as an all-wrong one"],
        steps=["View correct as (B / G, G).", "Keep a row when some entry differs from the row's first."]),
    "overlong_penalty": Hint(
        "DAPO's soft overlong punishment of each completion's length", "docs/algorithms.md, DAPO (eq. 13)",
        "(B,) integer lengths in, (B,) float out",
        traps=["the ramp starts after max_len - cache_len and reaches -1 at max_len",
               "cache_len = 0 has no ramp (no division by zero)"],
        steps=["L = lengths as float; if cache_len == 0: -1 where L > max_len, else 0.",
               "Otherwise ((max_len - cache_len) - L) / cache_len, clamped to [-1, 0]."]),
    "dapo_loss": Hint(
        "DAPO's clipped surrogate with a decoupled clip range, token-mean over the batch, and three statistics",
        "docs/algorithms.md, DAPO (eq. 8), and the docstring",
        "logp, old_logp, mask (B, T), adv (B,); a scalar loss and a dict of scalars",
        traps=["the range is [1 - clip.low, 1 + clip.high]: epsilon_low and epsilon_high",
               "the mean is over every valid token of the batch", STATS_TRAP],
        steps=["log_ratio = logp - old_logp; ratio = exp(log_ratio); A = adv[:, None].",
               "surrogate = clipped_surrogate(ratio, A, clip) (common.py).",
               "loss = aggregate_loss(-surrogate, mask, loss_agg) (token-mean, or a micro-batch's Aggregation).",
               "stats: clip_stats(ratio, log_ratio, A, mask, clip) (clip_frac_low, clip_frac_high, approx_kl)."]),
    "gae": Hint(
        "generalized advantage estimates and the critic's targets, per token", "docs/algorithms.md, PPO (GAE)",
        "rewards, values, mask (B, T), lam a number or (B,); two (B, T) tensors out",
        traps=["after the last valid token the value is 0 (no bootstrap from padding)",
               "padding may hold NaN and gets 0", "lam may be one number per row"],
        work="a loop backwards in time with the right recursion",
        steps=["Zero rewards and values where mask is 0 (torch.where).",
               "Walk t from T - 1 down to 0, carrying next_value and next_adv (both 0 at the start):",
               "delta = r_t + gamma * next_value - V_t; next_adv = delta + gamma * lam * next_adv;",
               "store next_adv at t, then next_value = V_t.",
               "advantages = 0 where mask is 0; returns = advantages + values."]),
    "decoupled_gae": Hint(
        "the policy's advantages with one lambda and the critic's targets with another",
        "docs/algorithms.md, PPO (decoupled GAE)", "as gae",
        steps=["Call gae twice: the advantages of lam_policy, the returns of lam_critic."]),
    "reinforce_pp_advantages": Hint(
        "REINFORCE++'s per-token return with the k1 penalty in each token's reward, normalised over the batch",
        "docs/algorithms.md, REINFORCE++, and the docstring", "(B,) rewards, (B, T) kl and mask in, (B, T) out",
        traps=["the padding of kl may hold NaN", "the return runs from each token to the end of its own row",
               "the mean and std are over every valid token of the batch, not per row or per group"],
        steps=["Zero kl where mask is 0.",
               "returns = rewards[:, None] - beta * (the reverse cumulative sum of kl along T).",
               "With group_size: each row's rewards - beta * kl.sum(1), less its group's mean, on every token.",
               "Whiten over the mask with common.masked_whiten (it leaves the padding 0)."]),
    "length_reward": Hint(
        "Kimi k1.5's length reward of each sample within its group",
        "docs/algorithms.md, Kimi k1.5", "(B,) lengths and correctness, groups of G adjacent, in; (B,) float out",
        traps=["a group whose lengths are all equal gets 0, not 0.5 or a division by zero",
               "a wrong answer keeps lambda only where it is negative: never a gain for being short"],
        steps=["View the lengths as (B / G, G) floats; min and max per row.",
               "lam = 0.5 - (length - min) / (max - min) where max > min, else 0.",
               "Right answers: lam; wrong ones: lam clamped at 0 from above. Flatten to (B,)."]),
    "priority_weights": Hint(
        "the probability of drawing each prompt under Kimi k1.5's prioritised sampling",
        "docs/algorithms.md, Kimi k1.5, and the docstring", "(N,) success rates in, (N,) float64 probabilities out",
        traps=["the weight is one minus the rate: the prompts the policy fails are the wanted ones",
               "when every prompt is solved the weights sum to 0: uniform, not a division by zero"],
        steps=["weights = 1 - rates, as float64.", "Divide by their sum when it is positive;",
               "else return 1 / N for every prompt."]),
    "length_adaptive_lam": Hint(
        "VAPO's lambda for each sequence from its length", "docs/algorithms.md, PPO (length-adaptive GAE)",
        "(B,) lengths in, (B,) float out",
        traps=["short sequences would get a negative lambda"],
        steps=["lam = 1 - 1 / (alpha * length), as float.", "Clamp at 0 from below."]),
    "ppo_policy_loss": Hint(
        "PPO's clipped surrogate, token-mean over the valid tokens, and three statistics",
        "docs/algorithms.md, PPO, and the docstring", "logp, old_logp, adv, mask all (B, T); a scalar and a dict",
        traps=["the ratio is pi_theta / pi_old, one per token, each with its own advantage", STATS_TRAP],
        steps=["log_ratio = logp - old_logp; ratio = exp(log_ratio).",
               "surrogate = clipped_surrogate(ratio, adv, clip) (common.py).",
               "loss = aggregate_loss(-surrogate, mask, loss_agg) (token-mean, or a micro-batch's Aggregation).",
               "stats: clip_stats(ratio, log_ratio, adv, mask, clip), as in grpo_loss."]),
    "ppo_value_loss": Hint(
        "the clipped value loss, token-mean, and the fraction of tokens where the clip wins",
        "the docstring and docs/algorithms.md, PPO", "values, old_values, returns, mask (B, T); a scalar and a dict",
        traps=["the clip is around the old value, and the larger error wins (max)", "the factor 1/2",
               "a tie is not a clipped token; padding may hold NaN"],
        steps=["clipped values = old_values + clamp(values - old_values, -epsilon_value, epsilon_value).",
               "loss = 0.5 * masked mean of max((values - returns)^2, (clipped values - returns)^2).",
               "clip_frac = masked mean of (clipped error > unclipped error) where the clip binds, |V - V_old| > "
               "epsilon_value (elsewhere the two errors differ by rounding alone)."]),
    "positive_example_nll": Hint(
        "VAPO's positive-example LM loss: minus the mean log-probability of the correct samples' tokens",
        "docs/algorithms.md, VAPO, and the docstring", "logp, mask (b, T), correct (b,); a scalar",
        traps=["a token-mean, not a sum: divide by N, the number of the correct samples' tokens",
               "the wrong samples and the padding count for nothing, in the sum and in N; padding may hold NaN",
               "a micro-batch divides by the num_tokens it is given (the whole minibatch's N), not by its own"],
        steps=["positive = mask * correct[:, None]: 1 on the correct samples' tokens.",
               "N = positive.sum(), or num_tokens when it is given (as a tensor; a mean over processes may be below 1).",
               "Return minus the masked sum of logp over positive, divided by N (by 1 when N is 0)."]),
    "cispo_loss": Hint(
        "CISPO's loss: each token's log-probability weighted by its capped ratio, detached, times its advantage",
        "docs/algorithms.md, CISPO, SAPO and GMPO, and the docstring",
        "logp, old_logp (B, T), adv (B,), mask (B, T); a scalar and a dict",
        traps=["the capped ratio is a weight without gradient: only log pi carries it, every token keeps one",
               "a lower bound at or below 0 is no bound", "the padding of old_logp may hold NaN",
               "the clip fractions count the tokens past each bound, whatever the sign of A"],
        steps=["ratio = exp(logp - old_logp), detached.",
               "weight = ratio clamped to [max(1 - low, 0), 1 + high].",
               "per token: weight * adv[:, None] * logp (times pg_weight on the mask when given).",
               "loss = common.aggregate_loss of minus that, over the mask, with loss_agg.",
               "stats: masked means of (ratio < 1 - low), (ratio > 1 + high), and ratio - 1 - log ratio."]),
    "sapo_loss": Hint(
        "SAPO's loss: the soft gate of each token's ratio times its advantage, with the gate's temperature picked "
        "by the advantage's sign",
        "docs/algorithms.md, CISPO, SAPO and GMPO, and the docstring",
        "logp, old_logp (B, T), adv (B,), mask (B, T); a scalar and a dict",
        traps=["tau_pos for a positive advantage, tau_neg otherwise (zero included)",
               "the gradient flows through the ratio inside the gate", "the padding of old_logp may hold NaN",
               "the gate weight statistic is the ratio times the gate's slope, not the gate"],
        steps=["ratio = exp(logp - old_logp).", "tau = tau_pos where adv > 0 else tau_neg, per row, in adv's dtype.",
               "per token: sapo_gate(ratio, tau) * adv (times pg_weight on the mask when given).",
               "loss = common.aggregate_loss of minus that, with loss_agg.",
               "gate_weight = masked mean of 4 ratio s (1 - s), s = sigmoid(tau (ratio - 1)); approx_kl as in "
               "grpo_loss."]),
    "gmpo_loss": Hint(
        "GMPO's loss: each token's log-ratio clipped on the side that binds for its advantage's sign, their mean "
        "over the sequence exponentiated, times the advantage, one term per sequence",
        "docs/algorithms.md, CISPO, SAPO and GMPO, and the docstring",
        "logp, old_logp (B, T), adv (B,), mask (B, T); a scalar and a dict",
        traps=["the clip binds above for a positive advantage and below for a negative one, never both",
               "a clipped token is a constant: no gradient through it", "the mean runs over each row's valid "
               "tokens only", "one term per sequence: the aggregation is per sequence, whatever loss_agg's mode"],
        work="the geometric mean of the clipped ratios is the exponential of the mean of the clipped log-ratios",
        steps=["log_ratio = logp - old_logp.",
               "clipped_low = (adv < 0) & (log_ratio < -low); clipped_high = (adv > 0) & (log_ratio > high).",
               "Replace the clipped entries by the bound (-low or high), a constant.",
               "g = exp(masked mean over each row) as (B, 1); surrogate = g * adv on every token of the row.",
               "loss = common.aggregate_loss of minus it with common.per_sequence(loss_agg).",
               "stats: masked means of clipped_low and clipped_high; approx_kl as in grpo_loss."]),
    "opd_advantages": Hint(
        "on-policy distillation's per-token advantage: minus lambda times the student's log-probability less the "
        "teacher's, plus w times the sequence's task advantage",
        "docs/algorithms.md, On-policy distillation", "logp, teacher_logp (B, T), task_adv (B,); (B, T) out",
        traps=["the direction: student first, the reverse KL", "detached: the student's log-prob enters the "
               "gradient through the loss only", "the task advantage is one number per sequence, on every token"],
        steps=["reverse_kl = logp.detach() - teacher_logp.",
               "return -kl_coef * reverse_kl + reward_weight * task_adv[:, None]."]),
    "opd_loss": Hint(
        "REINFORCE on per-token advantages: minus each advantage times its log-probability, aggregated over the "
        "mask, with lambda times the exact KL added when it is given",
        "docs/algorithms.md, On-policy distillation, and the docstring",
        "logp, adv, mask (B, T), full_kl None or (B, T); a scalar and a dict",
        traps=["the padding of adv may hold NaN, and NaN times a zero gradient is NaN",
               "the statistics are masked means over the valid tokens"],
        steps=["adv = 0 where mask is 0.", "per_token = -adv * logp, plus kl_coef * full_kl when given.",
               "loss = common.aggregate_loss(per_token, mask, loss_agg).",
               "stats: adv_token_mean, the masked mean of adv; full_kl, the masked mean of the detached full_kl."]),
    "full_reverse_kl": Hint(
        "the reverse KL of the student to the teacher at each position, over the whole vocabulary",
        "docs/algorithms.md, On-policy distillation", "(B, T, V) log-probs in, (B, T) out",
        traps=["the student's probabilities weigh the difference, student first: not the forward KL"],
        steps=["Return (logprobs.exp() * (logprobs - teacher_logprobs)).sum(-1)."]),
    "episode_masks": Hint(
        "an episode's two masks from its segments: the action mask (1 on the model's tokens) and the token mask "
        "(1 on every token of the episode, the environment's too), each row's segments one after the other from "
        "position 0", "agents.py (the module's docstring and the function's worked example)",
        "segment_lengths and segment_is_action (B, S), width an int; two (B, width) integer masks of 0 and 1",
        traps=["a segment of length 0 takes no position, wherever it stands in the row, and does not end the row",
               "where a segment ends the next begins: a token belongs to one segment only",
               "the padding after the last segment is in neither mask, whatever the last segment was"],
        steps=["A row's segments end at the running sums of its lengths; segment s covers [end_s - length_s, "
               "end_s).",
               "For each position, count the ends at or before it: that count is the index of its segment (an empty "
               "segment ends where the one before it ends, so it is skipped).",
               "A position is in the token mask when the count is below S: it lies before the row's last end.",
               "It is in the action mask when it is in the token mask and its segment is an action (look the flag "
               "up at that index, kept within 0..S-1 for the padding).",
               "Return both as 0/1 integer (long) tensors: (action mask, token mask)."]),
    "gradient_variance": Hint(
        "the exact variance of the one-sample estimator (r_a - b) s(a) on the two-armed bandit",
        "docs/algorithms.md, Policy gradient and baselines, and The toy bandit",
        "p and b numbers or arrays (broadcast), r1 and r0 numbers; the result like p",
        traps=["with Bernoulli rewards each arm adds its own noise q (1 - q)"],
        work="derive E[g^2] - (E g)^2 by summing over the two actions",
        steps=["s(1) = 1 - p and s(0) = -p; action 1 has probability p.",
               "E[g^2] = sum over a of P(a) s(a)^2 E[(r_a - b)^2], and E[(r_a - b)^2] = (r_a - b)^2 + noise_a.",
               "E[g] = grad J = p (1 - p) (r1 - r0). Return E[g^2] - (E g)^2, with arrays broadcast."]),
    "optimal_baseline": Hint(
        "the baseline b* that minimises gradient_variance", "docs/algorithms.md, Policy gradient and baselines",
        "p a number or an array; the result like p",
        traps=["b* weighs each reward by the square of the score, so it is not the expected reward"],
        work="derive E[r s^2] / E[s^2] for two actions and simplify",
        steps=["E[s^2] = p (1 - p)^2 + (1 - p) p^2; E[r s^2] weighs r1 and r0 the same way.",
               "Divide and cancel p (1 - p)."]),
    "two_arm_baselines": Hint(
        "the four baselines of the two-armed bandit: none, mean, greedy, optimal",
        "docs/algorithms.md, The toy bandit", "p a number or an array; a dict of values like p",
        traps=["greedy is the reward of the likelier action, and a tie at p = 1/2 goes to action 0"],
        steps=["none = zeros like p; mean = expected reward; greedy = r1 where p > 1/2, else r0;",
               "optimal = optimal_baseline(p, r1, r0)."]),
    "softmax_gradient_variance": Hint(
        "the exact trace of the covariance of (r_a - b) s(a) for a softmax policy",
        "docs/algorithms.md, Policy gradient and baselines, and The toy bandit",
        "theta and r (K,), baseline a number or an array; the result like the baseline",
        traps=["the score of a softmax is e_a - pi", "Bernoulli rewards add r_a (1 - r_a) per arm"],
        work="derive E||g||^2 - ||E g||^2 over the K actions",
        steps=["pi = softmax(theta); ||s(a)||^2 = ||e_a - pi||^2 = 1 - 2 pi_a + pi . pi.",
               "E||g||^2 = sum_a pi_a ||s(a)||^2 ((r_a - b)^2 + noise_a).",
               "E g = sum_a pi_a r_a (e_a - pi) = pi * (r - pi . r); subtract its squared norm.",
               "Broadcast b with a trailing axis to handle an array of baselines."]),
    "softmax_optimal_baseline": Hint(
        "the baseline that minimises softmax_gradient_variance",
        "docs/algorithms.md, Policy gradient and baselines", "theta and r (K,) in, a float out",
        traps=["the weights are the squared score norms, not the probabilities alone"],
        work="derive E[r ||s||^2] / E[||s||^2] for a softmax",
        steps=["With ||s(a)||^2 as in softmax_gradient_variance:",
               "b* = sum_a pi_a r_a ||s(a)||^2 / sum_a pi_a ||s(a)||^2.",
               "The denominator simplifies to 1 - pi . pi."]),
    "softmax_baselines": Hint(
        "the four baselines of the K-armed bandit", "docs/algorithms.md, The toy bandit",
        "theta and r (K,) in; a dict of floats",
        traps=["greedy is the reward of the likeliest action, ties to the lowest index"],
        steps=["pi = softmax(theta); none = 0; mean = pi . r; greedy = r[argmax pi] (np.argmax breaks ties low);",
               "optimal = softmax_optimal_baseline(theta, r)."]),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", help="The exercise (a function name), e.g. gae.")
    parser.add_argument("--list", action="store_true", help="Every exercise's stars and first-level hint.")
    args = parser.parse_args()
    if args.list:
        for name, hint in HINTS.items():
            print(f"{name} {'★' * hint.stars}{'☆' * (3 - hint.stars)}\n  " + "\n  ".join(hint.first_level(name)))
        return
    if args.name not in HINTS:
        sys.exit(f"error: no exercise named {args.name!r}; choose one of: {', '.join(HINTS)}")
    hint = HINTS[args.name]
    print(f"{args.name}: {hint.compute}\n")
    for i, step in enumerate(hint.steps, 1):
        print(f"{i}. {step}")


if __name__ == "__main__":
    main()
