"""Certification's coverage (scout_core.checkpoint.coverage): a cycle closes only when every unit replay samples
was replayed clean on this rank, whatever the order, holes and cadences; ``last_check_only`` is the paper's rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scout_core.checkpoint.coverage import Coverage, required_units
from scout_core.config import ConfigError, ReplayCadence, load


def _replay(*, n_hidden=3, extra=("embedding", "output"), eligible=frozenset({11, 12}), **cadence):
    return SimpleNamespace(cfg=SimpleNamespace(cadence=ReplayCadence(**cadence)), n_hidden=n_hidden,
                           schedule=SimpleNamespace(extra={r: i for i, r in enumerate(extra)}),
                           opt_slice=SimpleNamespace(eligible=eligible))


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


def test_an_optimizer_rotation_not_known_yet_never_completes():
    cov = Coverage()
    cov.need(required_units(_replay(eligible=None, n_hidden=1, extra=()), None))
    assert not cov.would_complete([("hidden", 0)])
    cov.need(required_units(_replay(eligible=frozenset({5}), n_hidden=1, extra=()), None))
    assert cov.would_complete([("hidden", 0), ("optimizer", 5)])


def test_what_was_required_since_the_capture_stays_required():
    """A parameter without a gradient at the closing check, or a recipe switched to cadence 0 by ``scout ctl``, is
    still required: the candidate is promoted only once it was replayed after the capture."""
    cov = Coverage()
    cov.need(required_units(_replay(eligible=frozenset({1, 2}), n_hidden=1, extra=()), None))
    cov.add([("hidden", 0), ("optimizer", 1)])
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=1, extra=(), hidden=0), None))
    assert not cov.would_complete([("optimizer", 1)])
    assert cov.would_complete([("optimizer", 2)])
    cov.reset()  # a new window requires what the job has now
    cov.need(required_units(_replay(eligible=frozenset({1}), n_hidden=1, extra=(), hidden=0), None))
    assert cov.would_complete([("optimizer", 1)])


def test_a_rotation_replay_switched_off_is_never_complete():
    """The hidden recipe disabled by replay's health still counts as configured: nothing checks it, so no capture
    becomes verified (rather than vouch for less than the rule says)."""
    cov = Coverage()
    cov.need(required_units(_replay(n_hidden=2, extra=(), optimizer=0), None))
    for _ in range(5):  # only optimizer or embedding checks come now
        assert not cov.would_complete([("hidden", 0)])
        cov.add([("hidden", 0)])


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
