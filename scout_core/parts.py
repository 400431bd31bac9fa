"""Every part SCOUT runs on one rank, None where the configuration leaves it off, and who the rank is.

The assembly (:mod:`scout_core.assembly`) fills it in; the handle, the step boundary, the restart path and the
live-control table read it. The few things several of them need (the step, the certifier, the caller's state in a
snapshot) are answered here once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scout_core.adapter import FrameworkAdapter
from scout_core.checkpoint.coverage import Coverage
from scout_core.config import ScoutConfig
from scout_core.groups import ScoutGroups
from scout_core.replay.guard import DiagnosisGuard
from scout_core.report import Reporter
from scout_core.run_log import RunLog

if TYPE_CHECKING:
    from scout_core.checkpoint.certify import Certifier
    from scout_core.checkpoint.coordinator import CheckpointCoordinator
    from scout_core.checkpoint.labels import FrameworkLabels
    from scout_core.checkpoint.snapshot import SnapshotEngine
    from scout_core.control import RunControl
    from scout_core.moe.replay import ExpertReplay
    from scout_core.observer_link import ObserverLink
    from scout_core.progress.hooks import ProgressTracker
    from scout_core.replay.engine import ReplayEngine

__all__ = ["ScoutParts"]


@dataclass(eq=False)
class ScoutParts:
    """One rank's SCOUT: who it is in the job, then each part built at ``enable()`` (None: switched off)."""

    config: ScoutConfig
    adapter: FrameworkAdapter
    rank: int
    world_size: int
    run_id: str
    groups: ScoutGroups
    hosts: dict[int, str]
    devices: dict[int, str]
    reporter: Reporter
    guard: DiagnosisGuard
    launch_id: str = ""
    """Rank 0's nonce for this launch: the observers' store keys of a restarted job never collide."""
    metrics: Any = None  # scout_core.metrics.ScoutMetrics, where report.prometheus asks for it
    control: RunControl | None = None  # unless control.enabled is false (or rank 0 could not make its folder)
    observer: ObserverLink | None = None
    replay: ReplayEngine | None = None
    experts: ExpertReplay | None = None
    """The MoE expert recipe (``enable(..., moe=...)``), or None."""
    snapshots: SnapshotEngine | None = None
    checkpoint: CheckpointCoordinator | None = None
    labels: FrameworkLabels | None = None
    """Labels of the framework's own checkpoints (see :mod:`scout_core.checkpoint.labels`)."""
    coverage: Coverage = field(default_factory=Coverage)
    """What replay vouched for on this rank since the candidate's capture (``checkpoint.certify``)."""
    hooks: list[Any] = field(default_factory=list)
    """Hook handles SCOUT installed on the caller's objects (each has ``remove()``)."""
    run_log: RunLog | None = None
    """The start and end records beside the incident file (rank 0 writes them; see :mod:`scout_core.run_log`)."""

    @property
    def tracker(self) -> ProgressTracker | None:
        return self.observer.tracker if self.observer is not None else None

    @property
    def certifier(self) -> Certifier | None:
        """The job's certification state: SCOUT's checkpoint coordinator's, or the one that certifies only the
        framework's own checkpoints; None when nothing certifies."""
        if self.checkpoint is not None:
            return self.checkpoint.certifier
        return self.labels.certifier if self.labels is not None else None

    def step(self) -> int:
        if self.replay is not None:
            return self.replay.step
        return self.tracker.step if self.tracker is not None else 0

    def own_checkpoint_io(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """SCOUT's own blocking checkpoint work on the training thread, published as such for the observer."""
        tracker = self.tracker
        if tracker is None or tracker.closed:
            return contextlib.nullcontext()
        return tracker.checkpoint_io(kind)

    # -- what a snapshot holds besides the model, the optimizer and the RNG -------------------------------

    def scout_state(self) -> dict[str, Any]:
        """SCOUT's own schedule and saved calls, final at the boundary. The caller's state is added at the
        next settle point (:meth:`~scout_core.boundary.StepBoundary.settle`), once the scheduler, scaler and
        loop counters have stepped."""
        extra: dict[str, Any] = {"caller": {}}
        if self.replay is not None:
            extra["scout"] = self.replay.sweep_state()
        if self.experts is not None:
            extra["scout_experts"] = self.experts.state()
        return extra

    def caller_state(self) -> dict[str, Any]:
        """The caller's state objects for a snapshot; a read that fails is reported, never raised (the snapshot
        must still complete, or persistence waits forever)."""
        try:
            return self.adapter.get_state() if self.adapter.get_state else {}
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.guard.report(self.step(), "checkpoint", exc, "caller state for the snapshot")
            return {"unavailable": True}

    def restore_caller_state(self, extra: dict[str, Any]) -> None:
        if self.adapter.set_state is not None:
            self.adapter.set_state(extra.get("caller", {}))
