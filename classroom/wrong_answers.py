"""Wrong answers a student writes, and the check that the tests and the grade reject every one.

    python classroom/wrong_answers.py             # run the check: one pytest run of the tests, then the grade
    python classroom/wrong_answers.py --list      # the table exercise -> wrong version -> test (markdown)

A wrong version is one edit of a reference solution: the text `old` in the code of the
function's `# BEGIN SOLUTION` region (its `# HINT:` lines aside) becomes `new`. The check runs
the tests of each exercise (the visible ones of make_student_copy.py and the hidden property
tests of classroom/teacher_tests/) once under pytest; after a test passes on the reference it
runs again with each wrong version of each exercise it tests swapped in (the function's code
object is replaced, so every caller and every `from module import name` sees it) and records
which tests fail. Then each wrong version is graded as classroom/grade.py grades an answer (its
cases, compared with the reference's answers; seeds GRADE_SEEDS). It fails unless the reference
passes, every wrong version fails the test the table names for it, and every one scores 0 in
the grade. For teachers only: the edits hold pieces of the solutions, so make_student_copy.py
leaves this file (and tests/test_grading.py) out of the student copy.
"""
import argparse
import ast
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grade  # noqa: E402
import make_student_copy as msc  # noqa: E402
from teacher_tests import TEACHER_TESTS  # noqa: E402

ROOT = msc.ROOT
GRADE_SEEDS = (0, 1, 2)


def grading_tests(key):
    """pytest node ids of the tests of an exercise: the visible ones, then the hidden property tests."""
    _, test_file, names = msc.EXERCISES[key]
    hidden_file, hidden = TEACHER_TESTS.get(key, (None, []))
    return [msc.node_id(test_file, n) for n in names] + [f"{hidden_file}::{n}" for n in hidden]


# the hidden tests of the statistics on padded batches
GRPO_PADDING = "test_grpo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token"
DAPO_PADDING = "test_dapo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token"
PPO_PADDING = "test_ppo_policy_loss_statistics_ignore_the_padding_and_weigh_every_valid_token"

# the visible tests of common.clipped_surrogate and common.clip_stats
CLIP_TEST = "test_clipped_surrogate_is_the_pessimistic_bound_with_its_gradient_zero_exactly_where_the_clip_binds"
STATS_TEST = "test_clip_stats_count_the_clipped_valid_tokens_of_the_side_a_favours"

# the visible test of vapo.positive_example_nll
VAPO_NLL = "test_positive_example_nll_is_the_token_mean_of_minus_logp_over_the_correct_samples_only"

