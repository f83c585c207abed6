"""Which pytest markers a test gets, decided from its code (no marker is written in a test file).

- ``dist``: the test (its body, the fixtures it uses, or any helper function or class from the tests
  folder that these call, followed transitively) starts processes: ``dist_harness.run_distributed``,
  ``subprocess``, ``multiprocessing`` / ``torch.multiprocessing``, ``os.fork``.
- ``slurm``: tests/test_slurm.py or anything using tests/slurm_cluster.py (a real Slurm cluster).
- ``gpu``: a ``skipif`` whose reason says it needs CUDA.
- ``slow``: at least 15 s measured on the 2-core CI machine (``--durations``), listed in SLOW by
  ``file::function`` (every parametrisation).

``make test-fast`` deselects all four; ``make test`` runs everything.
"""

from __future__ import annotations

import inspect
import os
import types

TESTS = os.path.dirname(os.path.abspath(__file__))

SPAWNING_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing", "slurm_cluster"}
SPAWNING_FUNCTIONS = {("dist_harness", "run_distributed"), ("os", "fork"), ("os", "system"), ("os", "execv")}

# >= 15 s each in a full run on 2 cores (seconds of the slowest parametrisation)
SLOW = {
    "test_checkpoint.py::test_resume_is_bitwise_identical",  # 73
    "test_checkpoint.py::test_resharding_dp2_to_dp3_and_dp1_and_tp2_to_tp1",  # 61
    "test_sharding.py::test_tp2_dp2_and_accumulation_with_uneven_owner_ranges",  # 45
    "test_slurm.py::test_sbatch_preempted_by_signal_requeues_and_resumes_on_two_nodes",  # 45
    "test_codec_blocks.py::test_tp_replicated_parameters_stay_bitwise_identical_in_every_preset",  # 37
    "test_geo.py::test_tp2_geo_is_block_diagonal_of_the_full_factor",  # 36
    "test_codec_compile.py::test_reducer_with_comm_compile_reduces_bitwise_like_eager",  # 35
    "test_sharding.py::test_dry_run_of_llama_600m_at_dp64",  # 34
    # measured with the machine loaded (load average 11)
    "test_muon_split.py::test_dry_run_of_llama_600m_at_dp128_steps_the_split_plan",  # 79
    "test_muon_split.py::test_split_plan_resumes_bitwise_and_across_split_and_whole_plans",  # 258
    "test_muon_split.py::test_split_plan_steps_like_the_whole_matrix_plan",  # 83
    "test_run_comparison.py::test_rerun_into_a_sweep_refuses_other_arguments_unless_forced",  # 29
    "test_preset_fidelity.py::test_relative_errors_match_torch_casts_on_the_tiny_model",  # 25 (machine loaded)
    "test_smollm2_import.py::test_whole_model_at_tp1_gives_transformers_per_token_losses",  # 40 (fixture)
    "test_smollm2_import.py::test_export_of_a_run_on_the_hf_tokenizer_carries_that_tokenizer",  # 20
    "test_smollm2_import.py::test_first_layers_at_tp3_give_transformers_per_token_losses",  # 25
    "test_hf_interop.py::test_export_loads_in_transformers_with_our_losses_and_token_ids",  # 27 (fixture)
    "test_gpu_check.py::test_dry_run_writes_two_files_with_every_phase",  # 25 (fixture)
    "test_training_equivalence.py::test_dp2_matches_single_process",  # 25
    "test_checkpoint_verify.py::test_a_save_missing_or_short_where_rank_0_reads_it_is_refused_before_publication",
    "test_geo.py::test_owner_decomposes_and_broadcasts_the_transform_of_the_dp_summed_factor",  # 22
    "test_checkpoint.py::test_resuming_from_an_earlier_step_moves_the_abandoned_timeline_aside",  # 22
    "test_compile_hooks.py::test_compiled_blocks_with_overlapped_param_gather",  # 21
    "test_launch_scripts.py::test_wrapper_validates_the_config_before_submitting",  # 19
    "test_sharding.py::test_dp3_with_uneven_owner_ranges_matches_single_process",  # 19
    "test_checkpoint.py::test_killed_rank_makes_the_other_exit",  # 19
    "test_sync_free.py::test_reduction_forces_no_host_sync_and_its_op_count_does_not_grow_with_dp",  # 17
    "test_geo.py::test_power_auto_and_select_gain_follow_the_slope_rule_on_every_rank",  # 17
    "test_overlap.py::test_overlapped_param_gather_equals_blocking_gather",  # 17
    "test_step_syncs.py::test_no_collective_between_publish_and_the_first_forward_wait",  # 17
    "test_config.py::test_missing_files_and_devices_are_one_error_line_before_any_process_group",  # 16
    "test_uneven_tokens.py::test_uneven_valid_tokens_match_single_process",  # 16
    "test_geo.py::test_sketch_statistics_train_and_stay_rank_consistent",  # 16
    "test_fake_cuda_checkpoint.py::test_a_rank_failing_inside_the_save_fails_every_rank_and_keeps_the_previous_checkpoint",
    "test_eval_downstream.py::test_eval_tool_end_to_end",  # 16
    "test_geo.py::test_power_search_picks_the_dp_summed_best_power_on_every_rank",  # 15
    "test_training_equivalence.py::test_accumulation_equivalence",  # 15
    "test_checkpoint.py::test_mismatched_checkpoint_is_a_clear_error",  # 15
    "test_lowp_reducer.py::test_nonfinite_on_one_rank_is_seen_by_all",  # 15
    "test_lowp_reducer.py::test_dp2_training_keeps_replicas_identical",  # 15
    "test_launch_scripts.py::test_launch_local_trains_two_cpu_processes",  # 15
    "test_project_scaling.py::test_cli_prints_every_assumption_and_a_table_per_dp_size",  # 19
    "test_project_scaling.py::test_a_faster_fabric_never_projects_a_longer_step",  # 18 (plan layout, DP 256)
    # measured in a test-fast run with the machine loaded (load average 7)
    "test_codec_compile.py::test_fp8_wire_functions_compile_to_one_graph_each_and_match_eager_bitwise",  # 41
    "test_codec_compile.py::test_nvfp4_wire_functions_compile_to_one_graph_each_and_match_eager_bitwise",  # 25
    # compiles one 64-source graph per decoder: 11-16 s each on 2 cores (a cold Inductor cache)
    "test_codec_compile.py::test_dp64_mean_is_bitwise_one_value_eager_compiled_and_by_the_fp64_reference",
    "test_gpu_check.py::test_codec_phase_compiled_on_the_cpu_reports_every_preset_and_the_dp_check",  # 66
    "test_benchmarks.py::test_run_gloo_reports_a_dead_worker_instead_of_hanging",  # 26 (benchmarks/ spawns the ranks)
    # over 5 s in the fast tier's --durations (machine loaded): kept out of the first minutes of CI
    "test_megatron_core_split.py::test_training_records_the_rule_and_continues_a_changed_blend",  # 8
    "test_data.py::test_default_corpus_split_and_cache",  # 5
}


