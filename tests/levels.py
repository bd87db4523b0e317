"""Every test's level, in one table: conftest.py marks each collected test `unit`, `integration` or `e2e` from it.

- unit: in-process code, or the CLI parsing and rendering; no sshd, no job, no model loaded or trained. Seconds each;
  `python3 -m pytest -q -m unit` is the developer's fast run.
- integration: a real sshd, real jobs and processes, signals, tiny torch models extracted from or trained a few steps.
- e2e: whole pipelines on real engines and schedulers: everything marked `vllm`, `slurm` or `quality` is e2e.

A new test file gets a row here (tests/test_levels.py fails until it has one). A file that mixes levels names its
exceptions, by test function, in EXCEPTIONS.
"""

from __future__ import annotations

UNIT, INTEGRATION, E2E = "unit", "integration", "e2e"
LEVELS = (UNIT, INTEGRATION, E2E)

# The markers of the slow tiers that need big cached installs or services: their tests are end-to-end.
E2E_MARKERS = ("vllm", "slurm", "quality")

FILES = {
    "test_api.py": INTEGRATION,
    "test_bench_campaign.py": INTEGRATION,   # the GPU campaign's runner as real processes on a bare work folder
    "test_bench_gpu_scaling.py": INTEGRATION,   # the two-GPU scaling bench rehearsed on the CPU: real jobs, tiny models
    "test_choose.py": INTEGRATION,   # the plan, refusals and choice rules are unit; vLLM's test is e2e
    "test_cli_answers.py": INTEGRATION,
    "test_cli_printing.py": INTEGRATION,
    "test_cli_usage.py": UNIT,
    "test_concurrent_payloads.py": INTEGRATION,
    "test_compute_dtype.py": UNIT,
    "test_config_bounds.py": UNIT,
    "test_cpu_threads.py": UNIT,   # the rule in-process; a real process loading a target is integration
    "test_data_curation.py": UNIT,
    "test_data_manifest.py": INTEGRATION,
    "test_data_sources.py": UNIT,
    "test_deploy_patch.py": INTEGRATION,
    "test_engine_claims.py": UNIT,   # real processes, no model
    "test_engine_memory_gpu.py": INTEGRATION,
    "test_engine_memory_steps.py": INTEGRATION,
    "test_exit_codes.py": INTEGRATION,
    "test_extract_resume_key.py": INTEGRATION,
    "test_follow_fail_fast.py": INTEGRATION,
    "test_gpu_reset.py": INTEGRATION,
    "test_gpu_reset_cli.py": INTEGRATION,
    "test_gpu_reset_workdirs.py": INTEGRATION,
    "test_group_jobs.py": INTEGRATION,
    "test_group_truth.py": INTEGRATION,
    "test_hosts.py": INTEGRATION,
    "test_input_guards.py": UNIT,
    "test_inventory.py": UNIT,
    "test_jobs.py": INTEGRATION,
    "test_jobs_gpu_truth.py": INTEGRATION,
    "test_kimi_vllm.py": E2E,
    "test_known_acceptance.py": INTEGRATION,   # tiny targets through the eval step; vLLM's test is e2e
    "test_layout.py": UNIT,
    "test_levels.py": UNIT,
    "test_log_printer.py": UNIT,
    "test_lr_schedule.py": UNIT,
    "test_loopback_host.py": INTEGRATION,
    "test_machine_claims.py": INTEGRATION,
    "test_online.py": INTEGRATION,
    "test_online_stream.py": UNIT,
    "test_online_vllm.py": E2E,
    "test_packaging.py": INTEGRATION,
    "test_parity.py": INTEGRATION,
    "test_patch_engine.py": INTEGRATION,   # real speculators wheels installed with pip
    "test_pipeline_data.py": INTEGRATION,
    "test_preflight_cli.py": INTEGRATION,
    "test_preflight_kimi_size.py": INTEGRATION,   # the preflight step on Kimi-K2.5's config (minutes)
    "test_preflight_payload.py": INTEGRATION,
    "test_progress.py": INTEGRATION,
    "test_pull_clean.py": INTEGRATION,
    "test_quality.py": E2E,
    "test_recipes.py": UNIT,
    "test_regenerate_eval.py": INTEGRATION,
    "test_render_and_upload.py": INTEGRATION,
    "test_render_extras.py": UNIT,
    "test_report_plot.py": UNIT,
    "test_start_interrupt.py": INTEGRATION,
    "test_self_prompts.py": INTEGRATION,
    "test_settings.py": INTEGRATION,
    "test_slurm.py": E2E,
    "test_slurm_inventory.py": UNIT,
    "test_slurm_truth.py": E2E,
    "test_spec_trainer.py": INTEGRATION,
    "test_step_batches.py": INTEGRATION,
    "test_step_flags.py": UNIT,
    "test_storage_plan.py": INTEGRATION,   # preflight's storage check: host script and `kimi-eagle preflight`
    "test_target_config.py": UNIT,   # config files compared in-process; a step's import and transformers 4 run apart
    "test_template_safety.py": UNIT,
    "test_torchrun.py": INTEGRATION,
    "test_tracking.py": INTEGRATION,
    "test_train.py": INTEGRATION,
    "test_train_acc.py": INTEGRATION,
    "test_train_packing.py": INTEGRATION,
    "test_upload_concurrency.py": INTEGRATION,
    "test_versions.py": UNIT,
    "test_vllm_backends.py": E2E,
    "test_vllm_env_defaults.py": UNIT,
}

