"""The out-of-band observer: one CPU process per rank (paper section 7).

The observer is forked from its trainer by :func:`start_observer`, so it starts
in milliseconds with everything it needs already imported, and from then on
runs on its own interpreter and GIL: a trainer blocked in a collective, in a
kernel or in ``SIGSTOP`` cannot block it. Fork safety: the child touches none
of the trainer's threads, locks, CUDA or communicators. It only maps the
progress record, opens its own client socket to the control store and writes
files; ``logging`` re-initialises its locks at fork (CPython's at-fork hooks),
and nothing else it uses holds a lock another thread of the trainer could have
held (``tests/test_observer_fork.py`` forks while other threads hold them).

While the job is healthy it sends one ``check`` per heartbeat to the control
store (:mod:`scout_core.progress.control`), which no rank serves. When its
trainer has been silent longer than the silence threshold, it opens an
episode; every observer then posts its rank's state, working or not, and
:class:`~scout_core.progress.episode.EpisodeProtocol` turns the evidence into
one verdict. The reporter writes the records, every observer runs the user's
callback, even though the trainers stay blocked, and once a stopped rank moves
again the reporter writes a ``resolved`` record.

The silence threshold adapts to the job: never below
``observer.silence_threshold_s``, at least ``observer.adaptive_multiple`` times
the longest healthy interval between two progress marks seen after the
warm-up (the first two steps, which tolerate ``first_step_silence_s``), and at
least ``io_silence_s`` while the rank is in a data-loader or checkpoint phase
(a long save on every rank is not a hang; a rank stuck in one while its peers
wait is still named, by the peers' observers).

A trainer that exits without :meth:`~scout_core.handle.ScoutHandle.close` is
answered for by its observer (``alive: false``) in one last episode, so the
peers of a crashed or killed rank learn who is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from scout_core.progress.classify import Evidence, HangVerdict
from scout_core.progress.control import BEAT_KEY, CLOSED_KEY, ControlPlane, connect, daemon_key
from scout_core.progress.episode import CLOSED_LIST, EpisodeOutcome, EpisodeProtocol
from scout_core.progress.record import Phase, ProgressRecord, ProgressSnapshot, pid_alive
from scout_core.report import Incident, IncidentKind, IncidentScope, JsonlSink, LoggingSink, Reporter

__all__ = ["OBSERVER_REPORTED_EXIT", "OBSERVER_STACKS_SIGNAL", "ObserverSpec", "start_observer"]

OBSERVER_REPORTED_EXIT = 3
"""Exit code of an observer that crashed and already reported its own failure."""

_PR_SET_PDEATHSIG = 1
OBSERVER_STACKS_SIGNAL = signal.SIGUSR1
"""Makes an observer print every thread's Python stack to stderr (a trainer whose observer does not start)."""


@dataclass(kw_only=True)
class ObserverSpec:
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
    trainer_pid: int = field(default_factory=os.getpid)
    heartbeat_s: float = 1.0
    """How often a healthy observer checks whether an episode is open (one store message)."""
    stop_on_verdict: bool = False
    """``actions.on_verdict: stop``: after a hang verdict every observer terminates its trainer."""


class _Stopped(Exception):
    """The observer stopped its trainer on a verdict: a deliberate end, not a failure."""


class _Closing(BaseException):
    """The trainer closed SCOUT (published CLOSED, then SIGTERM). A BaseException: it is raised from a signal
    handler anywhere, and no ``except Exception`` on the way (a user callback's guard) may swallow it."""