def _in_tests(obj) -> bool:
    try:
        path = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return False
    return bool(path) and os.path.dirname(os.path.abspath(path)) == TESTS


def _spawns(obj, seen: set) -> bool:
    """Whether ``obj`` (a function, method or class from the tests folder) can start a process."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, type):
        return any(_spawns(v, seen) for v in vars(obj).values() if isinstance(v, (types.FunctionType, property)))
    if isinstance(obj, property):
        return any(_spawns(f, seen) for f in (obj.fget, obj.fset) if f is not None)
    obj = inspect.unwrap(obj)
    if not isinstance(obj, types.FunctionType) or not _in_tests(obj):
        return False
    return _code_spawns(obj.__code__, obj.__globals__, seen)


def _code_spawns(code: types.CodeType, glob: dict, seen: set) -> bool:
    for name in code.co_names:
        value = glob.get(name)
        if isinstance(value, types.ModuleType):
            if value.__name__ in SPAWNING_MODULES:
                return True
            if value.__name__ == "os" and {"fork", "system", "execv"} & set(code.co_names):
                return True
        elif callable(value):
            key = (getattr(value, "__module__", None), getattr(value, "__name__", None))
            if key in SPAWNING_FUNCTIONS or _spawns(value, seen):
                return True
    return any(isinstance(c, types.CodeType) and _code_spawns(c, glob, seen) for c in code.co_consts)


def _fixture_functions(item):
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        for d in defs:
            yield d.func


def marks_for(item) -> list[str]:
    """The marker names for one collected test item."""
    fname = os.path.basename(str(item.path))
    func = getattr(item, "function", None)
    marks = []
    seen: set = set()
    if func is not None and (_spawns(func, seen) or any(_spawns(f, seen) for f in _fixture_functions(item))):
        marks.append("dist")
    if fname == "test_slurm.py" or "slurm_cluster" in getattr(item.module, "__dict__", {}):
        marks.append("slurm")
    for m in item.iter_markers("skipif"):
        if "cuda" in str(m.kwargs.get("reason", "")).lower():
            marks.append("gpu")
            break
    if func is not None and f"{fname}::{func.__name__}" in SLOW:
        marks.append("slow")
    return marks
