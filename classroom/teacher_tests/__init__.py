"""Hidden tests: with the visible ones they grade the exercises (classroom/grade.py); they never ship in
the student copy. TEACHER_TESTS: "file::function" -> (test file, the hidden tests that grade it)."""
COMMON = "classroom/teacher_tests/test_hidden_common.py"
LOSSES = "classroom/teacher_tests/test_hidden_losses.py"
ADVANTAGES = "classroom/teacher_tests/test_hidden_advantages.py"
AGENTS = "classroom/teacher_tests/test_hidden_agents.py"
CORRECTIONS = "classroom/teacher_tests/test_hidden_corrections.py"

TEACHER_TESTS = {
    "common.py::masked_sum": (COMMON, [
        "test_masked_sum_of_a_padded_batch_ignores_the_padding_and_sums_each_row_alone"]),
    "common.py::masked_mean": (COMMON, ["test_masked_mean_of_a_padded_batch_weighs_every_valid_token_once"]),
    "common.py::masked_whiten": (COMMON, [
        "test_masked_whiten_of_a_padded_batch_ignores_the_padding_and_leaves_it_zero",
        "test_masked_whiten_of_a_constant_is_zero_not_nan"]),
    "common.py::completion_mask": (COMMON, [
        "test_completion_mask_of_random_ids_keeps_each_rows_prefix_through_its_first_eos"]),
    "common.py::aggregate_loss": (COMMON, [
        "test_aggregate_loss_of_a_padded_batch_ignores_the_padding_and_weighs_tokens_or_rows",
        "test_seq_mean_token_sum_norm_divides_by_the_batch_width_even_when_every_row_is_shorter"]),
    "common.py::reward_to_go": (COMMON, ["test_reward_to_go_of_a_padded_batch_runs_along_each_row_alone"]),
    "common.py::clip_stats": (LOSSES, [
        "test_grpo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token",
        "test_dapo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token",
        "test_ppo_policy_loss_statistics_ignore_the_padding_and_weigh_every_valid_token",
        "test_clip_statistics_count_only_where_the_clip_binds_hand_values"]),
    "lab/corrections.py::geometric_sequence_mask": (CORRECTIONS, [
        "test_geometric_mask_sees_drifts_of_both_signs_through_the_mean_over_valid_tokens",
        "test_geometric_mask_keeps_a_drift_of_exactly_delta"]),
    "lab/losses.py::ratio_weighted_kl": (LOSSES, [
        "test_ratio_weighted_k3_keeps_its_gradient_in_float32_far_from_the_reference"]),
    "remax.py::remax_loss": (LOSSES, [
        "test_remax_loss_and_return_mean_of_a_padded_batch_weigh_every_valid_token"]),
    "rloo.py::rloo_advantages": (ADVANTAGES, [
        "test_rloo_advantage_of_random_groups_leaves_each_sample_out_of_its_own_baseline"]),
    "rloo.py::rloo_loss": (LOSSES, [
        "test_rloo_loss_of_a_padded_batch_is_the_mean_of_its_rows"]),
    "grpo.py::grpo_advantages": (ADVANTAGES, [
        "test_grpo_advantage_of_random_groups_treats_each_group_on_its_own",
        "test_grpo_advantage_of_an_all_equal_float32_group_is_exactly_zero"]),
    "dapo.py::grpo_advantages": (ADVANTAGES, [
        "test_grpo_advantage_of_random_groups_treats_each_group_on_its_own",
        "test_grpo_advantage_of_an_all_equal_float32_group_is_exactly_zero"]),
    "grpo.py::grpo_loss": (LOSSES, [
        "test_grpo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token",
        "test_grpo_loss_means_over_sequences_ignore_the_padding",
        "test_clip_statistics_count_only_where_the_clip_binds_hand_values"]),
    "dapo.py::dynamic_sampling_filter": (ADVANTAGES, [
        "test_dynamic_sampling_filter_keeps_exactly_the_mixed_groups_of_random_correctness"]),
    "dapo.py::overlong_penalty": (ADVANTAGES, [
        "test_overlong_penalty_of_every_length_is_zero_then_a_ramp_of_step_one_over_cache_then_minus_one"]),
    "dapo.py::dapo_loss": (LOSSES, ["test_dapo_loss_statistics_ignore_the_padding_and_weigh_every_valid_token",
        "test_clip_statistics_count_only_where_the_clip_binds_hand_values"]),
    "ppo.py::gae": (ADVANTAGES, ["test_gae_of_a_padded_batch_with_one_lambda_per_row_treats_each_row_alone",
                                "test_gae_of_an_episode_skips_the_environments_tokens"]),
    "vapo.py::decoupled_gae": (ADVANTAGES, ["test_decoupled_gae_is_two_gaes_on_a_random_padded_batch"]),
    "reinforce_pp.py::reinforce_pp_advantages": (ADVANTAGES, [
        "test_reinforce_pp_advantages_of_a_padded_batch_are_the_whitened_reward_to_go_of_every_valid_token"]),
    "kimi.py::length_reward": (ADVANTAGES, [
        "test_length_reward_of_random_groups_rewards_the_shortest_right_answer_and_never_a_wrong_one"]),
    "kimi.py::priority_weights": (ADVANTAGES, [
        "test_priority_weights_of_random_rates_are_probabilities_in_the_ratio_of_the_failures"]),
    "vapo.py::length_adaptive_lam": (ADVANTAGES, [
        "test_length_adaptive_lambda_of_random_lengths_gives_td_weights_alpha_times_length"]),
    "ppo.py::ppo_policy_loss": (LOSSES, [
        "test_ppo_policy_loss_statistics_ignore_the_padding_and_weigh_every_valid_token",
        "test_clip_statistics_count_only_where_the_clip_binds_hand_values"]),
    "ppo.py::ppo_value_loss": (LOSSES, ["test_ppo_value_loss_and_clip_fraction_ignore_the_padding"]),
    "vapo.py::positive_example_nll": (LOSSES, [
        "test_positive_example_nll_of_a_padded_batch_is_the_mean_of_the_correct_rows_tokens_in_any_split"]),
    "agents.py::episode_masks": (AGENTS, [
        "test_episode_masks_hand_computed_with_empty_segments_one_segment_and_the_environment_first",
        "test_episode_masks_of_random_segments_give_each_segment_its_kind_and_nothing_to_the_padding"]),
}