# "file::function" -> [(wrong version, old, new, the grading test that catches it), ...]
WRONG_ANSWERS = {
    "common.py::kl_k1": [
        ("sign flipped: log p - log q", "return logp - ref_logp", "return ref_logp - logp",
         "test_k1_and_k3_are_unbiased_for_reverse_kl"),
        ("the ratio instead of its log: q/p - 1", "return logp - ref_logp", "return torch.exp(logp - ref_logp) - 1",
         "test_k1_and_k3_are_unbiased_for_reverse_kl"),
    ],
    "common.py::kl_k2": [
        ("the 1/2 forgotten", "0.5 * (logp - ref_logp) ** 2", "(logp - ref_logp) ** 2",
         "test_estimators_hand_computed_values"),
        ("absolute value instead of the square", "0.5 * (logp - ref_logp) ** 2", "0.5 * (logp - ref_logp).abs()",
         "test_k2_loss_gradient_is_reverse_kl"),
    ],
    "common.py::kl_k3": [
        ("ratio upside down: q/p - log(q/p) - 1", "log_ratio = ref_logp - logp", "log_ratio = logp - ref_logp",
         "test_k1_and_k3_are_unbiased_for_reverse_kl"),
        ("the - 1 forgotten", "- log_ratio - 1", "- log_ratio", "test_estimators_hand_computed_values"),
        ("sign of the log term flipped", "- log_ratio - 1", "+ log_ratio - 1",
         "test_k3_is_nonnegative_per_sample_and_k1_is_not"),
    ],
    "common.py::kl_penalty": [
        ("k1 and k3 swapped", '{"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}', '{"k1": kl_k3, "k2": kl_k2, "k3": kl_k1}',
         "test_kl_penalty_is_the_estimator_it_names_and_k3_by_default"),
        ("the estimator ignored (always k3)", '{"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}[estimator]', "kl_k3",
         "test_kl_penalty_is_the_estimator_it_names_and_k3_by_default"),
    ],
    "common.py::masked_sum": [
        ("mask by multiplying (NaN * 0 is NaN)", "x = torch.where(mask.bool(), x, torch.zeros_like(x))",
         "x = x * mask", "test_masked_sum_and_mean_ignore_masked_values_even_nan"),
        ("mask forgotten", "x = torch.where(mask.bool(), x, torch.zeros_like(x))", "x = x",
         "test_masked_sum_and_mean_ignore_masked_values_even_nan"),
        ("dim ignored", "return x.sum() if dim is None else x.sum(dim)", "return x.sum()",
         "test_masked_sum_and_mean_ignore_masked_values_even_nan"),
    ],
    "common.py::masked_mean": [
        ("mean over padding: divides by every entry", "masked_sum(torch.ones_like(x), mask, dim).clamp(min=1)",
         "(x.numel() if dim is None else x.shape[dim])", "test_masked_sum_and_mean_ignore_masked_values_even_nan"),
        ("no guard for an empty row (0 / 0)", ".clamp(min=1)", "", "test_masked_mean_of_empty_row_is_zero"),
    ],
    "common.py::masked_whiten": [
        ("std without Bessel's correction (ddof 0)", "(n - 1).clamp(min=1)", "n",
         "test_masked_whiten_has_zero_mean_unit_std_on_mask_and_zero_off_it"),
        ("mean over padding too", "mean = masked_mean(x, mask)", "mean = x.mean()",
         "test_masked_whiten_has_zero_mean_unit_std_on_mask_and_zero_off_it"),
        ("shift_mean=False does not add the mean back", "whitened = whitened + mean", "whitened = whitened",
         "test_masked_whiten_has_zero_mean_unit_std_on_mask_and_zero_off_it"),
        ("padding not zeroed", "return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))",
         "return whitened", "test_masked_whiten_has_zero_mean_unit_std_on_mask_and_zero_off_it"),
        ("shift_mean=False puts the mean back on the padding too",
         "        whitened = whitened + mean\n"
         "    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))",
         "        return torch.where(mask.bool(), whitened, torch.zeros_like(whitened)) + mean\n"
         "    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))",
         "test_masked_whiten_of_a_padded_batch_ignores_the_padding_and_leaves_it_zero"),
    ],
    "common.py::completion_mask": [
        ("the EOS itself dropped", "torch.cumsum(is_eos.long(), dim=1) - is_eos.long()",
         "torch.cumsum(is_eos.long(), dim=1)", "test_completion_mask_keeps_first_eos_and_drops_the_rest"),
        ("only the EOS tokens dropped", "return (eos_before == 0).long()", "return (~is_eos).long()",
         "test_completion_mask_keeps_first_eos_and_drops_the_rest"),
        ("cumulative sum over the batch, not the sequence", "torch.cumsum(is_eos.long(), dim=1)",
         "torch.cumsum(is_eos.long(), dim=0)", "test_completion_mask_keeps_first_eos_and_drops_the_rest"),
        ("shifted with torch.roll: an EOS in the last column wraps to the front",
         "torch.cumsum(is_eos.long(), dim=1) - is_eos.long()", "torch.cumsum(torch.roll(is_eos.long(), 1, 1), dim=1)",
         "test_completion_mask_of_random_ids_keeps_each_rows_prefix_through_its_first_eos"),
    ],
    "common.py::aggregate_loss": [
        ("token-mean over padding too", "masked_sum(per_token_loss, mask) / mask.sum().clamp(min=1)",
         "masked_sum(per_token_loss, mask) / per_token_loss.numel()", "test_aggregate_loss_modes_hand_computed"),
        ("seq-mean-token-mean over all tokens (token-mean)", "return masked_mean(per_token_loss, mask, dim=1).mean()",
         "return masked_mean(per_token_loss, mask)", "test_aggregate_loss_modes_hand_computed"),
        ("seq-mean-token-sum divides by each length (a token mean)",
         "return masked_sum(per_token_loss, mask, dim=1).mean()", "return masked_mean(per_token_loss, mask, dim=1).mean()",
         "test_aggregate_loss_modes_hand_computed"),
        ("seq-mean-token-sum counts the padding", "return masked_sum(per_token_loss, mask, dim=1).mean()",
         "return per_token_loss.sum(dim=1).mean()", "test_aggregate_loss_modes_hand_computed"),
        ("seq-mean-token-sum-norm divides by each length",
         "(masked_sum(per_token_loss, mask, dim=1) / max_len).mean()",
         "masked_mean(per_token_loss, mask, dim=1).mean()", "test_aggregate_loss_modes_hand_computed"),
        ("max_len ignored (the batch width)", "max_len = per_token_loss.shape[1] if max_len is None else max_len",
         "max_len = per_token_loss.shape[1]", "test_aggregate_loss_modes_hand_computed"),
        ("max_len defaults to the longest completion, not the batch width",
         "max_len = per_token_loss.shape[1] if max_len is None else max_len",
         "max_len = mask.sum(1).max() if max_len is None else max_len",
         "test_seq_mean_token_sum_norm_divides_by_the_batch_width_even_when_every_row_is_shorter"),
        ("an unknown mode falls back to token-mean", 'raise ValueError(f"unknown loss aggregation',
         'return masked_mean(per_token_loss, mask)  # (f"unknown loss aggregation',
         "test_aggregate_loss_rejects_unknown_mode"),
    ],
    "common.py::reward_to_go": [
        ("sum over the past (no flips)", "torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])", "torch.cumsum(x, 1)",
         "test_reward_to_go_sums_future_masked_values"),
        ("off by one: the current token left out", "torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])",
         "torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1]) - x", "test_reward_to_go_sums_future_masked_values"),
        ("mask forgotten", "x = torch.where(mask.bool(), x, torch.zeros_like(x))", "x = x",
         "test_reward_to_go_sums_future_masked_values"),
        ("masked by multiplying: a NaN in the padding leaks into its row",
         "x = torch.where(mask.bool(), x, torch.zeros_like(x))", "x = x * mask",
         "test_reward_to_go_of_a_padded_batch_runs_along_each_row_alone"),
        ("summed over the whole batch: the sum runs on into the next rows",
         "torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])",
         "torch.flip(torch.cumsum(torch.flip(x.flatten(), [0]), 0), [0]).view_as(x)",
         "test_reward_to_go_of_a_padded_batch_runs_along_each_row_alone"),
    ],
    "common.py::clipped_surrogate": [
        ("clip on the wrong side: max instead of min", "torch.min(ratio * adv", "torch.max(ratio * adv", CLIP_TEST),
        ("the clipped term alone (no min)",
         "torch.min(ratio * adv, torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv)",
         "torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv", CLIP_TEST),
        ("no clip: the ratio times the advantage", "return torch.min(ratio * adv, torch.clamp(ratio, 1 - clip.low, "
         "1 + clip.high) * adv)", "return ratio * adv", CLIP_TEST),
        ("symmetric clip: epsilon_high ignored", "1 - clip.low, 1 + clip.high", "1 - clip.low, 1 + clip.low",
         CLIP_TEST),
        ("epsilons swapped", "1 - clip.low, 1 + clip.high", "1 - clip.high, 1 + clip.low", CLIP_TEST),
    ],
    "common.py::clip_stats": [
        ("clip fractions count either sign of A", "(ratio > 1 + clip.high) & (adv > 0)", "(ratio > 1 + clip.high)",
         STATS_TEST),
        ("clip_frac_high counted at epsilon_low", "(ratio > 1 + clip.high) & (adv > 0)",
         "(ratio > 1 + clip.low) & (adv > 0)", STATS_TEST),
        ("approx_kl as the mean log-ratio (k1)", "masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask)",
         "masked_mean(-log_ratio, mask)", STATS_TEST),
        ("clip_frac_low over the padding too", "masked_mean(((ratio < 1 - clip.low) & (adv < 0)).float(), mask)",
         "((ratio < 1 - clip.low) & (adv < 0)).float().mean()", PPO_PADDING),
        ("clip_frac_high as the mean of the rows' means",
         "masked_mean(((ratio > 1 + clip.high) & (adv > 0)).float(), mask)",
         "masked_mean(((ratio > 1 + clip.high) & (adv > 0)).float(), mask, dim=1).mean()", DAPO_PADDING),
        ("approx_kl over the padding too", "masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask)",
         "(torch.exp(log_ratio) - 1 - log_ratio).mean()", GRPO_PADDING),
    ],
    "lab/corrections.py::truncated_is_weight": [
        ("not detached", ".clamp(max=cap).detach()", ".clamp(max=cap)",
         "test_truncated_is_weight_is_the_capped_detached_ratio"),
        ("ratio upside down", "torch.exp(logp - rollout_logp)", "torch.exp(rollout_logp - logp)",
         "test_truncated_is_weight_is_the_capped_detached_ratio"),
        ("clipped on both sides, to [1/cap, cap]", ".clamp(max=cap)", ".clamp(min=1 / cap, max=cap)",
         "test_truncated_is_weight_is_the_capped_detached_ratio"),
    ],
    "lab/corrections.py::geometric_sequence_mask": [
        ("the sum of the log-ratios, not their mean", "drift = masked_mean(", "drift = masked_sum(",
         "test_geometric_sequence_mask_uses_the_mean_log_ratio_over_valid_tokens_and_spares_a_positive_advantage"),
        ("mean over padding too", "masked_mean((old_logp - logp).detach(), mask, dim=1)",
         "(old_logp - logp).detach().mean(1)",
         "test_geometric_sequence_mask_uses_the_mean_log_ratio_over_valid_tokens_and_spares_a_positive_advantage"),
        ("masks a positive advantage too", "((adv < 0) & (drift > delta))", "(drift > delta)",
         "test_geometric_sequence_mask_uses_the_mean_log_ratio_over_valid_tokens_and_spares_a_positive_advantage"),
        ("log-ratio the wrong way round", "(old_logp - logp).detach()", "(logp - old_logp).detach()",
         "test_geometric_sequence_mask_uses_the_mean_log_ratio_over_valid_tokens_and_spares_a_positive_advantage"),
        ("two-sided: a drift below -delta masks too", "(drift > delta)", "(drift.abs() > delta)",
         "test_geometric_mask_sees_drifts_of_both_signs_through_the_mean_over_valid_tokens"),
    ],
    "lab/losses.py::ratio_weighted_kl": [
        ("the ratio detached (k3 keeps its forward-KL gradient)", "ratio = torch.exp(logp - old_logp)",
         "ratio = torch.exp(logp - old_logp).detach()",
         "test_ratio_weighted_kl_with_the_ratio_in_the_graph_gives_the_reverse_kl_gradient_off_policy"),
        ("ratio upside down: pi_old / pi_theta", "ratio = torch.exp(logp - old_logp)",
         "ratio = torch.exp(old_logp - logp)",
         "test_ratio_weighted_kl_with_the_ratio_in_the_graph_gives_the_reverse_kl_gradient_off_policy"),
        ("old_logp ignored: the plain estimator", "ratio = torch.exp(logp - old_logp)",
         "return common.kl_penalty(logp, ref_logp, estimator)",
         "test_ratio_weighted_k3_on_a_sequence_is_the_per_state_reverse_kl_over_the_samplers_states"),
        ("ratio * k3 as a plain product: float32 loses its gradient far from the reference",
         'if estimator == "k3":', "if False:",
         "test_ratio_weighted_k3_keeps_its_gradient_in_float32_far_from_the_reference"),
    ],
    "remax.py::remax_advantages": [
        ("sign flipped", "return rewards - greedy_rewards", "return greedy_rewards - rewards",
         "test_remax_advantage_subtracts_the_greedy_reward"),
        ("no baseline", "return rewards - greedy_rewards", "return rewards",
         "test_remax_advantage_subtracts_the_greedy_reward"),
    ],
    "remax.py::remax_loss": [
        ("each token's own k1, not its reward-to-go", "common.reward_to_go(kl, mask)", "kl * mask",
         "test_remax_loss_returns_fold_kl_reward_to_go"),
        ("KL penalty's sign flipped", "adv[:, None] - beta", "adv[:, None] + beta",
         "test_remax_loss_returns_fold_kl_reward_to_go"),
        ("loss_agg ignored (always token-mean)", "-returns * logp, mask, loss_agg)",
         '-returns * logp, mask, "token-mean")',
         "test_remax_loss_gradient_is_reinforce_with_baseline"),
        ("max_len ignored (divides by the batch width)", "-returns * logp, mask, loss_agg)",
         "-returns * logp, mask, loss_agg[0] if isinstance(loss_agg, tuple) else loss_agg)",
         "test_remax_loss_seq_mean_token_sum_norm_divides_by_max_len_not_the_batch_width"),
        ("return not detached: the KL penalty's own gradient leaks in", ").detach()\n", ")\n",
         "test_remax_loss_does_not_backpropagate_through_the_return"),
        ("return_mean over padding too", "common.masked_mean(returns, mask)", "returns.mean()",
         "test_remax_loss_returns_fold_kl_reward_to_go"),
        ("return_mean as the mean of the rows' means", "common.masked_mean(returns, mask)",
         "common.masked_mean(returns, mask, dim=1).mean()",
         "test_remax_loss_and_return_mean_of_a_padded_batch_weigh_every_valid_token"),
    ],
    "rloo.py::rloo_advantages": [
        ("mean including self (Dr. GRPO's baseline)",
         "(grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)", "grouped.mean(dim=1, keepdim=True)",
         "test_rloo_advantage_is_reward_minus_mean_of_the_others"),
        ("divides by K instead of K - 1", "/ (group_size - 1)", "/ group_size",
         "test_rloo_advantage_is_reward_minus_mean_of_the_others"),
        ("groups strided, not adjacent", "grouped = rewards.view(-1, group_size)",
         "grouped = rewards.view(group_size, -1).T.contiguous()",
         "test_rloo_advantage_is_reward_minus_mean_of_the_others"),
    ],
    "rloo.py::rloo_loss": [
        ("token mean instead of the sequence sum", "-adv.detach()[:, None] * logp, mask, loss_agg)",
         '-adv.detach()[:, None] * logp, mask, "seq-mean-token-mean")',
         "test_rloo_loss_treats_the_whole_sequence_as_one_action"),
        ("padding summed too", "-adv.detach()[:, None] * logp, mask, loss_agg)",
         "-adv.detach()[:, None] * logp, torch.ones_like(mask), loss_agg)",
         "test_rloo_loss_treats_the_whole_sequence_as_one_action"),
        ("advantage not detached", "-adv.detach()[:, None]", "-adv[:, None]",
         "test_rloo_loss_does_not_backpropagate_into_the_advantage"),
        ("sign flipped", "(-adv.detach()[:, None] * logp", "(adv.detach()[:, None] * logp",
         "test_rloo_loss_treats_the_whole_sequence_as_one_action"),
        ("seq_logp_mean sums the padding too", "seq_logp = common.masked_sum(logp, mask, dim=1)",
         "seq_logp = logp.sum(1)", "test_rloo_loss_treats_the_whole_sequence_as_one_action"),
    ],
    "grpo.py::grpo_advantages": [
        ("std without Bessel's correction (ddof 0)", "grouped.std(dim=1, keepdim=True)",
         "grouped.std(dim=1, keepdim=True, correction=0)", "test_group_advantage_uses_bessel_std_and_eps"),
        ("no eps", "(grouped.std(dim=1, keepdim=True) + eps)", "grouped.std(dim=1, keepdim=True)",
         "test_group_advantage_eps_keeps_a_tiny_std_finite"),
        ("all-equal group not set to 0 (the float32 mean rounds)", "adv[(grouped == grouped[:, :1]).all(dim=1)] = 0.0",
         "pass", "test_all_equal_group_gives_exactly_zero_advantage"),
        ("'batch' divides by the group's std", "adv = adv / (rewards.std() + eps)",
         "adv = adv / (grouped.std(dim=1, keepdim=True) + eps)", "test_scale_rewards_group_batch_none"),
        ("'none' still divides by the std", 'elif scale_rewards != "none":\n        raise ValueError',
         "else:\n        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)\n    if False:\n        raise ValueError",
         "test_scale_rewards_group_batch_none"),
        ("groups strided, not adjacent", "grouped = rewards.view(-1, group_size)",
         "grouped = rewards.view(group_size, -1).T.contiguous()", "test_group_advantage_uses_bessel_std_and_eps"),
    ],
    "grpo.py::grpo_loss": [
        ("ratio upside down: pi_old / pi_theta", "ratio = torch.exp(log_ratio)", "ratio = torch.exp(-log_ratio)",
         "test_clip_gradient_is_zero_exactly_on_the_clipped_side"),
        ("KL term's sign flipped", "common.aggregate_loss(-surrogate + beta * kl,",
         "common.aggregate_loss(-surrogate - beta * kl,", "test_k3_term_value_and_gradient"),
        ("KL term detached", "common.kl_penalty(logp, ref_logp", "common.kl_penalty(logp.detach(), ref_logp",
         "test_k3_term_value_and_gradient"),
        ("the KL estimator ignored (always k3)", "common.kl_penalty(logp, ref_logp, kl_estimator)",
         "common.kl_penalty(logp, ref_logp)", "test_kl_estimator_k2_and_k3_with_the_ratio_weight_give_the_k2_gradient"),
        ("mask forgotten: padding in the loss", "common.aggregate_loss(-surrogate + beta * kl, mask,",
         "common.aggregate_loss(-surrogate + beta * kl, torch.ones_like(mask),",
         "test_loss_ignores_tokens_after_the_mask"),
        ("loss_agg ignored", "-surrogate + beta * kl, mask, loss_agg)",
         '-surrogate + beta * kl, mask, "seq-mean-token-mean")',
         "test_with_one_iteration_ratio_is_one_and_gradient_is_the_policy_gradient"),
        ("kl_term over the padding too", '"kl_term": common.masked_mean(kl, mask)', '"kl_term": kl.mean()',
         GRPO_PADDING),
        ("kl_k3 as the mean of the rows' means", "ref_logp is not None else kl, mask)",
         "ref_logp is not None else kl, mask, dim=1).mean()", GRPO_PADDING),
    ],
    "dapo.py::grpo_advantages": [
        ("std without Bessel's correction (ddof 0)", "grouped.std(dim=1, keepdim=True)",
         "grouped.std(dim=1, keepdim=True, correction=0)", "test_advantage_is_grpos_group_advantage"),
        ("no eps", "(grouped.std(dim=1, keepdim=True) + eps)", "grouped.std(dim=1, keepdim=True)",
         "test_advantage_is_grpos_group_advantage"),
        ("all-equal group not set to 0 (the float32 mean rounds)", "adv[(grouped == grouped[:, :1]).all(dim=1)] = 0.0",
         "pass", "test_grpo_advantage_of_an_all_equal_float32_group_is_exactly_zero"),
        ("'batch' divides by the group's std", "adv = adv / (rewards.std() + eps)",
         "adv = adv / (grouped.std(dim=1, keepdim=True) + eps)", "test_advantage_is_grpos_group_advantage"),
    ],
    "dapo.py::dynamic_sampling_filter": [
        ("drops only all-wrong groups", "(grouped != grouped[:, :1]).any(dim=1)", "grouped.sum(dim=1) > 0",
         "test_dynamic_sampling_keeps_only_groups_with_mixed_correctness"),
        ("groups strided, not adjacent", "grouped = correct.view(-1, group_size)",
         "grouped = correct.view(group_size, -1).T", "test_dynamic_sampling_keeps_only_groups_with_mixed_correctness"),
    ],
    "dapo.py::overlong_penalty": [
        ("penalty from max_len, not max_len - cache_len", "expected_max = max_len - cache_len",
         "expected_max = max_len", "test_overlong_penalty_check_values_from_the_paper"),
        ("off by one at max_len - cache_len", "((expected_max - lengths) / cache_len)",
         "((expected_max - lengths - 1) / cache_len)", "test_overlong_penalty_check_values_from_the_paper"),
        ("not capped at -1", ".clamp(min=-1.0, max=0.0)", ".clamp(max=0.0)",
         "test_overlong_penalty_check_values_from_the_paper"),
        ("cache_len = 0 divides by zero", "if cache_len == 0:", "if False:",
         "test_overlong_penalty_with_no_cache_only_punishes_past_max_len"),
    ],
    "dapo.py::dapo_loss": [
        ("ratio upside down: pi_old / pi_theta", "ratio = torch.exp(log_ratio)", "ratio = torch.exp(-log_ratio)",
         "test_clip_higher_bounds"),
        ("GRPO's seq-mean-token-mean", "aggregate_loss(-surrogate, mask, loss_agg)",
         'aggregate_loss(-surrogate, mask, "seq-mean-token-mean")',
         "test_dapo_loss_is_a_token_mean_over_the_batch"),
        ("mask forgotten: padding in the mean", "aggregate_loss(-surrogate, mask, loss_agg)",
         "aggregate_loss(-surrogate, torch.ones_like(mask), loss_agg)",
         "test_dapo_loss_is_a_token_mean_over_the_batch"),
    ],
    "ppo.py::gae": [
        ("values after EOS not masked: the padding's returns are its values",
         "values = torch.where(acts, values, torch.zeros_like(values))", "values = values",
         "test_gae_padding_does_not_change_valid_advantages_and_gets_zero"),
        ("masked by multiplying: a NaN in the padding leaks",
         "values = torch.where(acts, values, torch.zeros_like(values))", "values = values * mask",
         "test_gae_of_a_padded_batch_with_one_lambda_per_row_treats_each_row_alone"),
        ("off by one: delta_t = r_t + gamma V_t - V_t",
         "        delta = rewards[:, t] + gamma * next_value - values[:, t]\n",
         "        next_value = values[:, t]\n        delta = rewards[:, t] + gamma * next_value - values[:, t]\n",
         "test_gae_hand_computed_values"),
        ("lambda without gamma: A_t = delta_t + lam A_{t+1}", "gamma * lam * next_adv", "lam * next_adv",
         "test_gae_hand_computed_values"),
        ("the loop runs forwards in time", "reversed(range(rewards.shape[1]))", "range(rewards.shape[1])",
         "test_gae_hand_computed_values"),
        ("the environment's tokens are steps: V_{t+1} at every position",
         "next_value = torch.where(acts[:, t], values[:, t], next_value)", "next_value = values[:, t]",
         "test_gae_of_an_episode_skips_the_environments_tokens"),
        ("the environment's tokens are steps: the recursion runs through them",
         "next_adv = torch.where(acts[:, t], delta + gamma * lam * next_adv, next_adv)",
         "next_adv = delta + gamma * lam * next_adv", "test_gae_of_an_episode_skips_the_environments_tokens"),
        ("returns from the next value: R_t = A_t + V_{t+1}", "returns = advantages + values",
         "returns = advantages + torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)",
         "test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value"),
    ],
    "vapo.py::decoupled_gae": [
        ("the two lambdas swapped", "advantages, _ = gae(rewards, values, mask, gamma, lam_policy)",
         "advantages, _ = gae(rewards, values, mask, gamma, lam_critic)",
         "test_decoupled_gae_takes_advantages_with_the_policy_lambda_and_targets_with_the_critics"),
        ("lam_critic ignored", "_, returns = gae(rewards, values, mask, gamma, lam_critic)",
         "_, returns = gae(rewards, values, mask, gamma, lam_policy)",
         "test_decoupled_gae_takes_advantages_with_the_policy_lambda_and_targets_with_the_critics"),
    ],
    "reinforce_pp.py::reinforce_pp_advantages": [
        ("the padding's kl kept (NaN spreads)", "kl = torch.where(mask.bool(), kl, 0.0)", "kl = kl",
         "test_return_is_the_reward_to_go_with_k1_in_each_tokens_reward_whitened_over_the_batch"),
        ("the KL summed from the start, not to the end", "kl.flip(1).cumsum(1).flip(1)", "kl.cumsum(1)",
         "test_return_is_the_reward_to_go_with_k1_in_each_tokens_reward_whitened_over_the_batch"),
        ("the whole sequence's KL on every token", "kl.flip(1).cumsum(1).flip(1)", "kl.sum(1, keepdim=True)",
         "test_return_is_the_reward_to_go_with_k1_in_each_tokens_reward_whitened_over_the_batch"),
        ("whitened per row, not over the batch", "return common.masked_whiten(returns, mask)",
         "return torch.stack([common.masked_whiten(r, m) for r, m in zip(returns, mask)])",
         "test_return_is_the_reward_to_go_with_k1_in_each_tokens_reward_whitened_over_the_batch"),
        ("the baseline variant without the group mean", "(grouped - grouped.mean(dim=1, keepdim=True))", "grouped",
         "test_baseline_variant_subtracts_the_group_mean_of_the_sequence_return_then_whitens_its_tokens"),
        ("groups strided, not adjacent", "grouped = (rewards - beta * kl.sum(1)).view(-1, group_size)",
         "grouped = (rewards - beta * kl.sum(1)).view(group_size, -1).T.contiguous()",
         "test_baseline_variant_subtracts_the_group_mean_of_the_sequence_return_then_whitens_its_tokens"),
    ],
    "kimi.py::length_reward": [
        ("a wrong answer rewarded for being short", "torch.where(right, lam, lam.clamp(max=0.0))",
         "torch.where(right, lam, lam)",
         "test_length_reward_is_lambda_for_a_right_answer_and_min_zero_lambda_for_a_wrong_one_within_each_group"),
        ("a wrong answer always 0", "torch.where(right, lam, lam.clamp(max=0.0))", "torch.where(right, lam, 0.0)",
         "test_length_reward_is_lambda_for_a_right_answer_and_min_zero_lambda_for_a_wrong_one_within_each_group"),
        ("all-equal lengths get 0.5", "torch.where(spread > 0, 0.5 - (lengths - shortest) / safe, 0.0)",
         "0.5 - (lengths - shortest) / safe",
         "test_length_reward_is_lambda_for_a_right_answer_and_min_zero_lambda_for_a_wrong_one_within_each_group"),
        ("the sign turned: the longest gains", "0.5 - (lengths - shortest) / safe",
         "(lengths - shortest) / safe - 0.5",
         "test_length_reward_ranges_from_half_for_the_shortest_to_minus_half_for_the_longest_right_answer"),
        ("min and max over the whole batch", "lengths.min(dim=1, keepdim=True).values", "lengths.min()",
         "test_length_reward_is_lambda_for_a_right_answer_and_min_zero_lambda_for_a_wrong_one_within_each_group"),
    ],
    "kimi.py::priority_weights": [
        ("the solved prompts favoured: weight s_i", "weights = 1.0 - success_rates.double()",
         "weights = success_rates.double()", "test_priority_weights_are_proportional_to_one_minus_the_success_rate"),
        ("not normalised", "return weights / total if total > 0", "return weights if total > 0",
         "test_priority_weights_are_proportional_to_one_minus_the_success_rate"),
        ("every prompt solved: 0 / 0", "return weights / total if total > 0 else", "return weights / total if True else",
         "test_priority_weights_are_proportional_to_one_minus_the_success_rate"),
    ],
    "vapo.py::length_adaptive_lam": [
        ("not clamped at 0", ".clamp(min=0.0)", "",
         "test_length_adaptive_lambda_is_one_minus_one_over_alpha_length_clamped_at_zero"),
        ("1/(alpha |y|) without the 1 -", "(1 - 1 / (alpha * lengths.float()))", "(1 / (alpha * lengths.float()))",
         "test_length_adaptive_lambda_is_one_minus_one_over_alpha_length_clamped_at_zero"),
        ("alpha in the numerator: 1 - alpha / |y|", "(1 - 1 / (alpha * lengths.float()))",
         "(1 - alpha / lengths.float())",
         "test_length_adaptive_lambda_is_one_minus_one_over_alpha_length_clamped_at_zero"),
    ],
    "ppo.py::ppo_policy_loss": [
        ("ratio upside down: pi_old / pi_theta", "ratio = torch.exp(log_ratio)", "ratio = torch.exp(-log_ratio)",
         "test_policy_loss_gradient_is_zero_exactly_where_clipped"),
        ("mask forgotten: mean over padding", "common.aggregate_loss(-surrogate, mask, loss_agg)",
         "common.aggregate_loss(-surrogate, torch.ones_like(mask), loss_agg)",
         "test_policy_loss_masks_padding_and_reports_the_ratio_kl"),
        ("loss_agg ignored (a sum over the tokens)", "common.aggregate_loss(-surrogate, mask, loss_agg)",
         "common.masked_sum(-surrogate, mask)", "test_policy_loss_masks_padding_and_reports_the_ratio_kl"),
    ],
    "ppo.py::ppo_value_loss": [
        ("min instead of max", "torch.max(unclipped, clipped)", "torch.min(unclipped, clipped)",
         "test_value_clip_never_stops_a_move_back_towards_the_return"),
        ("the 1/2 forgotten", "loss = 0.5 * common.aggregate_loss", "loss = common.aggregate_loss",
         "test_value_loss_inside_the_clip_is_half_squared_error"),
        ("clipped around the return, not the old value",
         "old_values + torch.clamp(values - old_values, -epsilon_value, epsilon_value)",
         "returns + torch.clamp(values - returns, -epsilon_value, epsilon_value)",
         "test_value_clip_stops_a_move_past_the_clip_towards_the_return"),
        ("mean over padding", "common.aggregate_loss(torch.max(unclipped, clipped), mask, loss_agg)",
         "common.aggregate_loss(torch.max(unclipped, clipped), torch.ones_like(mask), loss_agg)",
         "test_value_loss_is_a_token_mean_over_the_mask"),
        ("clip_frac counts ties", "((clipped > unclipped) & binds)", "(clipped >= unclipped)",
         "test_value_loss_inside_the_clip_is_half_squared_error"),
        ("clip_frac over the padding too", "common.masked_mean(((clipped > unclipped) & binds).float(), mask)",
         "((clipped > unclipped) & binds).float().mean()", "test_ppo_value_loss_and_clip_fraction_ignore_the_padding"),
    ],
    "vapo.py::positive_example_nll": [
        ("a sum, not a token-mean", "return -common.masked_sum(logp, positive) / torch.where(n > 0, n, 1.0)",
         "return -common.masked_sum(logp, positive)", VAPO_NLL),
        ("the wrong samples' tokens too", "positive = mask * correct[:, None]", "positive = mask * 1.0", VAPO_NLL),
        ("the micro-batch's own N, not num_tokens", "n = positive.sum() if num_tokens is None else",
         "n = positive.sum() if True else", VAPO_NLL),
        ("the padding of the correct samples too", "positive = mask * correct[:, None]",
         "positive = torch.ones_like(mask) * correct[:, None]", VAPO_NLL),
    ],
    "objectives.py::cispo_loss": [
        ("the capped ratio not detached (a ratio in the gradient)", "ratio = torch.exp(logp.detach() - old_logp)",
         "ratio = torch.exp(logp - old_logp)", "test_cispo_closed_form_gradient"),
        ("the weight alone, no log pi: every gradient 0", "surrogate = weight * adv[:, None] * logp",
         "surrogate = weight * adv[:, None]", "test_cispo_weight_is_the_capped_ratio_and_no_token_is_silenced"),
        ("eps_high read as an absolute cap", "max=1 + high)", "max=high)",
         "test_cispo_weight_is_the_capped_ratio_and_no_token_is_silenced"),
        ("a junk pg_weight in the padding reaches the gradient",
         "torch.where(mask.bool(), pg_weight, 0.0) * surrogate", "pg_weight * surrogate",
         "test_each_objective_keeps_a_junk_padding_weight_out_of_the_gradient"),
        ("clip_frac_high counts only A > 0, as PPO's", "(ratio > 1 + high).float()",
         "((ratio > 1 + high) & (adv[:, None] > 0)).float()",
         "test_cispo_weight_is_the_capped_ratio_and_no_token_is_silenced"),
    ],
    "objectives.py::sapo_loss": [
        ("the temperatures swapped", "torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg)",
         "torch.full_like(adv, tau_neg), torch.full_like(adv, tau_pos)",
         "test_sapo_hand_values_pick_tau_by_the_sign_of_the_advantage"),
        ("A = 0 takes tau_pos", "torch.where(adv > 0,", "torch.where(adv >= 0,",
         "test_sapo_hand_values_pick_tau_by_the_sign_of_the_advantage"),
        ("the ratio detached: no gradient through the gate", "ratio = torch.exp(log_ratio)",
         "ratio = torch.exp(log_ratio).detach()", "test_sapo_closed_form_gradient_and_gate_weight"),
        ("gate_weight as the gate's value, not its slope times r", "4 * ratio * gate * (1 - gate)", "4 / tau * gate",
         "test_sapo_closed_form_gradient_and_gate_weight"),
    ],
    "objectives.py::gmpo_loss": [
        ("both bounds clipped whatever the sign of A",
         "torch.where(clipped_low | clipped_high, bound, log_ratio)", "torch.clamp(log_ratio, -low, high)",
         "test_gmpo_hand_case_clips_each_token_before_the_geometric_mean"),
        ("the log-ratios summed: the product of the ratios",
         "common.masked_mean(clipped_log_ratio, mask, dim=1)", "common.masked_sum(clipped_log_ratio, mask, dim=1)",
         "test_gmpo_hand_case_clips_each_token_before_the_geometric_mean"),
        ("the mean over the padding too", "common.masked_mean(clipped_log_ratio, mask, dim=1)",
         "clipped_log_ratio.mean(dim=1)", "test_gmpo_counts_each_sequence_once_and_ignores_the_padding"),
        ("loss_agg's token-mean kept: a sequence counted once per token", "common.per_sequence(loss_agg)", "loss_agg",
         "test_gmpo_counts_each_sequence_once_and_ignores_the_padding"),
        ("the lower bound binds for A > 0", "clipped_low = (adv < 0)", "clipped_low = (adv > 0)",
         "test_gmpo_hand_case_clips_each_token_before_the_geometric_mean"),
    ],
    "opd.py::rloo_advantages": [
        ("mean including self (Dr. GRPO's baseline)",
         "(grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)", "grouped.mean(dim=1, keepdim=True)",
         "test_task_advantage_is_rloos_leave_one_out"),
        ("divides by K instead of K - 1", "/ (group_size - 1)", "/ group_size",
         "test_task_advantage_is_rloos_leave_one_out"),
        ("groups strided, not adjacent", "grouped = rewards.view(-1, group_size)",
         "grouped = rewards.view(group_size, -1).T.contiguous()", "test_task_advantage_is_rloos_leave_one_out"),
    ],
    "opd.py::opd_advantages": [
        ("the forward direction: teacher minus student", "logp.detach() - teacher_logp",
         "teacher_logp - logp.detach()", "test_advantage_hand_values_student_first"),
        ("not detached", "reverse_kl = logp.detach() - teacher_logp", "reverse_kl = logp - teacher_logp",
         "test_advantage_hand_values_student_first"),
        ("the task advantage without its weight", "reward_weight * task_adv[:, None]", "task_adv[:, None]",
         "test_advantage_hand_values_student_first"),
        ("the student pushed away from the teacher", "-kl_coef * reverse_kl", "kl_coef * reverse_kl",
         "test_advantage_hand_values_student_first"),
    ],
    "opd.py::opd_loss": [
        ("a NaN advantage in the padding reaches the gradient", "adv = torch.where(mask.bool(), adv, 0.0)",
         "adv = adv", "test_loss_hand_value_and_a_nan_advantage_in_the_padding_never_reaches_the_gradient"),
        ("sign flipped", "per_token = -adv * logp", "per_token = adv * logp",
         "test_loss_hand_value_and_a_nan_advantage_in_the_padding_never_reaches_the_gradient"),
        ("the exact KL without lambda", "per_token + kl_coef * full_kl", "per_token + full_kl",
         "test_loss_hand_value_and_a_nan_advantage_in_the_padding_never_reaches_the_gradient"),
        ("adv_token_mean over the padding too", "common.masked_mean(adv, mask)", "adv.mean()",
         "test_loss_hand_value_and_a_nan_advantage_in_the_padding_never_reaches_the_gradient"),
    ],
    "opd.py::full_reverse_kl": [
        ("the forward KL", "(logprobs.exp() * (logprobs - teacher_logprobs)).sum(-1)",
         "(teacher_logprobs.exp() * (teacher_logprobs - logprobs)).sum(-1)",
         "test_full_reverse_kl_hand_value_and_direction"),
        ("the teacher's probabilities as the weights", "logprobs.exp() *", "teacher_logprobs.exp() *",
         "test_full_reverse_kl_hand_value_and_direction"),
        ("the log-ratios summed, unweighted", "(logprobs.exp() * (logprobs - teacher_logprobs)).sum(-1)",
         "(logprobs - teacher_logprobs).sum(-1)", "test_full_reverse_kl_hand_value_and_direction"),
    ],
    "agents.py::episode_masks": [
        ("token mask = action mask: the environment's tokens hidden from attention",
         "return (token_mask & is_action).long(), token_mask.long()",
         "return (token_mask & is_action).long(), (token_mask & is_action).long()",
         "test_episode_masks_lay_out_segments_one_after_the_other"),
        ("the environment's tokens marked as actions", "return (token_mask & is_action).long(), token_mask.long()",
         "return token_mask.long(), token_mask.long()", "test_episode_masks_lay_out_segments_one_after_the_other"),
        ("the padding marked as actions: the last segment's kind runs on", "(token_mask & is_action).long()",
         "is_action.long()", "test_episode_masks_lay_out_segments_one_after_the_other"),
        ("off by one: a segment's end position counted in it", ">= ends[:, None, :]", "> ends[:, None, :]",
         "test_episode_masks_lay_out_segments_one_after_the_other"),
        ("an empty segment takes one position", "ends = segment_lengths.cumsum(dim=1)",
         "ends = segment_lengths.clamp(min=1).cumsum(dim=1)",
         "test_episode_masks_lay_out_segments_one_after_the_other"),
        ("the row ends at its first empty segment", "token_mask = segment < segment_lengths.shape[1]",
         "token_mask = segment < (segment_lengths > 0).cumprod(dim=1).sum(dim=1, keepdim=True)",
         "test_episode_masks_hand_computed_with_empty_segments_one_segment_and_the_environment_first"),
        ("bool masks, not 0/1 integers", "return (token_mask & is_action).long(), token_mask.long()",
         "return token_mask & is_action, token_mask",
         "test_episode_masks_hand_computed_with_empty_segments_one_segment_and_the_environment_first"),
    ],
    "toy_bandit.py::gradient_variance": [
        ("second moment: (grad J)^2 not subtracted", "return second_moment - (p * (1 - p) * (r1 - r0)) ** 2",
         "return second_moment", "test_two_arm_check_values"),
        ("score not squared", "p * (1 - p) ** 2 * ((r1 - b) ** 2 + noise1)", "p * (1 - p) * ((r1 - b) ** 2 + noise1)",
         "test_two_arm_check_values"),
        ("Bernoulli noise left out", "if bernoulli else (0.0, 0.0)", "if False else (0.0, 0.0)",
         "test_two_arm_variance_is_a_parabola_in_b_around_b_star"),
        ("each arm's noise on the other arm", "(r1 * (1 - r1), r0 * (1 - r0))", "(r0 * (1 - r0), r1 * (1 - r1))",
         "test_two_arm_variance_is_a_parabola_in_b_around_b_star"),
    ],
    "toy_bandit.py::optimal_baseline": [
        ("the expected reward (Sutton's baseline)", "return (1 - p) * r1 + p * r0", "return p * r1 + (1 - p) * r0",
         "test_optimal_baseline_is_argmin_of_variance"),
        ("E[r s^2] without dividing by E[s^2]", "return (1 - p) * r1 + p * r0",
         "return p * (1 - p) * ((1 - p) * r1 + p * r0)", "test_optimal_baseline_is_argmin_of_variance"),
    ],
    "toy_bandit.py::two_arm_baselines": [
        ("greedy tie goes to action 1", "np.where(p > 0.5, r1, r0)", "np.where(p >= 0.5, r1, r0)",
         "test_greedy_tie_break_goes_to_lowest_index"),
        ("greedy = the better arm's reward, not the likelier action's", "np.where(p > 0.5, r1, r0)",
         "np.maximum(r1, r0) + 0 * p", "test_two_arm_check_values"),
        ("mean with the probabilities swapped", '"mean": p * r1 + (1 - p) * r0', '"mean": (1 - p) * r1 + p * r0',
         "test_two_arm_check_values"),
    ],
    "toy_bandit.py::softmax_gradient_variance": [
        ("||s||^2 without the ||pi||^2 term", "sq_norm = 1 - 2 * pi + pi @ pi", "sq_norm = 1 - 2 * pi",
         "test_k_arm_check_values"),
        ("(grad J)^2 not subtracted", "- grad_J @ grad_J", "", "test_k_arm_check_values"),
        ("grad J without the mean reward: pi * r", "grad_J = pi * (r - pi @ r)", "grad_J = pi * r",
         "test_k_arm_check_values"),
        ("Bernoulli noise left out", "noise = r * (1 - r) if bernoulli else 0.0", "noise = 0.0",
         "test_closed_form_matches_monte_carlo"),
    ],
    "toy_bandit.py::softmax_optimal_baseline": [
        ("the expected reward", "return (pi * r * sq_norm).sum() / (1 - pi @ pi)", "return pi @ r",
         "test_k_arm_optimal_baseline_is_argmin_of_variance"),
        ("not divided by W = 1 - ||pi||^2", "return (pi * r * sq_norm).sum() / (1 - pi @ pi)",
         "return (pi * r * sq_norm).sum()", "test_k_arm_optimal_baseline_is_argmin_of_variance"),
        ("||s||^2 weights left out", "(pi * r * sq_norm).sum()", "(pi * r).sum()",
         "test_k_arm_optimal_baseline_is_argmin_of_variance"),
    ],
    "toy_bandit.py::softmax_baselines": [
        ("greedy = the best reward, not the likeliest action's", "r[np.argmax(pi)]", "r.max()",
         "test_greedy_tie_break_goes_to_lowest_index"),
        ("greedy tie goes to the highest index", "r[np.argmax(pi)]", "r[len(pi) - 1 - np.argmax(pi[::-1])]",
         "test_greedy_tie_break_goes_to_lowest_index"),
        ("mean = the unweighted mean of r", '"mean": pi @ r', '"mean": r.mean()', "test_k_arm_check_values"),
    ],
}


