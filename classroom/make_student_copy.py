"""Write a student copy of this project: the core math removed, our tests left in to grade it.

    python classroom/make_student_copy.py ../student   # write the copy, print the exercises
    python classroom/make_student_copy.py --list       # the exercise table (markdown)
    python classroom/make_student_copy.py --tests      # node ids of the grading tests, for pytest

The reference marks the computing body of each exercise function with two comment lines,
`# BEGIN SOLUTION` and `# END SOLUTION`. In the copy that region becomes the first-level hint of
classroom/hint.py as `# HINT:` lines (what to compute, where the equation is, the shapes, the traps)
followed by `raise NotImplementedError("implement <function> ...")`. The teacher's files (the
grader, its hidden tests, the wrong versions of each exercise and their test, the mutation run)
are left out, and docs/classroom.md stops where its teacher's part begins; everything else is
copied as is.
"""
import argparse
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "classroom"))
from hint import HINTS  # noqa: E402

BEGIN, END, HINT = "# BEGIN SOLUTION", "# END SOLUTION", "# HINT:"
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "venv", "runs", "__pycache__", ".pytest_cache", "mutants"}
# The teacher's files: the grader (its sandboxed runner, its hidden cases and tests), the wrong versions of
# each exercise (pieces of the solutions) and the grader's tests, the mutation run, the tests against the peers'
# formulas (working versions of exercises). A path ending in "/" is a folder.
TEACHER_ONLY = {"classroom/wrong_answers.py", "classroom/grade.py", "classroom/runner.py", "classroom/mutation.py",
                "classroom/teacher_tests/", "tests/test_grading.py", "tests/test_grader_attacks.py",
                "tests/test_objectives_peers.py"}
TEACHER_PART = "<!-- The student copy ends this page here: below is for teachers. -->"
# docs/algorithms.md's forms that an exercise asks a student to find (the toy bandit's variances and baselines,
# the fp32-exact ratio-weighted k3): in the copy each marked region becomes ANSWER_NOTE
ANSWER_PAGE, ANSWER_BEGIN, ANSWER_END = "docs/algorithms.md", "<!-- exercise-answer -->", "<!-- /exercise-answer -->"
ANSWER_NOTE = ("(In the student copy this form is what an exercise asks you to find; `python classroom/hint.py "
               "NAME` gives the steps.)")
TEACHER_PAGE = "docs/classroom.md"

