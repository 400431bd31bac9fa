"""The handle ``enable()`` returns: holds every part SCOUT installed on this rank, and knows how to undo it.

The runtime (:mod:`scout_core.runtime`, :mod:`scout_core.assembly`) builds the parts; the handle's public methods
hand each call to the part that does it: the step boundary (:mod:`scout_core.boundary`), the restart path
(:mod:`scout_core.checkpoint.restart`), the framework-checkpoint labels (:mod:`scout_core.checkpoint.labels`).
:meth:`ScoutHandle.close` removes every hook, thread, process, shared-memory record and process group, in order.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch.distributed as dist

from scout_core.actions import ScoutStop
from scout_core.boundary import StepBoundary
from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_core.checkpoint.restart import Restart
from scout_core.checkpoint.resume import ResumeResult
from scout_core.handle_view import HandleView
from scout_core.live_control import LiveControl
from scout_core.parts import ScoutParts
from scout_core.replay.engine import BoundaryResult

__all__ = ["ScoutHandle", "close_at_exit", "exit_closer"]

_log = logging.getLogger("scout")

CRASH_FLUSH_S = 30.0
"""How long close() waits for snapshot persistence in flight while training is failing (a partner it
exchanges replicas with may be gone too); the slot written before that point survives the process."""


class ScoutHandle(HandleView):
    """What :func:`scout_core.enable` returns; :meth:`close` undoes everything it installed."""

    _open: ClassVar[ScoutHandle | None] = None
    _claim_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, parts: ScoutParts, *, boundary: StepBoundary, restart: Restart, live: LiveControl) -> None:
        self.parts = parts
        self.boundary = boundary
        self.restart = restart
        self.live = live
        self._closed = False
        ScoutHandle._open = self

    # -- one SCOUT per process -----------------------------------------------------------------------

    @classmethod
    def claim(cls) -> None:
        with cls._claim_lock:
            if cls._open is not None and not cls._open._closed:
                raise RuntimeError("SCOUT is already enabled on this rank; call close() on the existing handle "
                                   "before enable() again")
            cls._open = _CLAIMED

    @classmethod
    def is_open(cls) -> bool:
        """Whether SCOUT is enabled (or being enabled) on this rank."""
        with cls._claim_lock:
            return cls._open is not None and (cls._open is _CLAIMED or not cls._open._closed)

    @classmethod
    def release_claim(cls) -> None:
        with cls._claim_lock:
            if cls._open is _CLAIMED:
                cls._open = None

    # -- training-loop boundaries --------------------------------------------------------------------

    def on_step(self) -> BoundaryResult | None:
        """The boundary after each optimizer step (called by the hook; call it yourself if you have no
        optimizer to hook). Replay, certification, actions. Never raises into training except
        :class:`~scout_core.actions.ScoutStop` when ``actions.on_verdict`` is ``stop``."""
        start = time.perf_counter()
        try:
            return self.boundary.on_step()
        finally:  # also when the boundary stops the job: the last figures are the ones an operator reads
            if self.parts.metrics is not None:
                self.parts.metrics.boundary(self, time.perf_counter() - start)
            if self.parts.run_log is not None:  # what the end record counts
                self.parts.run_log.counts.count(self.parts.step(), self.last_result, self.last_expert)

    def settle(self) -> None:
        """End of the training step, as seen from the next data fetch or the next optimizer step: the
        caller's state joins the snapshot taken at the boundary, then a pending stop is carried out."""
        self.boundary.settle()

    def flush(self) -> None:
        """The training step is over: complete the snapshot with the caller's state and wait until it is
        written and replicated (a pending stop is carried out here too)."""
        self.boundary.flush()

    def wrap_dataloader(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """The loader, marked for the hang path; each fetch is also where a step ends (see :meth:`settle`)."""
        handle = self

        class _Settling:
            def __iter__(self) -> Any:
                for item in inner:
                    yield item
                    handle.settle()

            def __len__(self) -> int:
                return len(iterable)  # type: ignore[arg-type]

        inner = self.tracker.wrap_dataloader(iterable) if self.tracker else iterable
        return _Settling()

    def checkpoint_io(self, kind: str = "write") -> contextlib.AbstractContextManager[None]:
        return self.tracker.checkpoint_io(kind) if self.tracker else contextlib.nullcontext()

    def check_observer(self) -> bool:
        """True while the observer runs; reports its death once (observer_failure)."""
        return self.parts.observer.check() if self.parts.observer is not None else True

    # -- restart and the framework's own checkpoints ---------------------------------------------------

    def resume(self, failure: str | None = None) -> ResumeResult:
        """Restore the checkpoint the retrieval policy chooses (see :mod:`scout_core.checkpoint.resume`).

        Call once, on every rank, right after ``enable()``. Returns ``ResumeResult(step=None)`` on a
        fresh start. ``failure`` forces the failure kind when no decision was recorded, except that a lost machine (some
        rank's own snapshot gone or written on another machine) always restores verified: no sweep can run there.
        """
        return self.restart.resume(failure)

    def continue_from(self, step: int, *, verified: int | None, abandon_newer: bool = True) -> None:
        """The framework restored its own checkpoint of ``step`` (not one of SCOUT's snapshots): SCOUT's step
        count, replay schedule and certification go on from there, every rank alike. ``verified``: the newest
        verified step at or before it (the restored state's trust), or None. SCOUT's own snapshots newer than
        ``step`` belong to the abandoned run and are deleted, so a later restart never mixes them in
        (``abandon_newer=False``: a job that only reads the checkpoint keeps them)."""
        self.restart.continue_from(step, verified=verified, abandon_newer=abandon_newer)

    def label_framework_checkpoints(self, folder: str) -> FrameworkCheckpoints | None:
        """Label the framework's own checkpoints in ``folder`` by certification (see
        :mod:`scout_core.checkpoint.durable`). Every rank calls it (it changes what each boundary exchanges); the
        caller reports each save with ``saved(step, path, handle.certifier)``, asks ``choose()`` at restart and
        tells SCOUT where training goes on (:meth:`continue_from`). Without SCOUT's own snapshots
        (``checkpoint.enabled`` false) the same certification runs for these labels alone. None when replay is
        off: nothing could ever verify a checkpoint, and labels would only hold restarts back."""
        assert self.parts.labels is not None
        return self.parts.labels.label(folder)

    def certify_framework_checkpoints(self) -> None:
        """Start certifying for the framework's checkpoints now, where their folder is known only at the first
        save (DeepSpeed's ``save_checkpoint(save_dir)``): a verdict before that save must still reject what the
        job saves after it, and nothing may be verified on evidence that began after the corruption spread.
        :meth:`label_framework_checkpoints` calls it too. Nothing where SCOUT's own snapshots certify, or replay
        is off."""
        assert self.parts.labels is not None
        self.parts.labels.certify()

    # -- teardown ------------------------------------------------------------------------------------

    def close(self, *, discard_snapshots: bool = False, failed: bool | None = None) -> None:
        """Remove every hook, thread, process, record and group SCOUT created; idempotent.

        In-memory snapshots are kept (they exist to survive the trainer: a restart resumes from them)
        unless ``discard_snapshots`` (e.g. after the last step of a finished job). Safe in an exception
        handler: while training is failing, a pending stop is not carried out (it would wait for peers
        that may be gone), persistence in flight gets at most ``CRASH_FLUSH_S``, and every clean-up step
        runs even if an earlier one fails. ``failed``: whether training ended by a failure (None: judged from
        the exception being handled; an exit handler, which cannot tell, passes True).
        """
        if self._closed:
            return
        failing = sys.exc_info()[1] is not None if failed is None else failed
        pending: ScoutStop | None = None
        if not failing:
            try:
                self.settle()  # the last step's caller state; a stop decided at the last step is still carried out
            except ScoutStop as stop:
                pending = stop
            except Exception as exc:  # noqa: BLE001 - clean-up must still happen
                failure = exc
                self._quietly(lambda: self.guard.report(self.parts.step(), "close", failure, "settle at close"),
                              "report")
        else:
            self._quietly(self.boundary.complete_caller_state, "caller state at close")
        labels = self.framework_checkpoints
        if not failing and pending is None and not self.stopped and labels is not None:
            # A normal end: a relaunch goes on from the newest checkpoint not rejected (see durable.ended).
            self._quietly(labels.ended, "checkpoint labels at close")
        self._closed = True
        try:
            self._release(failing=failing, stopped=pending is not None or self.stopped,
                          discard_snapshots=discard_snapshots)
        finally:
            with ScoutHandle._claim_lock:
                if ScoutHandle._open is self:
                    ScoutHandle._open = None
        if pending is not None:
            raise pending

    def _release(self, *, failing: bool, stopped: bool, discard_snapshots: bool) -> None:
        """close()'s clean-up, in order: hooks, snapshots (flushed), replay, observer, metrics, control, groups,
        and last the end record (a write that hangs on a hung file system holds nothing else back)."""
        p = self.parts
        for h in p.hooks:
            self._quietly(h.remove, "hook removal")
        p.hooks.clear()
        checkpoint = p.checkpoint
        if checkpoint is not None:
            def final_flush() -> None:
                with p.own_checkpoint_io("write"):  # a long last write is I/O for the observer, not a stall
                    checkpoint.flush(CRASH_FLUSH_S if failing else None)

            self._quietly(final_flush, "snapshot flush")
            if discard_snapshots:
                self._quietly(lambda: checkpoint.memory.remove_mine(checkpoint.sources), "snapshot removal")
        if p.snapshots is not None:
            self._quietly(p.snapshots.close, "snapshot engine")
        if p.replay is not None:
            self._quietly(p.replay.close, "replay hooks")
        if p.experts is not None:
            self._quietly(p.experts.close, "expert replay hooks")
        if p.observer is not None:
            p.observer.close(self._quietly)
        if p.metrics is not None:  # a rank that stopped or failed keeps its last textfile (scout_running 0)
            self._quietly(lambda: p.metrics.close(keep_textfile=failing or stopped), "metrics endpoint")
        if p.control is not None:
            self._quietly(p.control.close, "control folder")
        for g in {p.groups.world_control, p.groups.peer, p.groups.peer_control,
                  p.groups.replica_control, getattr(checkpoint, "repl_group", None)} - {None}:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(g)
        if p.run_log is not None:
            ended = "stopped on a verdict" if stopped else "failed" if failing else "closed"
            self._quietly(lambda: p.run_log.end(ended), "end record")
            c = p.run_log.counts
            if self.rank == 0 and logging.getLevelName(p.config.report.log_level.upper()) <= logging.WARNING:
                self._quietly(lambda: print(
                    f"SCOUT off: {ended} after {c.steps} steps, {c.checks} replay checks ({c.agreed} agreed by every "
                    f"peer); records in {p.config.report.jsonl_path or 'the log only'}", file=sys.stderr, flush=True),
                    "closing line")

    def _quietly(self, fn: Callable[[], Any], what: str) -> None:
        """One clean-up step: a failure is logged and the next step still runs."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - close() must release everything it can
            _log.warning("rank %d: SCOUT close: %s failed (%s: %s)", self.rank, what, type(exc).__name__, exc)

    def __enter__(self) -> ScoutHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Claimed:
    _closed = False


_CLAIMED: Any = _Claimed()


def close_at_exit(handle: ScoutHandle) -> None:
    """Close ``handle`` when the interpreter exits, for a plugin whose framework may never say that training ended
    (a script that never calls ``engine.destroy()``, a Trainer whose ``train()`` raised). An exit handler cannot
    tell a normal end from ``sys.exit(1)`` after a caught error, so that close counts as a failure: the checkpoint
    labels do not say the run ended normally, and a relaunch loads the newest verified checkpoint rather than the
    newest one not rejected. Holds the handle weakly: one closed and collected is left alone."""
    atexit.register(exit_closer(weakref.ref(handle)))


def exit_closer(handle: Callable[[], Any]) -> Callable[[], None]:
    """What :func:`close_at_exit` registers: ``handle()`` returns the handle, or None once it is gone."""

    def close() -> None:
        live = handle()
        if live is not None:
            live.close(failed=True)

    return close
