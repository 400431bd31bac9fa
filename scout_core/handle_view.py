"""What a handle shows of the parts it holds: each attribute reads through to the part that owns it.

Plugins, tests and the metrics read ``handle.replay``, ``handle.certifier``, ``handle.last_result`` and the like;
the values live in :class:`~scout_core.parts.ScoutParts` and :class:`~scout_core.boundary.StepBoundary`.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scout_core.adapter import FrameworkAdapter
    from scout_core.boundary import StepBoundary
    from scout_core.checkpoint.certify import Certifier
    from scout_core.checkpoint.coordinator import CheckpointCoordinator
    from scout_core.checkpoint.durable import FrameworkCheckpoints
    from scout_core.checkpoint.snapshot import SnapshotEngine
    from scout_core.config import ScoutConfig
    from scout_core.control import RunControl
    from scout_core.groups import ScoutGroups
    from scout_core.moe.replay import ExpertReplay
    from scout_core.parts import ScoutParts
    from scout_core.progress.hooks import ProgressTracker
    from scout_core.replay.engine import BoundaryResult, ReplayEngine
    from scout_core.replay.guard import DiagnosisGuard
    from scout_core.report import Reporter

__all__ = ["HandleView"]


class _ReadThrough:
    """``handle.NAME`` reads ``handle.<holder>.NAME``."""

    def __init__(self, holder: str) -> None:
        self.holder = holder

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.read = operator.attrgetter(f"{self.holder}.{name}")

    def __get__(self, handle: Any, owner: type | None = None) -> Any:
        return self if handle is None else self.read(handle)

    def __set__(self, handle: Any, value: Any) -> None:
        # A write here would only shadow the part's value and change nothing: say where it lives instead.
        raise AttributeError(f"handle.{self.name} is read-only: it belongs to handle.{self.holder}")


def _of(holder: str) -> Any:
    """A read-through attribute, typed by the annotation it is assigned to."""
    return _ReadThrough(holder)


class HandleView:
    """The read-only attributes of :class:`~scout_core.handle.ScoutHandle`."""

    parts: ScoutParts
    boundary: StepBoundary

    # Who the rank is, and each part it runs (None where the configuration leaves it off).
    config: ScoutConfig = _of("parts")
    adapter: FrameworkAdapter = _of("parts")
    rank: int = _of("parts")
    world_size: int = _of("parts")
    run_id: str = _of("parts")
    groups: ScoutGroups = _of("parts")
    hosts: dict[int, str] = _of("parts")
    devices: dict[int, str] = _of("parts")
    reporter: Reporter = _of("parts")
    guard: DiagnosisGuard = _of("parts")
    launch_id: str = _of("parts")
    metrics: Any = _of("parts")  # scout_core.metrics.ScoutMetrics, where report.prometheus asks for it
    control: RunControl | None = _of("parts")
    replay: ReplayEngine | None = _of("parts")
    experts: ExpertReplay | None = _of("parts")
    snapshots: SnapshotEngine | None = _of("parts")
    checkpoint: CheckpointCoordinator | None = _of("parts")
    tracker: ProgressTracker | None = _of("parts")
    certifier: Certifier | None = _of("parts")
    # What the last boundary found, and what a verdict does.
    last_result: BoundaryResult | None = _of("boundary")
    last_expert: Any = _of("boundary")  # the expert check of the last boundary (scout_core.moe.replay.ExpertCheck)
    last_decision: Any = _of("boundary")
    stopped: bool = _of("boundary")
    stop_on_verdict: bool = _of("boundary")
    exit_code: int = _of("boundary")

    @property
    def peer_groups_ranks(self) -> tuple[int, ...]:
        return self.parts.groups.peer_ranks

    @property
    def observer_pid(self) -> int | None:
        return self.parts.observer.observer_pid if self.parts.observer is not None else None

    @property
    def ddp_buckets_visible(self) -> bool | None:
        """Whether each DDP gradient bucket publishes to the hang path (``observer.ddp_bucket_hook``; False when
        off, as shipped, or when the model had its own comm hook); None without the observer (docs/hangs.md)."""
        return self.parts.observer.ddp_buckets_visible if self.parts.observer is not None else None

    @property
    def observer_startup_s(self) -> float | None:
        return self.parts.observer.startup_s if self.parts.observer is not None else None

    @property
    def _observer_reported(self) -> bool:
        return self.parts.observer is not None and self.parts.observer.reported

    @property
    def framework_checkpoints(self) -> FrameworkCheckpoints | None:
        """Labels of the framework's own checkpoints (``label_framework_checkpoints``), or None."""
        return self.parts.labels.framework_checkpoints if self.parts.labels is not None else None