# "file::function" -> (test file, the tests in it that the student sees; "other_file::test" for a test
# of another file), before the stars are added.
# A test also runs whatever the function calls, so the order below is the order to solve them in.
VISIBLE_TESTS = {
    "common.py::kl_k1": ("tests/test_kl.py", [
        "test_k1_and_k3_are_unbiased_for_reverse_kl", "test_k3_is_nonnegative_per_sample_and_k1_is_not",
        "test_k1_loss_gradient_is_zero", "test_k1_reward_penalty_gradient_is_reverse_kl",
        "test_estimators_hand_computed_values"]),
    "common.py::kl_k2": ("tests/test_kl.py", [
        "test_k2_is_biased_at_third_order", "test_k2_loss_gradient_is_reverse_kl",
        "test_k2_and_k3_reward_penalties_give_wrong_gradients", "test_estimators_hand_computed_values"]),
    "common.py::kl_k3": ("tests/test_kl.py", [
        "test_k1_and_k3_are_unbiased_for_reverse_kl", "test_k3_is_nonnegative_per_sample_and_k1_is_not",
        "test_k3_loss_gradient_is_forward_kl", "test_k2_and_k3_reward_penalties_give_wrong_gradients",
        "test_estimators_hand_computed_values"]),
    "common.py::kl_penalty": ("tests/test_kl.py", ["test_kl_penalty_is_the_estimator_it_names_and_k3_by_default"]),
    "common.py::masked_sum": ("tests/test_common.py", [
        "test_masked_sum_and_mean_ignore_masked_values_even_nan"]),
    "common.py::masked_mean": ("tests/test_common.py", [
        "test_masked_sum_and_mean_ignore_masked_values_even_nan", "test_masked_mean_of_empty_row_is_zero"]),
    "common.py::masked_whiten": ("tests/test_common.py", [
        "test_masked_whiten_has_zero_mean_unit_std_on_mask_and_zero_off_it"]),
    "common.py::completion_mask": ("tests/test_common.py", [
        "test_completion_mask_keeps_first_eos_and_drops_the_rest"]),
    "common.py::aggregate_loss": ("tests/test_common.py", [
        "test_aggregate_loss_modes_hand_computed", "test_aggregate_loss_rejects_unknown_mode"]),
    "common.py::reward_to_go": ("tests/test_common.py", ["test_reward_to_go_sums_future_masked_values"]),
    "common.py::clipped_surrogate": ("tests/test_common.py", [
        "test_clipped_surrogate_is_the_pessimistic_bound_with_its_gradient_zero_exactly_where_the_clip_binds",
        "tests/test_grpo.py::test_clip_gradient_is_zero_exactly_on_the_clipped_side",
        "tests/test_grpo.py::test_clip_loss_is_the_pessimistic_bound_of_the_unclipped_surrogate",
        "tests/test_dapo.py::test_clip_higher_bounds", "tests/test_dapo.py::test_clip_higher_is_asymmetric",
        "tests/test_ppo.py::test_policy_loss_gradient_is_zero_exactly_where_clipped"]),
    "common.py::clip_stats": ("tests/test_common.py", [
        "test_clip_stats_count_the_clipped_valid_tokens_of_the_side_a_favours",
        "tests/test_grpo.py::test_clip_gradient_is_zero_exactly_on_the_clipped_side",
        "tests/test_dapo.py::test_clip_higher_bounds",
        "tests/test_ppo.py::test_policy_loss_masks_padding_and_reports_the_ratio_kl"]),
    "lab/corrections.py::truncated_is_weight": ("tests/test_stability.py", [
        "test_truncated_is_weight_is_the_capped_detached_ratio"]),
    "lab/corrections.py::geometric_sequence_mask": ("tests/test_stability.py", [
        "test_geometric_sequence_mask_uses_the_mean_log_ratio_over_valid_tokens_and_spares_a_positive_advantage",
        "test_geometric_mask_in_rollout_correction_plays_pi_old_with_the_samplers_log_probs"]),
    "lab/losses.py::ratio_weighted_kl": ("tests/test_kl.py", [
        "test_ratio_weighted_kl_with_the_ratio_in_the_graph_gives_the_reverse_kl_gradient_off_policy",
        "test_ratio_weighted_k3_on_a_sequence_is_the_per_state_reverse_kl_over_the_samplers_states",
        "test_kl_is_weight_on_policy_gives_k3_the_gradient_of_k2"]),
    "remax.py::remax_advantages": ("tests/test_remax.py", [
        "test_remax_advantage_subtracts_the_greedy_reward",
        "test_remax_advantage_is_invariant_to_a_per_prompt_reward_offset"]),
    "remax.py::remax_loss": ("tests/test_remax.py", [
        "test_remax_loss_returns_fold_kl_reward_to_go",
        "test_remax_loss_gradient_is_reinforce_with_baseline",
        "test_remax_loss_does_not_backpropagate_through_the_return",
        "test_remax_loss_seq_mean_token_sum_norm_divides_by_max_len_not_the_batch_width"]),
    "rloo.py::rloo_advantages": ("tests/test_rloo.py", [
        "test_rloo_advantage_is_reward_minus_mean_of_the_others",
        "test_rloo_hand_computed_values_for_groups_of_three_and_five",
        "test_rloo_advantages_of_a_group_sum_to_zero_and_a_samples_baseline_ignores_its_own_reward",
        "test_rloo_with_two_samples_is_the_reward_difference", "test_all_equal_group_gives_zero_advantage",
        "test_rloo_advantage_is_invariant_to_a_per_prompt_reward_offset"]),
    "rloo.py::rloo_loss": ("tests/test_rloo.py", [
        "test_rloo_loss_treats_the_whole_sequence_as_one_action",
        "test_rloo_loss_does_not_backpropagate_into_the_advantage"]),
    "grpo.py::grpo_advantages": ("tests/test_grpo.py", [
        "test_group_advantage_uses_bessel_std_and_eps", "test_group_advantage_eps_keeps_a_tiny_std_finite",
        "test_all_equal_group_gives_exactly_zero_advantage", "test_scale_rewards_group_batch_none",
        "test_group_std_removes_each_prompts_reward_scale"]),
    "grpo.py::grpo_loss": ("tests/test_grpo.py", [
        "test_clip_gradient_is_zero_exactly_on_the_clipped_side",
        "test_clip_loss_is_the_pessimistic_bound_of_the_unclipped_surrogate",
        "test_with_one_iteration_ratio_is_one_and_gradient_is_the_policy_gradient",
        "test_k3_term_value_and_gradient", "test_loss_ignores_tokens_after_the_mask",
        "test_kl_estimator_k2_and_k3_with_the_ratio_weight_give_the_k2_gradient",
        "tests/test_gspo.py::test_sequence_ratio_is_the_geometric_mean_of_the_valid_token_ratios",
        "tests/test_gspo.py::test_sequence_clip_zeroes_the_whole_sequences_gradient_exactly_where_it_binds",
        "tests/test_gspo.py::test_clip_fractions_count_the_tokens_of_the_clipped_sequences",
        "tests/test_gspo.py::test_with_one_update_the_gradient_is_grpos_with_seq_mean_token_mean",
        "tests/test_gspo.py::test_a_long_sequence_counts_once_not_once_per_token",
        "tests/test_gspo.py::test_the_kl_term_stays_per_token"]),
    # dapo.py's verbatim copy of GRPO's advantage (a file imports no other algorithm file): graded again
    "dapo.py::grpo_advantages": ("tests/test_dapo.py", ["test_advantage_is_grpos_group_advantage"]),
    "dapo.py::dynamic_sampling_filter": ("tests/test_dapo.py", [
        "test_dynamic_sampling_keeps_only_groups_with_mixed_correctness",
        "test_dynamic_sampling_drops_uniform_groups_of_any_size"]),
    "dapo.py::overlong_penalty": ("tests/test_dapo.py", [
        "test_overlong_penalty_check_values_from_the_paper",
        "test_overlong_penalty_default_spares_every_right_answer",
        "test_overlong_penalty_with_no_cache_only_punishes_past_max_len"]),
    "dapo.py::dapo_loss": ("tests/test_dapo.py", [
        "test_clip_higher_bounds", "test_clip_higher_is_asymmetric",
        "test_dapo_loss_is_a_token_mean_over_the_batch"]),
    "ppo.py::gae": ("tests/test_ppo.py", [
        "test_gae_hand_computed_values", "test_gae_satisfies_its_recursion_on_every_valid_token",
        "test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value",
        "test_gae_with_lambda_zero_is_the_one_step_td_error",
        "test_gae_padding_does_not_change_valid_advantages_and_gets_zero",
        "test_gae_last_valid_token_bootstraps_from_zero", "test_gae_takes_one_lambda_per_sequence"]),
    "vapo.py::decoupled_gae": ("tests/test_ppo.py", [
        "test_decoupled_gae_takes_advantages_with_the_policy_lambda_and_targets_with_the_critics"]),
    "reinforce_pp.py::reinforce_pp_advantages": ("tests/test_reinforce_pp.py", [
        "test_return_is_the_reward_to_go_with_k1_in_each_tokens_reward_whitened_over_the_batch",
        "test_baseline_variant_subtracts_the_group_mean_of_the_sequence_return_then_whitens_its_tokens",
        "test_the_batch_not_the_group_sets_the_scale_so_a_solved_prompt_keeps_a_positive_advantage"]),
    "kimi.py::length_reward": ("tests/test_kimi.py", [
        "test_length_reward_is_lambda_for_a_right_answer_and_min_zero_lambda_for_a_wrong_one_within_each_group",
        "test_length_reward_ranges_from_half_for_the_shortest_to_minus_half_for_the_longest_right_answer"]),
    "kimi.py::priority_weights": ("tests/test_kimi.py", [
        "test_priority_weights_are_proportional_to_one_minus_the_success_rate"]),
    "vapo.py::length_adaptive_lam": ("tests/test_ppo.py", [
        "test_length_adaptive_lambda_is_one_minus_one_over_alpha_length_clamped_at_zero"]),
    "ppo.py::ppo_policy_loss": ("tests/test_ppo.py", [
        "test_policy_loss_on_policy_gradient_is_the_policy_gradient",
        "test_policy_loss_gradient_is_zero_exactly_where_clipped",
        "test_policy_loss_is_the_pessimistic_bound_of_the_unclipped_surrogate",
        "test_policy_loss_masks_padding_and_reports_the_ratio_kl"]),
    "ppo.py::ppo_value_loss": ("tests/test_ppo.py", [
        "test_value_loss_inside_the_clip_is_half_squared_error",
        "test_value_clip_stops_a_move_past_the_clip_towards_the_return",
        "test_value_clip_never_stops_a_move_back_towards_the_return",
        "test_value_loss_is_a_token_mean_over_the_mask"]),
    "vapo.py::positive_example_nll": ("tests/test_vapo.py", [
        "test_positive_example_nll_is_the_token_mean_of_minus_logp_over_the_correct_samples_only"]),
    "objectives.py::cispo_loss": ("tests/test_objectives.py", [
        "test_cispo_weight_is_the_capped_ratio_and_no_token_is_silenced",
        "test_cispo_value_is_the_weighted_log_prob_and_padding_is_ignored", "test_cispo_closed_form_gradient",
        "test_cispo_on_policy_is_the_plain_policy_gradient",
        "test_each_objective_keeps_a_junk_padding_weight_out_of_the_gradient",
        "test_micro_batch_aggregation_weight_is_kept"]),
    "objectives.py::sapo_loss": ("tests/test_objectives.py", [
        "test_sapo_hand_values_pick_tau_by_the_sign_of_the_advantage", "test_sapo_closed_form_gradient_and_gate_weight",
        "test_sapo_on_policy_is_the_plain_policy_gradient",
        "test_each_objective_keeps_a_junk_padding_weight_out_of_the_gradient",
        "test_micro_batch_aggregation_weight_is_kept"]),
    "objectives.py::gmpo_loss": ("tests/test_objectives.py", [
        "test_gmpo_hand_case_clips_each_token_before_the_geometric_mean",
        "test_gmpo_counts_each_sequence_once_and_ignores_the_padding", "test_gmpo_closed_form_gradient",
        "test_gmpo_on_policy_is_grpos_gradient_with_seq_mean_token_mean",
        "test_each_objective_keeps_a_junk_padding_weight_out_of_the_gradient",
        "test_micro_batch_aggregation_weight_is_kept"]),
    "opd.py::rloo_advantages": ("tests/test_opd.py", ["test_task_advantage_is_rloos_leave_one_out"]),
    "opd.py::opd_advantages": ("tests/test_opd.py", [
        "test_advantage_hand_values_student_first",
        "test_sampled_advantage_is_unbiased_for_the_per_state_kl_and_its_expected_gradient_is_the_full_vocab_gradient",
        "test_discount_zero_gradient_is_the_per_state_kl_with_the_states_held_fixed_not_the_sequence_kl"]),
    "opd.py::opd_loss": ("tests/test_opd.py", [
        "test_loss_hand_value_and_a_nan_advantage_in_the_padding_never_reaches_the_gradient",
        "test_discount_zero_gradient_is_the_per_state_kl_with_the_states_held_fixed_not_the_sequence_kl"]),
    "opd.py::full_reverse_kl": ("tests/test_opd.py", [
        "test_full_reverse_kl_hand_value_and_direction",
        "test_sampled_advantage_is_unbiased_for_the_per_state_kl_and_its_expected_gradient_is_the_full_vocab_gradient",
        "test_discount_zero_gradient_is_the_per_state_kl_with_the_states_held_fixed_not_the_sequence_kl"]),
    "agents.py::episode_masks": ("tests/test_agents.py", [
        "test_episode_masks_lay_out_segments_one_after_the_other"]),
    "toy_bandit.py::gradient_variance": ("tests/test_toy_bandit.py", [
        "test_two_arm_check_values", "test_mean_baseline_is_4x_none_for_symmetric_rewards",
        "test_dayan_mean_baseline_is_worse_than_none_exactly_for_p_above_two_thirds",
        "test_greedy_beats_none_for_rewards_2_1_and_loses_for_rewards_1_0_once_p_above_half",
        "test_two_arm_variance_is_a_parabola_in_b_around_b_star", "test_optimal_baseline_is_argmin_of_variance",
        "test_closed_form_matches_monte_carlo"]),
    "toy_bandit.py::optimal_baseline": ("tests/test_toy_bandit.py", [
        "test_optimal_baseline_is_argmin_of_variance", "test_optimal_baseline_with_zero_mean_reward",
        "test_optimal_baseline_is_shift_and_scale_equivariant"]),
    "toy_bandit.py::two_arm_baselines": ("tests/test_toy_bandit.py", [
        "test_two_arm_check_values", "test_mean_baseline_is_4x_none_for_symmetric_rewards",
        "test_dayan_mean_baseline_is_worse_than_none_exactly_for_p_above_two_thirds",
        "test_greedy_beats_none_for_rewards_2_1_and_loses_for_rewards_1_0_once_p_above_half",
        "test_greedy_tie_break_goes_to_lowest_index", "test_two_arm_baselines_of_an_array_of_p_are_arrays_like_p"]),
    "toy_bandit.py::softmax_gradient_variance": ("tests/test_toy_bandit.py", [
        "test_k_arm_check_values", "test_k_arm_variance_is_a_parabola_in_b_around_b_star",
        "test_k_arm_optimal_baseline_is_argmin_of_variance", "test_closed_form_matches_monte_carlo"]),
    "toy_bandit.py::softmax_optimal_baseline": ("tests/test_toy_bandit.py", [
        "test_k_arm_optimal_baseline_is_argmin_of_variance", "test_optimal_baseline_with_zero_mean_reward",
        "test_optimal_baseline_is_shift_and_scale_equivariant"]),
    "toy_bandit.py::softmax_baselines": ("tests/test_toy_bandit.py", [
        "test_k_arm_check_values", "test_greedy_tie_break_goes_to_lowest_index"]),
}
# "file::function" -> (stars 1-3 from classroom/hint.py, test file, tests)
EXERCISES = {key: (HINTS[key.split("::")[1]].stars, *tests) for key, tests in VISIBLE_TESTS.items()}