def wrong_source(root, key, old, new):
    """The source of `key`'s function with `old` replaced by `new` in its solution region (None: as is)."""
    file, name = key.split("::")
    text = (root / file).read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    ((start, end),) = [(s, e) for s, e, _, function, _ in msc.regions(text) if function == name]
    # the edit applies to the code, not to the # HINT lines (blanked, so line numbers stay)
    region = "".join("\n" if line.strip().startswith(msc.HINT) else line for line in lines[start:end + 1])
    if old is not None and region.count(old) != 1:
        raise ValueError(f"{key}: {old!r} occurs {region.count(old)} times in the solution, not once")
    patched = "".join(lines[:start]) + (region if old is None else region.replace(old, new)) + "".join(lines[end + 1:])
    (func,) = [n for n in ast.parse(patched).body if isinstance(n, ast.FunctionDef) and n.name == name]
    return ast.get_source_segment(patched, func)


def wrong_code(root, key, old, new):
    """The code object of the wrong version, compiled in the namespace of the (imported) module."""
    namespace = dict(sys.modules[msc.module_name(key.split("::")[0])].__dict__)
    exec(compile(wrong_source(root, key, old, new), f"<wrong {key}>", "exec"), namespace)
    return namespace[key.split("::")[1]].__code__


@contextmanager
def swapped(key, code):
    function = getattr(sys.modules[msc.module_name(key.split("::")[0])], key.split("::")[1])
    saved, function.__code__ = function.__code__, code
    try:
        yield
    finally:
        function.__code__ = saved