# Tests whose level is not their file's, by test function name.
EXCEPTIONS = {
    "test_cpu_threads.py": {
        "test_a_step_that_loads_a_target_on_the_cpu_sizes_its_threads_by_it": INTEGRATION,
    },
    "test_target_config.py": {name: INTEGRATION for name in (
        "test_reading_a_complete_config_imports_no_transformers",
        "test_the_draft_layer_reads_as_transformers_own_llamaconfig_wrote_it")},
    "test_input_guards.py": {
        "test_job_ids_are_input_and_never_reach_another_workdirs_job": INTEGRATION,   # jobs over the sshd
        "test_openssh_gets_the_address_after_the_end_of_options": INTEGRATION,       # runs the real ssh
    },
    "test_choose.py": {name: UNIT for name in (
        "test_a_checkpoint_that_cannot_be_swapped_in_gets_a_new_engine", "test_only_a_checkpoint_with_the_same_tensors_is_swapped_in",
        "test_run_all_chooses_after_train_and_evaluates_the_chosen_export", "test_bad_choose_settings_are_one_line_exit_2",
        "test_the_choice_is_the_best_served_and_none_accepted_is_a_failure",
        "test_acceptance_at_every_k_from_one_run_and_tokens_per_s_through_both_measurements")},
    "test_data_sources.py": {
        "test_sharegpt_from_the_installed_package_keeps_every_whole_conversation": INTEGRATION,   # all of ShareGPT
    },
    "test_patch_engine.py": {name: UNIT for name in (
        "test_version_comparer", "test_ops_scripts_run_with_only_the_stdlib")},
    "test_pipeline_data.py": {name: UNIT for name in (
        "test_parse_layer_ids", "test_text_config", "test_resolve_decoder_stack_order_and_error",
        "test_shard_ranges_cover_every_index_once", "test_speculators_layer_id_translation",
        "test_vocab_selection_round_trip_and_ties")},
    "test_recipes.py": {name: INTEGRATION for name in (
        "test_a_recipe_mistake_is_one_line_exit_2_and_nothing_reaches_the_host",
        "test_a_run_records_its_settings_and_versions_next_to_its_outputs",
        "test_the_serve_hint_uses_the_runs_k_also_when_followed_later")},
    "test_render_extras.py": {"test_a_finished_training_ends_with_where_what_and_next": INTEGRATION},
    "test_step_flags.py": {name: INTEGRATION for name in (   # the sshd, or the host steps run or imported
        "test_a_typo_is_one_line_exit_2_and_nothing_reaches_the_host", "test_every_step_parser_is_the_one_the_schema_builds",
        "test_a_step_run_by_hand_refuses_what_the_controller_refuses", "test_a_settings_file_value_is_checked_as_a_flag_is",
        "test_extract_and_preflight_call_the_engine_engine", "test_a_path_setting_that_starts_with_a_dash_is_a_path_on_the_host")},
    "test_lr_schedule.py": {"test_a_run_trains_each_step_at_the_scheduled_rate_also_after_a_resume": INTEGRATION},
}


# Tests this table calls unit that start the sshd (filled at collection by conftest.py; tests/test_levels.py fails
# while it is not empty).
MISFILED: list[str] = []


def level_of(file_name: str, test_name: str, markers: set[str]) -> str | None:
    """The level of test `test_name` (its function's name) of tests/`file_name`; None for a file not in FILES."""
    if markers & set(E2E_MARKERS):
        return E2E
    return EXCEPTIONS.get(file_name, {}).get(test_name) or FILES.get(file_name)