def exercise_name(key):
    """The function's name; module.function for a later exercise of the same name (dapo.grpo_advantages)."""
    file, name = key.split("::")
    first = next(k for k in EXERCISES if k.split("::")[1] == name)
    return name if first == key else f"{Path(file).stem}.{name}"


def module_name(file):
    """The module an exercise's file is imported as: grpo for grpo.py, lab.corrections for lab/corrections.py."""
    return file.removesuffix(".py").replace("/", ".")


def teacher_only(rel):
    return any(rel == t or (t.endswith("/") and rel.startswith(t)) for t in TEACHER_ONLY)


def project_files(src):
    """Relative paths of the project's files: `git ls-files` in a checkout, else a tree walk."""
    git = shutil.which("git")
    top = git and subprocess.run([git, "rev-parse", "--show-toplevel"], cwd=src, capture_output=True, text=True)
    if top and top.returncode == 0 and Path(top.stdout.strip()).resolve() == src:
        listed = subprocess.run([git, "ls-files", "-z"], cwd=src, capture_output=True, text=True, check=True).stdout
        return sorted(p for p in listed.split("\0") if p and (src / p).is_file())
    return sorted(str(p.relative_to(src)) for p in src.rglob("*")
                  if p.is_file() and not SKIP_DIRS & set(p.relative_to(src).parts[:-1]) and p.suffix != ".pyc")


