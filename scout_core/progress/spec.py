"""What an observer is started with (:class:`ObserverSpec`), and the silence threshold it derives from it.

The silence threshold adapts to the job: never below
``observer.silence_threshold_s``, at least ``observer.adaptive_multiple`` times
the longest healthy interval between two progress marks seen after the
warm-up (the first two steps, which tolerate ``first_step_silence_s``), and at
least ``io_silence_s`` while the rank is in a data-loader or checkpoint phase
(a long save on every rank is not a hang; a rank stuck in one while its peers
wait is still named, by the peers' observers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scout_core.progress.control import ControlPlane
from scout_core.progress.record import Phase, ProgressSnapshot
from scout_core.report import Incident

__all__ = ["ObserverSpec", "peer_groups_as_lists", "silence_threshold", "steady_threshold"]


@dataclass(kw_only=True)
class ObserverSpec:
    """Everything an observer is told at its start; what the trainer changes live later reaches it through the
    record."""

    run_id: str
    """The job's run id; store keys live under ``scout/<run_id>/<launch>``."""
    launch: str = ""
    """A per-launch nonce (rank 0's): a restarted job with the same run id never reads the last one's keys."""
    rank: int
    world_size: int
    record_path: str
    control: ControlPlane
    peer_groups: list[list[int]]
    hosts: dict[int, str]
    devices: dict[int, str]
    silence_threshold_s: float
    first_step_silence_s: float = 300.0
    io_silence_s: float = 300.0
    adaptive_multiple: float = 4.0
    gather_timeout_s: float
    startup_timeout_s: float
    jsonl_path: str | None
    fsync: bool = True
    log_level: str = "WARNING"
    on_incident: Callable[[Incident], None] | None = None
    """The user's callback, run by the observer for each hang verdict (a spawned observer imports it by path)."""
    exclusions_path: str | None = None
    """The hosts file a drainable verdict is added to (``actions.exclude_hosts_path``); None: none is kept."""
    start_method: str = "spawn"
    """``spawn`` (a fresh interpreter) or ``fork`` (``observer.start_method``)."""
    trainer_pid: int = field(default_factory=os.getpid)
    heartbeat_s: float = 1.0
    """How often a healthy observer checks whether an episode is open (one store message)."""
    stop_on_verdict: bool = False
    """``actions.on_verdict: stop``: after a hang verdict every observer terminates its trainer."""
    trainer_stacks: list[int] | None = None
    """``[fd, signal, main thread id]``: where the trainer dumps its threads' stacks on its observer's signal
    (:mod:`scout_core.progress.stacks`); None: not armed."""
    launcher_error_file: str | None = None
    """The trainer's ``$TORCHELASTIC_ERROR_FILE``: a stop on a verdict writes the verdict there first, so that
    torchrun's summary names it (None: no launcher asked for one)."""


_IO_PHASES = (Phase.DATALOADER, Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE)
_CHECKPOINT_PHASES = (Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE)


def steady_threshold(base: float, multiple: float, ceiling: float, gap_max: float) -> float:
    """The threshold after the warm-up: at least ``base``, at least ``multiple`` x the longest healthy gap,
    at most the warm-up tolerance (a gap that long is a stall whatever the rhythm)."""
    return max(base, min(multiple * gap_max, max(base, ceiling)))


def silence_threshold(spec: ObserverSpec, snap: ProgressSnapshot) -> float:
    """Seconds of silence after which this observer opens an episode, given its trainer's last publish.

    The warm-up lasts until the trainer has completed its first two steps (of this launch, resumed or not):
    until then no rhythm is published (``gap_max`` is 0) and ``first_step_silence_s`` applies.

    Only the trainer learns the rhythm, and only from gaps below the threshold in force: an observer that
    learned silences its episode found without a verdict would learn rank 0's saves (its peers wait within
    the I/O tolerance) and the stall of whichever rank reached a collective first."""
    if snap.gap_max <= 0.0:
        return max(spec.silence_threshold_s, spec.first_step_silence_s)
    threshold = steady_threshold(spec.silence_threshold_s, spec.adaptive_multiple, spec.first_step_silence_s,
                                 snap.gap_max)
    if snap.phase in _IO_PHASES and not snap.pending:
        threshold = max(threshold, spec.io_silence_s)
    elif snap.phase in _CHECKPOINT_PHASES:
        # A collective inside a checkpoint save or load (a distributed checkpoint's planning gathers, its
        # barriers, an asynchronous save's finalization) lasts as long as the storage takes: part of the I/O.
        threshold = max(threshold, spec.io_silence_s)
    return threshold


def peer_groups_as_lists(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(map(int, g)) for g in groups]
