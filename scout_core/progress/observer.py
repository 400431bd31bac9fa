"""The out-of-band observer: one CPU process per rank (paper section 7); its life cycle and its watch loop.

The observer is started by :func:`start_observer` as a fresh interpreter
(:mod:`~scout_core.progress.spawn`; a fork of its trainer with
``observer.start_method: fork``: :mod:`~scout_core.progress.process`), and runs
on its own interpreter and GIL: a trainer blocked in a collective, in a kernel
or in ``SIGSTOP`` cannot block it.

While the job is healthy it sends one ``check`` per heartbeat to the control
store (:mod:`scout_core.progress.control`), which no rank serves. When its
trainer has been silent longer than the silence threshold
(:mod:`~scout_core.progress.spec`, adapted to the job), it opens an episode;
every observer then posts its rank's state, working or not, and
:class:`~scout_core.progress.episode.EpisodeProtocol` turns the evidence into
one verdict. The reporter writes the records, every observer runs the user's
callback, even though the trainers stay blocked, and once a stopped rank moves
again the reporter writes a ``resolved`` record, and a job that ends with the verdict
standing a ``shutdown`` record (:mod:`~scout_core.progress.delivery`).

A trainer that exits without :meth:`~scout_core.handle.ScoutHandle.close` is
answered for by its observer (``alive: false``) in one last episode, so the
peers of a crashed or killed rank learn who is gone; one that closes is
answered as :mod:`~scout_core.progress.closing` describes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from scout_core.progress.classify import Evidence
from scout_core.progress.closing import STOP_GRACE_S, TrainerEnding, _Closing
from scout_core.progress.control import BEAT_KEY, connect, daemon_key
from scout_core.progress.delivery import VerdictReporting, _Stopped, incident_reporter
from scout_core.progress.episode import EpisodeProtocol
from scout_core.progress.process import (
    OBSERVER_STACKS_SIGNAL,
    _die_with_parent,
    _release_inherited_files,
    fork_observer,
)
from scout_core.progress.record import Phase, ProgressRecord, ProgressSnapshot
from scout_core.progress.sealed import seal
from scout_core.progress.spec import ObserverSpec, peer_groups_as_lists, silence_threshold, steady_threshold
from scout_core.report import Incident

# The trainer (scout_core.handle), tests and docs import these from here, wherever they live; the loop below looks
# silence_threshold up here (a test swaps it for a fixed one).
__all__ = ["OBSERVER_REPORTED_EXIT", "OBSERVER_STACKS_SIGNAL", "ObserverSpec", "STOP_GRACE_S", "peer_groups_as_lists",
           "start_observer", "steady_threshold"]

_log = logging.getLogger("scout")

OBSERVER_REPORTED_EXIT = 3
"""Exit code of an observer that crashed and already reported its own failure."""


class _ControlPlaneDown(Exception):
    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """Store and network failures (the store's machine died, or the job ended and took it) as one type. The
    store client's errors are ``OSError``s (:mod:`~scout_core.progress.store_client`)."""
    try:
        yield
    except OSError as exc:
        raise _ControlPlaneDown(f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc


_DAEMON_BEAT_S = 10.0


def start_observer(spec: ObserverSpec) -> tuple[int, int]:
    """Start the observer, a fresh interpreter unless ``spec.start_method`` is ``fork`` or its callback has no
    import path (:mod:`~scout_core.progress.spawn`); return ``(pid, read end of its readiness pipe)``."""
    from scout_core.progress.spawn import callback_path, spawn_observer

    if spec.start_method == "spawn" and sys.executable:  # an embedded interpreter has no executable to start
        path = callback_path(spec.on_incident)
        if path is not None or spec.on_incident is None:
            return spawn_observer(spec, callback=path)
        if spec.rank == 0:
            _log.warning("SCOUT: on_incident %r has no import path (a lambda, a closure, a bound method, a "
                         "function of the training script or of a module loaded from a file), so the observers "
                         "are forked from their trainers, not started fresh; pass a module-level function, or "
                         "'module:function', to spawn them",
                         spec.on_incident)
    return fork_for(spec)


def fork_for(spec: ObserverSpec) -> tuple[int, int]:
    """Fork the observer from this trainer (``observer.start_method: fork``)."""
    return fork_observer(lambda ready_fd, death_signal: _Observer(spec, ready_fd).run(death_signal=death_signal))


class _Observer(TrainerEnding, VerdictReporting):
    """One rank's observer: set up in :meth:`run`, then the watch loop until its trainer closes or dies."""

    def __init__(self, spec: ObserverSpec, ready_fd: int) -> None:
        self.spec = spec
        self.ready_fd = ready_fd
        self.record: ProgressRecord | None = None
        self.proto: EpisodeProtocol | None = None
        self.store: Any = None
        self._plane_reported = False
        self._critical = False
        """Inside an episode or the delivery of its verdict: a closing trainer's SIGTERM waits until it ends."""
        self._close_pending = False
        self._watch: tuple[int, list[Incident], float] | None = None
        self._watch_from: tuple[int, int] | None = None  # our trainer's (step, collective) at that verdict
        self._stopped_at: int | None = None  # the step at which we stopped our trainer on a hang verdict
        """(episode, incidents, when) of a verdict we reported and whose stall has not ended yet."""
        self.reporter = incident_reporter(spec)

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self, *, death_signal: Callable[..., int] | None = None, release_files: bool = True) -> int:
        """``release_files``: a forked observer lets go of the trainer's files; a spawned one inherited none, and
        what its callback's module opened at import is its own."""
        if death_signal is not None:
            _die_with_parent(death_signal)
        if release_files:
            _release_inherited_files(keep={0, 1, 2, self.ready_fd})
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we follow it out
        try:
            self.record = ProgressRecord(self.spec.record_path, owner=False)
            self.store = connect(self.spec.control, self._namespace(), self.spec.startup_timeout_s)
            self.proto = self._protocol(self.store)
            os.write(self.ready_fd, b"R")
            os.close(self.ready_fd)
            self._loop()
            return 0
        except _Stopped:
            self._see_trainer_out()
            with contextlib.suppress(Exception):
                self._end_record_of_stop()
            return OBSERVER_REPORTED_EXIT
        except _Closing:  # closed during start-up or while the store was away
            self._answer_closed()
            return 0
        except SystemExit:
            return 0
        except BaseException:
            self._report_own_failure(traceback.format_exc())
            return OBSERVER_REPORTED_EXIT
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
            if self._watch is not None and self.record is not None and self.record.read().phase is Phase.CLOSED:
                with contextlib.suppress(Exception):
                    self._closed_while_watching()  # resolved if a named rank moved first, else shutdown
            if self._trainer_gone() and self.record is not None:
                self.record.unlink()  # the trainer died without cleaning up

    def _protocol(self, store: Any) -> EpisodeProtocol:
        spec = self.spec
        return EpisodeProtocol(store, rank=spec.rank, peer_groups=spec.peer_groups, hosts=spec.hosts,
                               gather_timeout_s=spec.gather_timeout_s, heartbeat_s=spec.heartbeat_s,
                               secret=spec.control.secret)

    def _evidence(self, snap: ProgressSnapshot, silent_s: float, *, silent: bool, alive: bool) -> Evidence:
        """What we post for our rank, from one read of its record."""
        return Evidence(rank=self.spec.rank, step=snap.step, op_id=snap.op_id, phase=int(snap.phase),
                        pending=snap.pending, fp_hash=snap.fp_hash, fingerprint=snap.fingerprint,
                        silent_s=round(silent_s, 3), silent=silent, alive=alive, seq=snap.seq)

    def _namespace(self) -> str:
        return f"{self.spec.run_id}/{self.spec.launch}" if self.spec.launch else self.spec.run_id

    # -- the watch loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.record is not None and self.proto is not None
        while True:
            try:
                self._watch_once()
            except _Closing:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing now: a second SIGTERM changes nothing
                self._closed_while_watching()
                self._answer_closed()
                return
            except _ControlPlaneDown as down:
                if self._trainer_gone():
                    return  # the job is over (a launcher's store goes with it): nothing left to answer
                if self.record.read().phase is Phase.CLOSED:  # it closed meanwhile (its SIGTERM was deferred)
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    self._answer_closed()
                    return
                self._control_plane_lost(down.error)

    def _watch_once(self) -> None:
        """Watch until the trainer closes or dies; a control-store failure escapes as _ControlPlaneDown."""
        spec, proto, record = self.spec, self.proto, self.record
        assert proto is not None and record is not None
        diagnosed_seq = -1
        retry_at: float | None = None  # an episode was deferred on someone's I/O: try again from then
        silent_in: tuple[int, int] | None = None  # (episode, seq) in which our trainer was silent
        gone_until: float | None = None  # our trainer died without closing: answer for it until then
        gone_opened = False
        silent_at: tuple[int, int] = (-1, -1)  # where our trainer was when silent_in was set
        next_beat = next_daemon_beat = 0.0
        beats = 0
        with _store_errors():
            while True:
                gone = self._trainer_gone()
                snap = record.read()
                if snap.phase is Phase.CLOSED:
                    if silent_in is not None and snap.coordinate[:2] != silent_at:
                        # It moved on and closed within one look: progress resumed before the job ended.
                        proto.moved(silent_in[0])
                    raise _Closing
                now = time.monotonic()
                threshold = silence_threshold(spec, snap)
                silent_s = now - snap.t_publish
                if silent_in is not None and snap.seq != silent_in[1]:
                    proto.moved(silent_in[0])  # our trainer moved after a verdict: progress resumed
                    if self._watch is not None and self._watch[0] == silent_in[0]:
                        self._resolved()
                    silent_in = None
                if retry_at is not None and snap.seq != diagnosed_seq:
                    retry_at = None
                if spec.control.needs_beats and now >= next_daemon_beat:
                    next_daemon_beat = now + _DAEMON_BEAT_S
                    beats += 1  # a new value each time (a set, never a counter someone could poison)
                    key = daemon_key(BEAT_KEY)
                    self.store.underlying_store.set(key, seal(spec.control.secret, key, f"{spec.rank}.{beats}"))
                if gone and gone_until is None:
                    # Answer for the dead trainer until an episode names someone: its peers may only go silent
                    # later (on NCCL they wait in a collective; on gloo theirs fail at once).
                    gone_until = now + (max(threshold, spec.silence_threshold_s) + 2 * spec.gather_timeout_s
                                        if spec.world_size > 1 else 0.0)
                stalled = silent_s >= threshold and (snap.seq != diagnosed_seq
                                                     or (retry_at is not None and now >= retry_at))
                join = (gone and not gone_opened) or stalled
                if not join and now >= next_beat:
                    next_beat = now + spec.heartbeat_s
                    if self._watch is not None and proto.resumed(self._watch[0]):
                        self._resolved()
                    join = proto.opened()
                if join:
                    if (gone and not gone_opened) or stalled:
                        proto.open()
                        gone_opened = gone_opened or gone
                    mine = self._evidence(snap, silent_s, silent=silent_s >= threshold, alive=not gone)
                    episode = proto.episode
                    with self._critical_section():
                        outcome = proto.run(mine)
                        if mine.silent and outcome is not None:  # no verdict came (the reporter died): retry
                            diagnosed_seq = snap.seq
                            silent_in, silent_at = (episode, snap.seq), snap.coordinate[:2]
                            # Deferred on a rank's tolerated I/O: that rank opens the next episode when its
                            # tolerance ends, unless it leaves its I/O by closing: then we try again ourselves.
                            retry_at = time.monotonic() + spec.io_silence_s if outcome.deferred else None
                        if outcome is not None and outcome.verdicts and not outcome.repeat:
                            incidents = self._deliver(outcome, snap, threshold)
                            if outcome.reporter:
                                self._watch = (outcome.episode, incidents, time.monotonic())
                                self._watch_from = snap.coordinate[:2]
                    if gone and outcome is not None and outcome.verdicts:
                        raise SystemExit(0)  # we answered for our dead trainer, and a verdict came
                    continue
                if gone_until is not None and now >= gone_until:
                    raise SystemExit(0)  # nobody waited for our dead trainer (the job ended, or all crashed)
                # Until the publish would be threshold-old (capped: a dead trainer is noticed where PDEATHSIG is
                # unavailable); once past it (diagnosed, waiting for progress), at the heartbeat.
                wake = threshold - silent_s + 0.001 if silent_s < threshold else spec.heartbeat_s
                time.sleep(max(0.001, min(wake, spec.heartbeat_s, 1.0)))

    def _control_plane_lost(self, error: str) -> None:
        """The store is unreachable while our trainer lives. Wait a grace period first: a store a launcher
        serves goes with a job that is being torn down (a worker failed, the launcher exits and the
        trainers are terminated); only if our trainer outlives the grace is the store's machine reported
        lost, once per machine (by the observer of its lowest rank: no exchange is possible), and then the
        store is tried again."""
        spec = self.spec
        deadline = time.monotonic() + spec.gather_timeout_s + 2 * spec.heartbeat_s
        while time.monotonic() < deadline:
            if self._trainer_gone():
                return
            time.sleep(min(1.0, spec.heartbeat_s))
        with contextlib.suppress(Exception):
            self.store = connect(spec.control, self._namespace(), spec.gather_timeout_s)
            episode = self.proto.episode if self.proto is not None else 0
            self.proto = self._protocol(self.store)
            self.proto.episode = max(self.proto.episode, episode)  # never back to an episode already over
            return  # it is back
        self._report_control_plane_lost(error)