def regions(text):
    """(first line, last line, indent, function, hint) of each marked region; lines 0-based."""
    lines, found, start = text.splitlines(), [], None
    for i, line in enumerate(lines):
        if line.strip() == BEGIN:
            if start is not None:
                raise ValueError(f"line {i + 1}: {BEGIN} inside another region (line {start + 1})")
            start = i
        elif line.strip() == END:
            if start is None:
                raise ValueError(f"line {i + 1}: {END} without {BEGIN}")
            found.append((start, i))
            start = None
    if start is not None:
        raise ValueError(f"line {start + 1}: {BEGIN} without {END}")
    functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    result = []
    for start, end in found:
        # the innermost function around the region names it and gives its docstring
        around = [f for f in functions if f.lineno <= start + 1 <= f.end_lineno]
        func = max(around, key=lambda f: f.lineno) if around else None
        hints = [l.strip()[len(HINT):].strip() for l in lines[start + 1:end] if l.strip().startswith(HINT)]
        doc = " ".join((ast.get_docstring(func) or "").strip().split("\n\n")[0].split()) if func else ""
        hint = " ".join(hints) if hints else doc or f"implement {func.name if func else 'this function'}"
        indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
        result.append((start, end, indent, func.name if func else "?", hint))
    return result


def hint_lines(function, indent):
    """The first-level hint of classroom/hint.py as `# HINT:` lines."""
    if function not in HINTS:
        return []
    return [f"{indent}{HINT} {line}\n" for line in HINTS[function].first_level(function)]


