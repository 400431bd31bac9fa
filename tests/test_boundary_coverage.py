"""The step boundary's part of certification (StepBoundary._certify): a check's units count toward coverage only
when the job accepted it, a busy boundary's clean units count though nothing is captured, and a closed cycle or
recovery starts coverage over."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from scout_core.boundary import StepBoundary
from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier
from scout_core.checkpoint.coverage import Coverage
from scout_core.config import ReplayCadence, ScoutConfig


class _Coordinator:
    """SCOUT's coordinator as the boundary sees it: the job-wide evidence is this rank's plus what the script says
    of the others (busy: some rank still writing), and the real certifier decides."""

    def __init__(self, certifier: Certifier) -> None:
        self.certifier, self.busy_at, self.sdc_at = certifier, set(), set()

    def on_boundary(self, step: int, local: BoundaryEvidence) -> tuple[Action, BoundaryEvidence]:
        job = dataclasses.replace(local, busy=step in self.busy_at, sdc=local.sdc or step in self.sdc_at)
        return self.certifier.on_boundary(step, job), job


def _boundary() -> tuple[StepBoundary, _Coordinator]:
    cert = Certifier()
    coord = _Coordinator(cert)
    replay = SimpleNamespace(cfg=SimpleNamespace(cadence=ReplayCadence(optimizer=0)), n_hidden=2,
                             schedule=SimpleNamespace(extra={}), opt_slice=None)
    parts = SimpleNamespace(config=ScoutConfig(), coverage=Coverage(), replay=replay, experts=None, checkpoint=coord,
                            groups=SimpleNamespace(world_control=None))
    return StepBoundary(parts, live=None), coord


def _check(boundary: StepBoundary, step: int, layer: int) -> Action | None:
    result = SimpleNamespace(step=step, units=(("hidden", layer),))
    return boundary._certify(boundary.parts.checkpoint.certifier, result, None, BoundaryEvidence())[1]


def test_a_busy_boundarys_clean_units_count_and_the_next_boundary_closes():
    boundary, coord = _boundary()
    coord.busy_at = {2}
    assert _check(boundary, 1, 0) is Action.CAPTURE
    assert _check(boundary, 2, 1) is Action.SKIP  # busy: nothing captured, block 1 was replayed clean
    assert _check(boundary, 3, 0) is Action.CAPTURE_AND_PERSIST  # coverage {0, 1} is complete
    assert coord.certifier.candidate == 3 and boundary.parts.coverage.seen == {}


def test_a_busy_boundary_that_closes_the_coverage_promotes_and_the_next_free_one_captures_the_candidate():
    boundary, coord = _boundary()
    assert _check(boundary, 1, 0) is Action.CAPTURE
    assert _check(boundary, 2, 1) is Action.CAPTURE_AND_PERSIST  # candidate 2
    coord.busy_at = {4, 5}
    assert _check(boundary, 3, 0) is Action.CAPTURE
    assert _check(boundary, 4, 1) is Action.PROMOTE  # busy, and coverage {0, 1} after candidate 2 is complete
    assert _check(boundary, 5, 0) is Action.SKIP  # still busy: nothing left to promote, nothing captured
    assert _check(boundary, 6, 1) is Action.CAPTURE_AND_PERSIST  # the coverage stood: the new candidate at once
    assert (coord.certifier.verified, coord.certifier.candidate) == (2, 6) and boundary.parts.coverage.seen == {}
    assert _check(boundary, 7, 0) is Action.CAPTURE  # candidate 6 needs a whole coverage of its own


def test_recovery_starts_coverage_over():
    boundary, coord = _boundary()
    coord.sdc_at = {2}
    assert _check(boundary, 1, 0) is Action.CAPTURE
    assert _check(boundary, 2, 1) is Action.RECOVER
    assert _check(boundary, 3, 0) is Action.CAPTURE  # block 1 must be replayed again after step 2
    assert _check(boundary, 4, 1) is Action.CAPTURE_AND_PERSIST