class WrongAnswerRunner:
    """pytest plugin: rerun each passing grading test with every wrong version of what it grades."""

    def __init__(self, root):
        self.root = root
        self.grades = {}  # test node id (no parameters) -> the exercises it grades
        for key in msc.EXERCISES:
            for node in grading_tests(key):
                self.grades.setdefault(node, []).append(key)
        self.caught = {(key, i): set() for key, wrong in WRONG_ANSWERS.items() for i in range(len(wrong))}
        self.codes = {}  # (key, i) -> the wrong version's code object, compiled once
        self.reference_failed = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        outcome = yield
        node = item.nodeid.split("[")[0]
        if outcome.excinfo is not None:
            self.reference_failed.append(item.nodeid)
            return
        for key in self.grades.get(node, []):
            for i, (_, old, new, _) in enumerate(WRONG_ANSWERS.get(key, [])):
                if (key, i) not in self.codes:
                    self.codes[key, i] = wrong_code(self.root, key, old, new)
                with swapped(key, self.codes[key, i]):
                    try:
                        item.runtest()
                    except (Exception, pytest.fail.Exception):  # an error is caught too
                        self.caught[key, i].add(node.split("::")[1])


def check(root=ROOT):
    """Run the tests with every wrong version, then grade each; returns (rows, reference failures)."""
    runner = WrongAnswerRunner(root)
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                        *(str(root / node) for node in all_grading_tests())], plugins=[runner])
    rows = []
    for key, wrong in WRONG_ANSWERS.items():
        function = getattr(sys.modules[msc.module_name(key.split("::")[0])], key.split("::")[1])
        for i, (description, old, new, catcher) in enumerate(wrong):
            caught = sorted(runner.caught[key, i])
            with swapped(key, runner.codes.get((key, i)) or wrong_code(root, key, old, new)):
                graded = [grade.check_function(key, function, seed) for seed in GRADE_SEEDS]
            rows.append({"exercise": key, "wrong": description, "named_test": catcher, "failed_tests": caught,
                         "caught": catcher in caught, "graded_zero": not any(passed for passed, _ in graded),
                         "grade": graded[0][1]})
    return rows, runner.reference_failed or ([] if code == 0 else [f"pytest exit status {int(code)}"])