def blank(text, name="<file>"):
    """The student version of a source file: each marked region replaced by its hints and a raise."""
    lines = text.splitlines(keepends=True)
    for start, end, indent, function, _ in reversed(regions(text)):
        hints = hint_lines(function, indent)
        message = f"implement {function} (the {HINT} lines above)" if hints else f"implement {function}"
        lines[start:end + 1] = hints + [f"{indent}raise NotImplementedError({json.dumps(message)})\n"]
    student = "".join(lines)
    compile(student, name, "exec")  # a region that was not a whole block would show up here
    return student


def marked_functions(src=ROOT):
    """{"file::function": hint} for every marked region under src."""
    found = {}
    for rel in project_files(src):
        if rel.endswith(".py"):
            text = (src / rel).read_bytes().decode("utf-8")
            found.update({f"{rel}::{r[3]}": r[4] for r in regions(text)})
    return found


def node_id(test_file, name):
    """The pytest node id of a test named in EXERCISES (`name`, or `other_file::name`)."""
    return name if "::" in name else f"{test_file}::{name}"


def grading_tests():
    """pytest node ids of the visible tests of the exercises, each once, in table order."""
    return list(dict.fromkeys(node_id(file, name) for _, file, names in EXERCISES.values() for name in names))


def table():
    rows = ["| Exercise | File | Difficulty | Tests you can run |", "|---|---|---|---|"]
    for key, (difficulty, test_file, names) in EXERCISES.items():
        file = key.split("::")[0]
        tests = f"`{Path(test_file).name}`: " + ", ".join(
            f"`{Path(name.split('::')[0]).name}::{name.split('::')[1]}`" if "::" in name else f"`{name}`"
            for name in names)
        rows.append(f"| `{exercise_name(key)}` | `{file}` | {'★' * difficulty}{'☆' * (3 - difficulty)} | {tests} |")
    return "\n".join(rows)