class _ControlPlaneDown(Exception):
    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """Store and network failures (the store's machine died, or the job ended and took it) as one type."""
    from torch.distributed import DistError

    try:
        yield
    except (DistError, OSError) as exc:
        raise _ControlPlaneDown(f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc


_IO_PHASES = (Phase.DATALOADER, Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE)
_CHECKPOINT_PHASES = (Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE)
_DAEMON_BEAT_S = 10.0
_CLOSING_STORE_TIMEOUT_S = 2.0
STOP_GRACE_S = 20.0
"""After a hang verdict with ``actions.on_verdict: stop``, how long a trainer has to end on SIGTERM before its
observer kills it. A Python SIGTERM handler runs only when the main thread gets back to the interpreter, which a
trainer blocked inside a collective never does; a framework's handler may only set a flag it reads between
iterations (Megatron's ``--exit-signal-handler``)."""


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


def start_observer(spec: ObserverSpec) -> tuple[int, int]:
    """Fork the observer; return ``(pid, read end of its readiness pipe)``."""
    read_fd, write_fd = os.pipe()
    # Linux's parent-death signal follows the forking THREAD, not the process: forked from a thread that
    # later exits (enable() called from a set-up thread), the observer would be killed while its trainer
    # lives on. Only the main thread lives as long as the process; elsewhere the loop's liveness check of
    # the trainer (at least once a second) is what ends the observer.
    death_signal = threading.current_thread() is threading.main_thread()
    # Looked up here, before the fork: the forked child of a threaded trainer does as little as it can (a symbol
    # lookup there is one thing less that could meet a lock another trainer thread held at the fork).
    prctl = _prctl() if death_signal else None
    # The stacks signal is blocked until the child has its handler: its default action would end the child.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {OBSERVER_STACKS_SIGNAL})
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    if pid == 0:  # observer process: never returns
        os.close(read_fd)
        code = 0
        try:
            # A trainer kept waiting for us asks where we are; written to fd 2 itself (sys.stderr may be no file,
            # or a buffered writer whose lock another trainer thread held at the fork).
            with contextlib.suppress(Exception):
                faulthandler.register(OBSERVER_STACKS_SIGNAL, file=2, all_threads=True)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            code = _Observer(spec, write_fd).run(death_signal=prctl)
        except SystemExit:
            code = 0  # SIGTERM from a trainer that closed: a normal end
        except BaseException:  # noqa: BLE001 - last resort: never let the observer die silently
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(write_fd)
    return pid, read_fd


class _Observer:
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
        """(episode, incidents, when) of a verdict we reported and whose stall has not ended yet."""
        sinks: list[Any] = [LoggingSink(spec.log_level)]
        if spec.jsonl_path:
            sinks.append(JsonlSink(spec.jsonl_path, fsync=spec.fsync))
        self.reporter = Reporter(sinks, run_id=spec.run_id, rank=spec.rank)

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self, *, death_signal: Callable[..., int] | None = None) -> int:
        if death_signal is not None:
            _die_with_parent(death_signal)
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
                    self._resolved()  # the trainer went on to close normally: the stall ended
            if self._trainer_gone() and self.record is not None:
                self.record.unlink()  # the trainer died without cleaning up

    @contextlib.contextmanager
    def _critical_section(self, *, closing: bool = False) -> Iterator[None]:
        """An episode or the delivery of its records: a closing trainer's SIGTERM waits until it ends, and the
        trainer's close() sees (one byte of the record) that it must wait for us rather than kill us.
        ``closing``: our closing messages; the byte stays set until we exit."""
        self._critical = True
        if self.record is not None:
            self.record.set_observer_busy(True)
        try:
            yield
        finally:
            self._critical = False
            if self.record is not None and not closing:
                self.record.set_observer_busy(False)
            pending, self._close_pending = self._close_pending, False  # moot if we leave by an exception
        if pending:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing now: a second SIGTERM changes nothing
            raise _Closing

    def _protocol(self, store: Any) -> EpisodeProtocol:
        spec = self.spec
        return EpisodeProtocol(store, rank=spec.rank, peer_groups=spec.peer_groups, hosts=spec.hosts,
                               gather_timeout_s=spec.gather_timeout_s, heartbeat_s=spec.heartbeat_s)

    def _evidence(self, snap: ProgressSnapshot, silent_s: float, *, silent: bool, alive: bool) -> Evidence:
        """What we post for our rank, from one read of its record."""
        return Evidence(rank=self.spec.rank, step=snap.step, op_id=snap.op_id, phase=int(snap.phase),
                        pending=snap.pending, fp_hash=snap.fp_hash, fingerprint=snap.fingerprint,
                        silent_s=round(silent_s, 3), silent=silent, alive=alive, seq=snap.seq)

    def _namespace(self) -> str:
        return f"{self.spec.run_id}/{self.spec.launch}" if self.spec.launch else self.spec.run_id

    def _on_sigterm(self, *_: Any) -> None:
        # The trainer's close() publishes CLOSED, then terminates us: we still answer an open episode (a
        # trainer that closes after its collective failed is gone for its waiting peers, not lost). The
        # parent-death signal is SIGTERM too: a trainer that died without closing gets one last episode
        # (the loop answers for it), so that signal must not end us; any other SIGTERM (a launcher tearing
        # the job down) does.
        closed = self.record is not None and self.record.read().phase is Phase.CLOSED
        if closed:
            if self._critical:
                self._close_pending = True  # finish the episode and the callbacks first (close() waits)
                return
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing now: a second SIGTERM changes nothing
            raise _Closing
        if self._trainer_gone():
            return
        sys.exit(0)

    def _answer_closed(self) -> None:
        """Our trainer closed: mark it closed (a leader counts a closed member as gone, not lost), answer an
        open episode that it is gone, and count it out with a store daemon (which exits once every rank
        has). Over our own connection (the trainer's close() waits for us, briefly); a fresh one only if
        that fails (the signal may have interrupted it mid-message). Never raises."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt these messages
        with self._critical_section(closing=True):  # close() waits for these too
            for attempt in range(2):
                try:
                    self._closed_messages(self.store if attempt == 0 else
                                          connect(self.spec.control, self._namespace(), _CLOSING_STORE_TIMEOUT_S))
                    return
                except Exception:  # noqa: BLE001 - best effort; the store may be gone with the job
                    continue

    def _closed_messages(self, store: Any) -> None:
        spec = self.spec
        if store is None:
            raise RuntimeError("no store")
        # Short waits: an unreachable store must not hold the trainer's close() (it waits while we are busy).
        store.set_timeout(timedelta(seconds=_CLOSING_STORE_TIMEOUT_S))
        # Counted once, even if a first attempt was cut off after this message: the daemon exits at world size.
        if int(store.add(f"closed/{spec.rank}", 1)) == 1:
            store.append(CLOSED_LIST, f"{spec.rank},")
            if spec.control.needs_beats:
                store.underlying_store.add(daemon_key(CLOSED_KEY), 1)
        if self.record is None or not store.check([f"ep/{self.proto.episode if self.proto else 0}/open"]):
            return
        proto = self._protocol(store)
        proto.episode = self.proto.episode if self.proto else proto.episode
        snap = self.record.read()
        proto.post(self._evidence(snap, time.monotonic() - snap.t_publish, silent=True, alive=False))

    def _trainer_gone(self) -> bool:
        """The trainer (our parent: it forked us) has exited or is exiting.

        Linux reparents us before it delivers the parent-death signal, while the trainer may not be a zombie
        yet: asking only whether its pid is alive raced with that signal and left its record behind."""
        return os.getppid() != self.spec.trainer_pid or not pid_alive(self.spec.trainer_pid)

    # -- the watch loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.record is not None and self.proto is not None
        while True:
            try:
                self._watch_once()
            except _Closing:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing now: a second SIGTERM changes nothing
                self._resolved()
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
        next_beat = next_daemon_beat = 0.0
        with _store_errors():
            while True:
                gone = self._trainer_gone()
                snap = record.read()
                if snap.phase is Phase.CLOSED:
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
                    self.store.underlying_store.add(daemon_key(BEAT_KEY), 1)
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
                            silent_in = (episode, snap.seq)
                            # Deferred on a rank's tolerated I/O: that rank opens the next episode when its
                            # tolerance ends, unless it leaves its I/O by closing: then we try again ourselves.
                            retry_at = time.monotonic() + spec.io_silence_s if outcome.deferred else None
                        if outcome is not None and outcome.verdicts and not outcome.repeat:
                            incidents = self._deliver(outcome, snap, threshold)
                            if outcome.reporter:
                                self._watch = (outcome.episode, incidents, time.monotonic())
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
        """The store is unreachable while our trainer lives. Wait a grace period first: under torchrun the
        agent's store goes with a job that is being torn down (a worker failed, the agent exits and the
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
            self.proto = self._protocol(self.store)
            return  # it is back
        mine = spec.hosts.get(spec.rank)
        first_here = min((r for r, h in spec.hosts.items() if h == mine), default=spec.rank) == spec.rank
        if not self._plane_reported and first_here:
            self._plane_reported = True
            host = spec.control.host
            ranks = sorted(r for r, h in spec.hosts.items() if h == host)
            self.reporter.emit(Incident(
                kind=IncidentKind.HANG, scope=IncidentScope.MACHINE, ranks=ranks, hosts=[host] * max(1, len(ranks)),
                devices=[spec.devices.get(r, "?") for r in ranks],
                reason=f"the observers' control store at {host}:{spec.control.port} ({spec.control.kind}) has been "
                       f"unreachable from {mine} for {spec.gather_timeout_s:.0f} s while the trainers there run: "
                       f"its machine is probably lost ({error})",
                evidence={"class": "control_plane_lost", "control": spec.control.to_dict(), "error": error},
            ))

    def _live_settings(self) -> bool:
        """Apply what the trainer changed live (``scout ctl set``) since our fork; whether to stop on a verdict."""
        on_verdict, level = self.record.live() if self.record is not None else (None, None)
        if level is not None:
            for sink in self.reporter.sinks:
                if isinstance(sink, LoggingSink):
                    sink.level = level
        return self.spec.stop_on_verdict if on_verdict is None else on_verdict == "stop"

    def _deliver(self, outcome: EpisodeOutcome, snap: ProgressSnapshot, threshold: float) -> list[Incident]:
        stop_on_verdict = self._live_settings()
        t_verdict = time.monotonic()
        incidents = [self._incident(v, snap, t_verdict, outcome.episode, threshold) for v in outcome.verdicts]
        if outcome.reporter:
            for inc in incidents:
                self.reporter.emit(inc)
        if self.spec.on_incident is not None:
            for inc in incidents:
                try:
                    self.spec.on_incident(inc)
                except Exception:  # a user callback must not kill the observer
                    traceback.print_exc()
        if stop_on_verdict and incidents and not self._trainer_gone():
            if not self._trainer_closing():  # a trainer closing SCOUT is ending already: its close is not cut short
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.spec.trainer_pid, signal.SIGTERM)
            raise _Stopped  # out of the critical section: the trainer's close, now or later, is answered (below)
        return incidents

    def _trainer_closing(self) -> bool:
        return self.record is not None and self.record.read().phase is Phase.CLOSED

    def _see_trainer_out(self) -> None:
        """After the stop's SIGTERM: wait for the trainer to end, and SIGKILL it if it is still there after
        :data:`STOP_GRACE_S`. A trainer closing SCOUT (a handler that exits, or a close already under way) is
        answered as any close is (its close waits for that answer), never killed. Whatever interrupts the wait (a
        launcher's SIGTERM) still ends a trainer that is left."""
        start = time.monotonic()
        try:
            while not self._trainer_gone():
                if self._trainer_closing():
                    self._answer_closed()
                    return
                if time.monotonic() - start > STOP_GRACE_S:
                    self._kill_trainer()
                    return
                time.sleep(0.1)
        except _Closing:
            self._answer_closed()
        except BaseException:
            if not self._trainer_gone():
                self._kill_trainer()
            raise

    def _kill_trainer(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.spec.trainer_pid, signal.SIGKILL)
        gone_by = time.monotonic() + 2.0  # a large process takes a moment to die: then its record can go
        while not self._trainer_gone() and time.monotonic() < gone_by:
            time.sleep(0.05)

    def _resolved(self) -> None:
        """Write the follow-up of the verdict we reported: progress resumed (or the job closed normally)."""
        if self._watch is None:
            return
        self._live_settings()  # logged at the level the trainer set last
        with self._critical_section():  # a closing trainer's SIGTERM must not cut these records short
            self._emit_resolved()

    def _emit_resolved(self) -> None:
        assert self._watch is not None
        (episode, incidents, t_verdict), self._watch = self._watch, None
        for inc in incidents:
            self.reporter.emit(Incident(
                kind=IncidentKind.RESOLVED, scope=inc.scope, ranks=list(inc.ranks), hosts=list(inc.hosts),
                devices=list(inc.devices), step=inc.step,
                evidence={"episode": episode, "verdict": inc.kind.value, "class": inc.evidence.get("class"),
                          "after_s": round(time.monotonic() - t_verdict, 3)},
                reason=f"progress resumed after episode {episode}'s verdict ({inc.reason})",
            ))

    def _incident(self, v: HangVerdict, snap: Any, t_verdict: float, episode: int, threshold: float) -> Incident:
        spec = self.spec
        # The stall is the named ranks' silence (the reporter itself may have been working).
        stall_s = max(_values(v.evidence.get("silent_s")) or [t_verdict - snap.t_publish])
        return Incident(
            kind=IncidentKind(v.kind), scope=IncidentScope(v.scope), ranks=list(v.ranks),
            hosts=[spec.hosts.get(r, "?") for r in v.ranks], devices=[spec.devices.get(r, "?") for r in v.ranks],
            step=snap.step,
            surface=(_values(v.evidence.get("fingerprints")) or [""])[0] if v.scope == "peer_group" else "",
            evidence={"class": v.hang_class.value, "peer_group": list(v.peer_group), "episode": episode,
                      "control_plane": spec.control.kind,
                      "stall_s": round(stall_s, 3), "threshold_s": round(threshold, 3), **v.evidence},
            time_to_verdict_s=round(max(0.0, stall_s - threshold), 3),
            reason=v.reason,
        )

    def _report_own_failure(self, tb: str) -> None:
        with contextlib.suppress(Exception):
            self.reporter.emit(Incident(
                kind=IncidentKind.OBSERVER_FAILURE, scope=IncidentScope.RANK, ranks=[self.spec.rank],
                hosts=[self.spec.hosts.get(self.spec.rank, socket.gethostname())],
                devices=[self.spec.devices.get(self.spec.rank, "?")],
                reason=f"observer of rank {self.spec.rank} failed: {tb.strip().splitlines()[-1]}",
                evidence={"traceback": tb, "observer_pid": os.getpid()},
            ))


