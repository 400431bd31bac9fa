"""The out-of-band observer: one CPU process per rank (paper section 7).

The observer is forked from its trainer by :func:`start_observer`, so it starts
in milliseconds with everything it needs already imported, and from then on
runs on its own interpreter and GIL: a trainer blocked in a collective, in a
kernel or in ``SIGSTOP`` cannot block it.

While the job is healthy it sends nothing. It sleeps until the last published
progress would be ``silence_threshold_s`` old, re-reads the record, and goes
back to sleep if the trainer moved. Only when the silence has outlasted the
threshold does it post its evidence to the observers' own control store (a
``TCPStore`` rendezvoused separately from every training process group, hosted
by rank 0's observer) and wait for its peers' evidence. Every observer then
runs the same :func:`~scout_core.progress.classify.classify` on the same
evidence; one designated observer writes the incident records, and each runs
the user's callback, even though the trainers stay blocked.

Episodes are numbered in the store so that observers entering a stall at
different moments meet in the same round; the reporter advances the number
after a verdict, and an observer only re-enters once its trainer has moved.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from scout_core.progress.classify import Evidence, HangVerdict, classify
from scout_core.progress.record import ProgressRecord, pid_alive
from scout_core.report import Incident, IncidentKind, IncidentScope, JsonlSink, LoggingSink, Reporter

__all__ = ["ObserverSpec", "start_observer", "OBSERVER_REPORTED_EXIT"]

OBSERVER_REPORTED_EXIT = 3
"""Exit code of an observer that crashed and already reported its own failure."""

_PR_SET_PDEATHSIG = 1


@dataclass(kw_only=True)
class ObserverSpec:
    run_id: str
    rank: int
    world_size: int
    record_path: str
    store_host: str
    store_port: int
    peer_groups: list[list[int]]
    hosts: dict[int, str]
    devices: dict[int, str]
    silence_threshold_s: float
    first_step_silence_s: float = 300.0
    gather_timeout_s: float
    startup_timeout_s: float
    jsonl_path: str | None
    fsync: bool = True
    log_level: str = "WARNING"
    on_incident: Callable[[Incident], None] | None = None
    trainer_pid: int = field(default_factory=os.getpid)
    poll_s: float = 0.05
    """Store polling interval while gathering (only during a stall)."""
    stop_on_verdict: bool = False
    """``actions.on_verdict: stop``: after a hang verdict every observer terminates its trainer."""


class _Stopped(Exception):
    """The observer stopped its trainer on a verdict: a deliberate end, not a failure."""


def start_observer(spec: ObserverSpec) -> tuple[int, int]:
    """Fork the observer; return ``(pid, read end of its readiness pipe)``."""
    read_fd, write_fd = os.pipe()
    # Linux's parent-death signal follows the forking THREAD, not the process: forked from a thread that
    # later exits (enable() called from a set-up thread), the observer would be killed while its trainer
    # lives on. Only the main thread lives as long as the process; elsewhere the loop's liveness check of
    # the trainer (at least once a second) is what ends the observer.
    death_signal = threading.current_thread() is threading.main_thread()
    pid = os.fork()
    if pid == 0:  # observer process: never returns
        os.close(read_fd)
        code = 0
        try:
            code = _Observer(spec, write_fd).run(death_signal=death_signal)
        except SystemExit:
            code = 0  # SIGTERM from a trainer that exited: a normal end
        except BaseException:  # noqa: BLE001 - last resort: never let the observer die silently
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    return pid, read_fd


class _Observer:
    def __init__(self, spec: ObserverSpec, ready_fd: int) -> None:
        self.spec = spec
        self.ready_fd = ready_fd
        self.record: ProgressRecord | None = None
        self.store: Any = None
        sinks: list[Any] = [LoggingSink(spec.log_level)]
        if spec.jsonl_path:
            sinks.append(JsonlSink(spec.jsonl_path, fsync=spec.fsync))
        self.reporter = Reporter(sinks, run_id=spec.run_id, rank=spec.rank)

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self, *, death_signal: bool = True) -> int:
        if death_signal:
            _die_with_parent()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we follow it out
        try:
            self.record = ProgressRecord(self.spec.record_path, owner=False)
            self.store = self._connect()
            os.write(self.ready_fd, b"R")
            os.close(self.ready_fd)
            self._loop()
            return 0
        except _Stopped:
            return OBSERVER_REPORTED_EXIT
        except SystemExit:
            return 0
        except BaseException:
            self._report_own_failure(traceback.format_exc())
            return OBSERVER_REPORTED_EXIT
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
            if self._trainer_gone() and self.record is not None:
                self.record.unlink()  # the trainer died without cleaning up

    def _trainer_gone(self) -> bool:
        """The trainer (our parent: it forked us) has exited or is exiting.

        Linux reparents us before it delivers the parent-death signal, while the trainer may not be a zombie
        yet: asking only whether its pid is alive raced with that signal and left its record behind."""
        return os.getppid() != self.spec.trainer_pid or not pid_alive(self.spec.trainer_pid)

    def _connect(self) -> Any:
        from torch.distributed import TCPStore

        is_server = self.spec.rank == 0
        store = TCPStore(
            self.spec.store_host, self.spec.store_port, self.spec.world_size, is_server,
            timeout=timedelta(seconds=self.spec.startup_timeout_s), wait_for_workers=False,
        )
        if is_server:
            store.set(self._key("episode"), "0")
        return store

    def _key(self, *parts: Any) -> str:
        return "/".join(["scout", self.spec.run_id, *map(str, parts)])

    # -- the watch loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.record is not None
        diagnosed_seq = -1
        while True:
            if self._trainer_gone():
                return
            snap = self.record.read()
            threshold = self.spec.silence_threshold_s
            # Lazy init, compilation and communicator set-up make the first step of a (re)started job long.
            # The trainer publishes step 0 until its first step completes, a resumed one too (see
            # ProgressTracker.resume_at), so step 0 is the warm-up, however the observer samples.
            if snap.step == 0:
                threshold = max(threshold, self.spec.first_step_silence_s)
            silent = time.monotonic() - snap.t_publish
            if silent < threshold:
                # Sleep until this publish would be threshold-old; cap it so a dead
                # trainer is noticed even where PDEATHSIG is unavailable.
                time.sleep(min(threshold - silent + 0.001, 1.0))
                continue
            if snap.seq == diagnosed_seq:
                time.sleep(min(threshold, 1.0))  # same stall, already diagnosed
                continue
            if self._episode(snap):
                diagnosed_seq = snap.seq

    def _episode(self, snap: Any) -> bool:
        """One round of evidence exchange; False when the round has to be retried."""
        spec = self.spec
        episode = int(self.store.get(self._key("episode")))
        mine = Evidence(rank=spec.rank, step=snap.step, op_id=snap.op_id, phase=int(snap.phase),
                        pending=snap.pending, fp_hash=snap.fp_hash, fingerprint=snap.fingerprint,
                        silent_s=round(time.monotonic() - snap.t_publish, 3))
        self.store.set(self._key("ep", episode, spec.rank), json.dumps(mine.to_dict()))
        deadline = time.monotonic() + spec.gather_timeout_s
        keys = {r: self._key("ep", episode, r) for r in range(spec.world_size)}
        complete = False
        while time.monotonic() < deadline:
            if self.store.check(list(keys.values())):
                complete = True
                break
            if self.record.read().seq != snap.seq:
                return False  # our trainer moved: this was a slow step, not a hang
            time.sleep(spec.poll_s)
        if not complete and int(self.store.get(self._key("episode"))) != episode:
            return False  # we arrived after this episode's verdict; rejoin at the next one
        present = {r: k for r, k in keys.items() if self.store.check([k])}
        evidence = {r: Evidence.from_dict(json.loads(self.store.get(k))) for r, k in present.items()}
        verdicts = classify(evidence, spec.peer_groups)
        reporter_rank = min(evidence)
        t_verdict = time.monotonic()
        incidents = [self._incident(v, snap, t_verdict, episode) for v in verdicts]
        if spec.rank == reporter_rank:
            for inc in incidents:
                self.reporter.emit(inc)
            self.store.compare_set(self._key("episode"), str(episode), str(episode + 1))
        if spec.on_incident is not None:
            for inc in incidents:
                try:
                    spec.on_incident(inc)
                except Exception:  # a user callback must not kill the observer
                    traceback.print_exc()
        if spec.stop_on_verdict and incidents:
            self._stop_trainer(episode, len(present))
        return True

    def _stop_trainer(self, episode: int, n_present: int) -> None:
        """Terminate our trainer once every observer of this episode has its verdict.

        Each observer counts itself in, then waits (bounded) for the others, so rank 0's
        observer, which serves the store, never leaves while a peer still reads from it.
        """
        spec = self.spec
        key = self._key("stopping", episode)
        with contextlib.suppress(Exception):  # the store may go once everyone counted in
            self.store.add(key, 1)
            deadline = time.monotonic() + spec.gather_timeout_s
            while time.monotonic() < deadline and int(self.store.add(key, 0)) < n_present:
                time.sleep(spec.poll_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(spec.trainer_pid, signal.SIGTERM)
        raise _Stopped

    def _incident(self, v: HangVerdict, snap: Any, t_verdict: float, episode: int) -> Incident:
        spec = self.spec
        stall_s = t_verdict - snap.t_publish
        return Incident(
            kind=IncidentKind(v.kind), scope=IncidentScope(v.scope), ranks=list(v.ranks),
            hosts=[spec.hosts.get(r, "?") for r in v.ranks], devices=[spec.devices.get(r, "?") for r in v.ranks],
            step=snap.step, surface=v.evidence.get("fingerprints", [""])[0] if v.scope == "peer_group" else "",
            evidence={"class": v.hang_class.value, "peer_group": list(v.peer_group), "episode": episode,
                      "stall_s": round(stall_s, 3), "threshold_s": spec.silence_threshold_s, **v.evidence},
            time_to_verdict_s=round(max(0.0, stall_s - spec.silence_threshold_s), 3),
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


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the trainer exits (the loop also checks)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def peer_groups_as_lists(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(map(int, g)) for g in groups]
