"""The trainer's side of this rank's hang observer: its progress tracker, its process, its health, its end.

:mod:`scout_core.assembly` makes the link and starts the observer; the step boundary asks :meth:`ObserverLink.check`
whether it still runs; :meth:`ScoutHandle.close <scout_core.handle.ScoutHandle.close>` ends it with
:meth:`ObserverLink.close`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from scout_core.progress.hooks import ProgressTracker, uninstall_collective_hooks
from scout_core.progress.observer import OBSERVER_REPORTED_EXIT, OBSERVER_STACKS_SIGNAL, ObserverSpec, start_observer
from scout_core.progress.record import Phase, create_record
from scout_core.progress.stacks import StacksArm
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter

__all__ = ["ObserverLink"]

_log = logging.getLogger("scout")


class ObserverLink:
    """One rank's observer as its trainer sees it; the tracker exists from the start, the process once started."""

    OBSERVER_EXIT_S = 5.0
    """close() waits this long for an idle observer (inside a store call, or a user callback) before killing it;
    one inside an episode (it says so in the record) gets until the episode's own bound, plus this."""

    def __init__(self, *, run_id: str, rank: int, reporter: Reporter, host: str, device: str) -> None:
        self.rank = rank
        self.reporter = reporter
        self.host, self.device = host, device
        self.tracker = ProgressTracker(create_record(run_id, rank))
        self.stacks: StacksArm | None = None  # this trainer's stack dump on its observer's request
        self.observer_pid: int | None = None
        self.startup_s: float | None = None
        self.control_plane: Any = None
        self.ddp_buckets_visible: bool | None = None
        self._episode_bound_s = 0.0
        self.reported = False  # its death was reported (or it reported itself): its pid is no longer ours

    def start(self, spec: ObserverSpec, *, world_control: Any) -> None:
        """Start the observer and wait until it is ready; every rank raises together if any observer is not."""
        start = time.monotonic()
        self.control_plane = spec.control
        # An episode's longest wait (a member's wait for the verdict: EpisodeProtocol.await_verdict), with room
        # for its records and callbacks: how long close() lets a busy observer finish.
        self._episode_bound_s = 2 * (spec.gather_timeout_s + 2 * spec.heartbeat_s + 2.0) + self.OBSERVER_EXIT_S
        try:
            pid, ready_fd = start_observer(spec)
        except Exception:  # noqa: BLE001 - it could not even start (no executable, no processes left): every
            _log.exception("rank %d: the SCOUT observer could not be started", self.rank)  # rank raises below
            pid, ready_fd = None, None
        self.observer_pid = pid
        ok = False
        if ready_fd is not None:
            try:
                with selectors.DefaultSelector() as sel:  # not select(): a trainer's fds may be numbered past 1023
                    sel.register(ready_fd, selectors.EVENT_READ)
                    ok = bool(sel.select(spec.startup_timeout_s)) and os.read(ready_fd, 1) == b"R"
            finally:
                os.close(ready_fd)
        if not ok and pid is not None:  # where it waits, on stderr, for whoever reads the job's log
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, OBSERVER_STACKS_SIGNAL)
                time.sleep(1.0)
        everyone = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=world_control)
        if not everyone.item():  # every rank raises together: no rank is left waiting in a later collective
            self.check()
            plane = spec.control
            raise RuntimeError(f"rank {self.rank}: the SCOUT observer {'of another rank ' if ok else ''}did not "
                               f"start within {spec.startup_timeout_s}s (control store "
                               f"{plane.host}:{plane.port}, {plane.kind})")
        self.startup_s = time.monotonic() - start

    def check(self) -> bool:
        """True while the observer runs; reports its death once (observer_failure)."""
        if self.observer_pid is None or self.reported:
            return not self.reported
        try:
            done, status = os.waitpid(self.observer_pid, os.WNOHANG)
        except ChildProcessError:
            done, status = self.observer_pid, 0
        if not done:
            return True
        self.reported = True
        code = os.waitstatus_to_exitcode(status)
        if code != OBSERVER_REPORTED_EXIT:  # that code means the observer reported itself
            self.reporter.emit(Incident(
                kind=IncidentKind.OBSERVER_FAILURE, scope=IncidentScope.RANK, ranks=[self.rank],
                hosts=[self.host], devices=[self.device], step=self.tracker.step,
                reason=f"observer of rank {self.rank} (pid {self.observer_pid}) exited with {code}; "
                       "hangs on this rank can no longer be localized",
                evidence={"observer_pid": self.observer_pid, "exit": code},
            ))
        return False

    def close(self, quietly: Callable[[Callable[[], Any], str], None]) -> None:
        """Remove the tracker's hooks, end the observer (it need not answer for this trainer) and remove the
        progress record; ``quietly(fn, what)`` runs each step so that a failure never stops the next."""
        tracker = self.tracker
        quietly(tracker.remove_hooks, "progress hooks")
        quietly(lambda: uninstall_collective_hooks(tracker), "collective hooks")
        if self.observer_pid is not None and not self.reported:  # not reaped: its pid is still ours
            quietly(lambda: tracker.mark(Phase.CLOSED), "progress record")  # it ends without answering for us
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.observer_pid, 15)
            self.reap()
        quietly(tracker.record.unlink, "progress record")
        quietly(tracker.record.close, "progress record")
        if self.stacks is not None:
            quietly(self.stacks.disarm, "stack dump signal")

    def reap(self) -> None:
        """Wait for the observer we terminated: ``OBSERVER_EXIT_S`` from close() or from the end of its last
        busy stretch (an episode, its records, its closing messages), at most ``_episode_bound_s`` busy; then
        kill it. Never blocks for good: a process stuck in uninterruptible I/O (an fsync on a hung file
        system) is left behind after one more ``OBSERVER_EXIT_S``."""
        record = self.tracker.record if self.tracker is not None else None
        idle_since = busy_since = time.monotonic()
        killed_at: float | None = None
        try:
            while os.waitpid(self.observer_pid, os.WNOHANG)[0] == 0:
                now = time.monotonic()
                if killed_at is not None:
                    if now - killed_at > self.OBSERVER_EXIT_S:
                        _log.warning("rank %d: the SCOUT observer (pid %d) does not exit even when killed",
                                     self.rank, self.observer_pid)
                        return
                elif record is not None and record.observer_busy:
                    idle_since = now
                    if now - busy_since > self._episode_bound_s:
                        killed_at = now
                        os.kill(self.observer_pid, 9)
                else:
                    busy_since = now
                    if now - idle_since > self.OBSERVER_EXIT_S:
                        killed_at = now
                        os.kill(self.observer_pid, 9)
                time.sleep(0.01)
        except (ChildProcessError, ProcessLookupError):
            pass