def _values(facts: Any) -> list[Any]:
    """A per-member fact list, or the distinct values (most frequent first) of a large group's summary."""
    if isinstance(facts, dict):
        return [value for value, _count in facts.get("distinct", [])]
    return list(facts or [])


def _release_inherited_files(keep: set[int]) -> None:
    """Point every file descriptor inherited from the trainer, but ``keep``, at /dev/null.

    Its communicator sockets above all: held open here they would keep a dead trainer's connections alive
    (its gloo peers would wait instead of failing) and pin its files. Not closed: Python objects inherited
    from the trainer still hold those numbers, and one finalized later would close whatever file of ours
    had reused its number (the store's socket, the incident log)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: the low numbers, where a process's files are
        fds = list(range(3, 4096))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd in keep or fd == null:
            continue
        with contextlib.suppress(OSError):
            os.fstat(fd)
            os.dup2(null, fd)
    os.close(null)


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up in the trainer before the observer is forked (see :func:`start_observer`)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:  # noqa: BLE001 - no libc prctl: the loop's liveness check still ends the observer
        return None


def _die_with_parent(prctl: Callable[..., int]) -> None:
    """Ask Linux to SIGTERM us when the trainer exits (the loop also checks). ``prctl`` was looked up before the
    fork."""
    with contextlib.suppress(Exception):
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def peer_groups_as_lists(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(map(int, g)) for g in groups]
