"""Certification's coverage (scout_core.checkpoint.coverage): a cycle closes only when every unit replay samples
was replayed clean on this rank, whatever the order, holes and cadences; ``last_check_only`` is the paper's rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scout_core.checkpoint.coverage import Coverage, required_units
from scout_core.config import ConfigError, ReplayCadence, load


def _replay(*, n_hidden=3, extra=("embedding", "output"), eligible=frozenset({11, 12}), self_check_off=False,
            compare_slices=True, disabled=(), **cadence):
    return SimpleNamespace(cfg=SimpleNamespace(cadence=ReplayCadence(**cadence)), n_hidden=n_hidden,
                           schedule=SimpleNamespace(extra={r: i for i, r in enumerate(extra)}),
                           opt_slice=SimpleNamespace(eligible=eligible),
                           opt=SimpleNamespace(compare_slices=compare_slices),
                           trust=SimpleNamespace(self_check_off=self_check_off),
                           health=SimpleNamespace(disabled=set(disabled)))


def test_every_configured_rotation_is_required_and_a_recipe_at_cadence_0_is_not():
    got = required_units(_replay(), SimpleNamespace(every=20, cycle=4))
    assert got == {"hidden": frozenset({0, 1, 2}), "embedding": frozenset({0}), "output": frozenset({0}),
                   "optimizer": frozenset({11, 12}), "expert": frozenset(range(4))}
    got = required_units(_replay(optimizer=0, output=0, extra=("embedding",)), None)
    assert set(got) == {"hidden", "embedding"}


def test_coverage_closes_only_when_every_unit_was_seen_in_any_order():
    cov = Coverage()
    cov.need(required_units(_replay(), None))
    checks = [[("hidden", 0), ("embedding", 0), ("output", 0), ("optimizer", 11)],
              [("hidden", 2), ("embedding", 0), ("output", 0), ("optimizer", 12)]]
    for units in checks:
        assert not cov.would_complete(units)
        cov.add(units)
    assert not cov.would_complete([]) and cov.would_complete([("hidden", 1)])
    cov.reset()
    cov.need(required_units(_replay(), None))
    assert not cov.would_complete([("hidden", 1)])


def test_the_optimizer_requires_what_its_slice_rotates_over_now():
    """Before its first slice, and once pure FSDP's self-check (its only compared surface) is set aside, the
    optimizer requires nothing. A parameter without a gradient at one boundary (an unrouted expert) stays
    required until its update is replayed; one without a gradient for as many boundaries as the slice has units
    (frozen for good) leaves the rotation."""
    assert "optimizer" not in required_units(_replay(eligible=None), None)
    assert "optimizer" not in required_units(_replay(self_check_off=True, compare_slices=False), None)
    assert "optimizer" in required_units(_replay(self_check_off=True, compare_slices=True), None)
    cov = Coverage()
    cov.need(required_units(_replay(eligible=frozenset({1, 2}), n_hidden=1, extra=()), None))
    cov.add([("hidden", 0), ("optimizer", 1)])
    assert not cov.would_complete([])
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=1, extra=()), None))  # 2: no gradient now
    assert not cov.would_complete([])  # 2 was updated since the capture: its update is not vouched for yet
    cov.need(required_units(_replay(eligible=frozenset({1, 2}), n_hidden=1, extra=()), None))  # routed again
    assert cov.would_complete([("optimizer", 2)])
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=1, extra=()), None))
    assert not cov.would_complete([])
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=1, extra=()), None))  # 2 frozen for good
    assert cov.would_complete([])
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=1, extra=(), self_check_off=True,
                                    compare_slices=False), None))
    assert "optimizer" not in cov.required


def test_a_layer_rotation_required_since_the_capture_stays_required():
    """``scout ctl set replay.cadence.hidden=0`` after the capture: the candidate is promoted only once every block
    was replayed after it, never on the optimizer's evidence alone; a new window requires what the job has now."""
    cov = Coverage()
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=2, extra=()), None))
    cov.add([("hidden", 0), ("optimizer", 1)])
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=2, extra=(), hidden=0), None))
    assert not cov.would_complete([("optimizer", 1)])
    assert cov.would_complete([("hidden", 1)])
    cov.reset()
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=2, extra=(), hidden=0), None))
    assert cov.would_complete([("optimizer", 1)])


def test_a_recipe_replay_switched_off_keeps_its_units_and_nothing_is_verified():
    """Replay's health switched the hidden recipe off: its units stay required (the configured cadence decides),
    so however many other checks pass, the coverage never completes (rather than vouch for less)."""
    replay = _replay(n_hidden=2, extra=("embedding",), eligible=frozenset({5}), disabled={"hidden"})
    cov = Coverage()
    cov.need(required_units(replay, None))
    assert cov.required["hidden"] == frozenset({0, 1})
    for _ in range(5):
        assert not cov.would_complete([("embedding", 0), ("optimizer", 5)])
        cov.add([("embedding", 0), ("optimizer", 5)])


def test_last_check_only_closes_at_any_layer_check():
    cov = Coverage("last_check_only")
    cov.need(required_units(_replay(), SimpleNamespace(every=20, cycle=4)))
    assert cov.would_complete([("hidden", 1)]) and cov.would_complete([("expert", 3)])
    assert not cov.would_complete([("optimizer", 11), ("output", 0)])
    cov.reset()
    cov.need(required_units(_replay(hidden=0, n_hidden=0), None))  # no layer recipe at all: any check
    assert cov.would_complete([("optimizer", 11)])


def test_the_mode_is_a_config_key_with_a_clear_error():
    assert load(None, []).checkpoint.certify == "coverage"
    assert load(None, ["checkpoint.certify=last_check_only"]).checkpoint.certify == "last_check_only"
    with pytest.raises(ConfigError, match="checkpoint.certify.*coverage, last_check_only"):
        load(None, ["checkpoint.certify=k1"])
    with pytest.raises(ValueError, match="checkpoint.certify"):
        Coverage("k1")