def all_grading_tests():
    """The node ids of every exercise's grading tests (visible and hidden), each once."""
    return list(dict.fromkeys(node for key in msc.EXERCISES for node in grading_tests(key)))


def catcher_node(key, catcher):
    """The grading test of `key` named `catcher`, as file::name."""
    (node,) = [n for n in grading_tests(key) if n.split("::")[1] == catcher]
    return f"{Path(node.split('::')[0]).name}::{catcher}"


def table():
    rows = ["| Exercise | Wrong version | Caught by |", "|---|---|---|"]
    for key, wrong in WRONG_ANSWERS.items():
        file = key.split("::")[0]
        for i, (description, _, _, catcher) in enumerate(wrong):
            exercise = f"`{msc.exercise_name(key)}` (`{file}`)" if i == 0 else ""
            rows.append(f"| {exercise} | {description.replace('|', chr(92) + '|')} | `{catcher_node(key, catcher)}` |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="Print the table of wrong versions (markdown) and exit.")
    parser.add_argument("--json", help="Also write the results to this file.")
    args = parser.parse_args()
    if args.list:
        print(table())
        return
    rows, reference_failed = check()
    for row in rows:
        status = "caught" if row["caught"] else "NOT CAUGHT"
        graded = "graded 0" if row["graded_zero"] else "GRADED FULL MARKS"
        print(f"{status:>10}, {graded}  {row['exercise']}: {row['wrong']}  (failed: "
              f"{', '.join(row['failed_tests']) or 'none'}; grade: {row['grade']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "reference_failed": reference_failed}, indent=1))
    missed = [r for r in rows if not r["caught"] or not r["graded_zero"]]
    print(f"\n{sum(r['caught'] for r in rows)} of {len(rows)} wrong versions caught by the test the table names, "
          f"{sum(r['graded_zero'] for r in rows)} graded 0 (seeds {', '.join(map(str, GRADE_SEEDS))}); "
          f"reference failures: {reference_failed or 'none'}")
    sys.exit(1 if missed or reference_failed else 0)


if __name__ == "__main__":
    main()
