"""The benchmark tables say what was measured: each budget beside its goal, met or missed, its A/A noise and the
commit it was measured on; the quick mode measures the three headline budgets only (nothing here times anything)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402


def _results() -> dict:
    layout = {"overhead_median": 0.004, "overhead_range": [0.001, 0.006], "aa_median": 0.0, "aa_range": [-0.01, 0.01]}
    return {
        "version": "0", "machine": {"device": "CPU", "cpu_threads": 1, "torch": "2"},
        "hang_real": {"repeats": 5, "world_size": 2, "goal_ratio": 0.005, "ddp_plain_step_ms": 30.0,
                      "fsdp2_plain_step_ms": 80.0, "ddp": layout, "fsdp2": {**layout, "overhead_median": 0.03}},
        "replay": {"world_size": 16, "layers": 6, "variants": 3, "curve": [
            {"interval": 20, "measured_ratio": 0.11, "min": 0.0, "max": 0.2, "model_ratio": 0.025, "aa_median": 0.0,
             "aa_range": [-0.1, 0.02]},
            {"interval": 5, "measured_ratio": 0.2, "min": 0.1, "max": 0.3, "model_ratio": 0.1, "aa_median": 0.0,
             "aa_range": [0.0, 0.0]}]},
        "snapshot_ab": {"cadence": 20, "steps": 720, "state_mb": 24.0, "durable_generations_min": 0, "repeats": 3,
                        "overhead_median": 0.009, "overhead_min": 0.0, "overhead_max": 0.02, "aa_median": 0.06,
                        "aa_range": [0.0, 0.07], "goal_overhead": 0.01, "shm_at_rest_over_state": 2.02,
                        "rss_peak_over_state": 2.5, "goal_at_rest_over_state": 2.0, "goal_peak_over_state": 3.0},
        "provenance": {"hang_real": {"commit": "abc1234", "dirty": False},
                       "snapshot_ab": {"commit": "def5678", "dirty": True}},
    }


def test_each_budget_stands_beside_its_goal_noise_verdict_and_commit():
    rows = {line.split(" | ")[0].lstrip("| "): line for line in tables.budget_table(_results()).splitlines()[2:]}
    ddp = rows["hang path, real DDP (2 ranks, 30 ms step, 5 jobs)"]
    assert "+0.40 % (+0.10 .. +0.60)" in ddp and "+0.00 % (-1.00 .. +1.00)" in ddp and "| met " in ddp
    assert "`abc1234` |" in ddp
    assert "| **missed** |" in rows["hang path, real FSDP2 (2 ranks, 80 ms step, 5 jobs)"]  # 3 % vs 0.5 %, A/A +-1 %
    replay = rows["replay at I=20 (16 ranks, N=6, V=3)"]
    assert "<= 1.5 x V/(I*N) = 3.75 %" in replay and "| **missed**" in replay and replay.endswith("| - |")
    assert not any(k.startswith("replay at I=5") for k in rows), "only the shipped interval (and 100) are budgets"
    snap = next(v for k, v in rows.items() if k.startswith("certified snapshots"))
    assert "| **invalid**: a job made no durable write |" in snap and "`def5678`+dirty" in snap
    assert "| **missed** |" in rows["snapshot host memory / state: at rest; peak"]  # 2.02x at rest > 2x


def test_a_figure_inside_the_noise_says_so_and_a_snapshot_row_with_durable_writes_is_judged():
    results = _results()
    results["snapshot_ab"]["durable_generations_min"] = 1
    snap = next(v for v in tables.budget_table(results).splitlines() if v.startswith("| certified snapshots"))
    assert "| met (within the A/A noise of the goal: not resolved) |" in snap  # 0.9 % vs 1 %, A/A up to 7 %
    ddp = next(v for v in tables.budget_table(results).splitlines() if v.startswith("| hang path, real DDP"))
    assert "| met (within the A/A noise of the goal" in ddp  # 0.4 % vs 0.5 %, A/A +-1 %


def test_a_section_not_measured_leaves_no_row():
    results = _results()
    del results["replay"], results["snapshot_ab"]
    assert len(tables.budget_table(results).splitlines()) == 4  # header, rule, DDP, FSDP2


def test_quick_mode_measures_the_three_headline_budgets_only():
    import run

    assert set(run.QUICK) == {"hang_real", "replay", "snapshot_ab"}
    assert set(run.FULL_ORDER) == set(run.SECTIONS), "the full run measures every section --only can name"
