"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.testing.launcher)."""

import pytest

from scout_core.testing.launcher import prepare_parent

prepare_parent()


# The guards CI leaves to ``nox -s guards`` for its time limit: with them CI would pass 50 minutes on the 2-core CI
# machine (seconds measured 2026-12-06 on 0aada07, after the launcher fix: these 606 s together; the others run in CI).
# Shrinking one moves it into CI; every one over 10 s stays listed only while CI has no room for it.
HEAVY_GUARDS: dict[str, float] = {
    "test_rank0_killed_cell_fails_when_rank_0_serves_the_control_store": 45.0,
    "test_onset_spread_cell_fails_when_only_silent_observers_answer": 41.3,
    "test_comm_straggler_cell_fails_when_the_wrong_machine_is_named": 22.5,  # 2026-12-06, delay 0.1 s
    "test_moe_defaults_cell_fails_without_the_expert_recipe": 31.7,
    "test_recovery_defaults_cell_fails_with_the_last_check_rule[hsdp]": 27.3,
    "test_titan_expert_cell_fails_without_the_expert_binding": 25.6,
    "test_megatron_recovery_cell_fails_when_megatron_loads_its_newest_iteration": 24.7,
    "test_titan_snapshot_recovery_cell_fails_when_scout_does_not_restore_its_snapshot": 23.9,
    "test_straggler_sdc_cell_fails_when_a_straggler_restores_latest_unswept": 23.5,
    "test_titan_recovery_cell_fails_when_torchtitan_loads_its_newest_checkpoint": 21.8,
    "test_hf_recovery_cell_fails_without_the_restart_plan": 21.0,
    "test_titan_recovery_cell_fails_when_scout_restarts_its_count_from_zero": 20.8,
    "test_recovery_defaults_cell_fails_with_the_last_check_rule[fsdp2]": 20.2,
    "test_hang_clean_cell_fails_on_a_spurious_verdict": 19.9,
    "test_sdc_defaults_cell_fails_without_the_rotation[hsdp]": 17.5,
    "test_titan_moe_clean_cell_fails_when_expert_parallel_blocks_replay_whole": 16.4,
    "test_comm_straggler_cell_fails_when_a_group_is_called_slow_a_round_early": 10.8,  # 2026-12-06, delay 0.1 s
    "test_comm_straggler_cell_fails_when_timing_stays_sparse_through_a_slow_streak": 10.3,  # 2026-12-06, delay 0.1 s
    "test_comm_straggler_cell_fails_when_every_check_times_the_all_reduce": 11.5,  # 2026-12-06, delay 0.1 s
    "test_machine_lost_cell_fails_when_lost_ranks_are_not_grouped_by_machine": 13.2,
    "test_sdc_defaults_cell_fails_without_the_rotation[fsdp2]": 13.1,
    "test_moe_sweep_cell_fails_when_the_sweep_skips_the_experts": 13.0,
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