def without_answers(text):
    """The page with each region between ANSWER_BEGIN and ANSWER_END replaced by ANSWER_NOTE."""
    while ANSWER_BEGIN in text:
        start, end = text.index(ANSWER_BEGIN), text.index(ANSWER_END) + len(ANSWER_END)
        text = text[:start] + ANSWER_NOTE + text[end:]
    return text


def write_copy(src, out):
    if out == src or src in out.parents:
        sys.exit(f"error: {out} is inside the reference project {src}; write the student copy "
                 "outside it, e.g. `python classroom/make_student_copy.py ../student`.")
    missing = sorted(set(marked_functions(src)) - set(EXERCISES))
    if missing:
        print(f"warning: marked but not in EXERCISES (no tests listed): {', '.join(missing)}", file=sys.stderr)
    for rel in project_files(src):
        if teacher_only(rel):
            continue
        source, target = src / rel, out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        text = source.read_bytes().decode("utf-8") if rel.endswith(".py") or rel in (TEACHER_PAGE, ANSWER_PAGE) else ""
        if rel == ANSWER_PAGE:
            target.write_bytes(without_answers(text).encode("utf-8"))
        elif rel == TEACHER_PAGE and TEACHER_PART in text:
            target.write_bytes(text[:text.index(TEACHER_PART)].rstrip("\n").encode("utf-8") + b"\n")
        elif rel.endswith(".py") and BEGIN in text:
            target.write_bytes(blank(text, rel).encode("utf-8"))
            shutil.copymode(source, target)
        else:
            shutil.copy(source, target)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="Where to write the student copy (outside this project).")
    parser.add_argument("--list", action="store_true", help="Print the exercise table (markdown) and exit.")
    parser.add_argument("--tests", action="store_true", help="Print the node ids of the visible tests and exit.")
    args = parser.parse_args()
    if args.list or args.tests:
        print(table() if args.list else "\n".join(grading_tests()))
        return
    if not args.out_dir:
        parser.error("give OUT_DIR (or --list / --tests)")
    out = Path(args.out_dir).resolve()
    write_copy(ROOT, out)
    print(table())
    print(f"\nWrote the student copy to {out}. A student checks the work with:\n"
          f"  cd {out} && python -m pytest -v --tb=line $(python classroom/make_student_copy.py --tests)\n"
          f"and the teacher grades it, from this repository, with:\n  python classroom/grade.py {out}")


if __name__ == "__main__":
    main()
