"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.testing.launcher)."""

import pytest

from scout_core.testing.launcher import prepare_parent

prepare_parent()


# The guards CI leaves to ``nox -s guards`` for its time limit: each took more than 10 s on the 2-core CI machine
# (seconds measured 2026-12-05; the 40 others take 290 s together). Shrinking one below 10 s moves it into CI.
HEAVY_GUARDS: dict[str, float] = {
    "test_rank0_killed_cell_fails_when_rank_0_serves_the_control_store": 45.0,
    "test_comm_straggler_cell_fails_when_the_wrong_machine_is_named": 44.2,
    "test_onset_spread_cell_fails_when_only_silent_observers_answer": 41.5,
    "test_moe_defaults_cell_fails_without_the_expert_recipe": 32.8,
    "test_titan_expert_cell_fails_without_the_expert_binding": 31.2,
    "test_recovery_defaults_cell_fails_with_the_last_check_rule[hsdp]": 30.3,
    "test_megatron_recovery_cell_fails_when_megatron_loads_its_newest_iteration": 26.7,
    "test_titan_snapshot_recovery_cell_fails_when_scout_does_not_restore_its_snapshot": 25.1,
    "test_straggler_sdc_cell_fails_when_a_straggler_restores_latest_unswept": 24.9,
    "test_titan_recovery_cell_fails_when_torchtitan_loads_its_newest_checkpoint": 23.3,
    "test_hf_recovery_cell_fails_without_the_restart_plan": 22.9,
    "test_comm_straggler_cell_fails_when_a_group_is_called_slow_a_round_early": 22.6,
    "test_hang_clean_cell_fails_on_a_spurious_verdict": 22.5,
    "test_titan_recovery_cell_fails_when_scout_restarts_its_count_from_zero": 22.5,
    "test_recovery_defaults_cell_fails_with_the_last_check_rule[fsdp2]": 21.1,
    "test_titan_moe_clean_cell_fails_when_expert_parallel_blocks_replay_whole": 19.6,
    "test_moe_sweep_cell_fails_when_the_sweep_skips_the_experts": 18.2,
    "test_sdc_defaults_cell_fails_without_the_rotation[hsdp]": 16.3,
    "test_clean_at_defaults_cell_fails_on_a_false_straggler": 15.7,
    "test_moe_clean_cell_fails_when_the_optimizer_slice_compares_experts": 14.8,
    "test_moe_a2a_cell_fails_without_the_intersection": 14.3,
    "test_sdc_defaults_cell_fails_without_the_rotation[fsdp2]": 13.6,
    "test_machine_lost_cell_fails_when_lost_ranks_are_not_grouped_by_machine": 13.3,
    "test_megatron_ep_clean_cell_fails_when_router_replays_reach_megatrons_logged_losses": 12.8,
    "test_moe_attention_straggler_cell_fails_when_other_kinds_of_work_reset_the_streak": 12.6,
    "test_slow_not_stalled_cell_fails_without_the_adaptive_threshold": 12.2,
    "test_scratch_oom_cell_fails_when_the_allocation_is_not_guarded": 12.0,
    "test_recovery_cell_fails_when_the_restore_is_not_bitwise": 11.4,
    "test_hsdp_straggler_cell_fails_without_the_job_wide_comparison": 11.1,
    "test_titan_snapshots_cell_fails_when_the_plugin_drops_scout_snapshots": 11.1,
    "test_surfaces_defaults_cell_fails_without_the_rotation": 10.9,
    "test_data_stall_cell_fails_without_the_named_ranks_stacks": 10.5,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of test_cells.py but ``test_cell_passes`` is a guard (a cell re-run with one mechanism removed,
    which must turn red): marked ``guards``; those in HEAVY_GUARDS also ``heavy`` (CI runs the others)."""
    for item in items:
        if item.path.name == "test_cells.py" and getattr(item, "originalname", "") != "test_cell_passes":
            item.add_marker(pytest.mark.guards)
            if item.name in HEAVY_GUARDS:
                item.add_marker(pytest.mark.heavy)


@pytest.fixture
def forked_observers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observers forked from their trainers (``observer.start_method: fork``) for a test that patches the
    observer's own code: a fresh interpreter would not see the patch."""
    from scout_core.progress import spawn
    from scout_core.progress.observer import fork_for

    monkeypatch.setattr(spawn, "spawn_observer", lambda spec, callback: fork_for(spec))
