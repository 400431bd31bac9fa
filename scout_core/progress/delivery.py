"""Verdict reporting for the observer: an episode's verdicts become incident records, the user's callback and,
with ``actions.on_verdict: stop``, the end of the trainer.

Mixed into the observer (:class:`VerdictReporting`): it uses the observer's spec,
record and reporter, and its ``_critical_section`` and trainer checks. A verdict
we reported is watched until its stall ends, which is written as a ``resolved``
record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from scout_core.actions import hang_action, stop_message, verdict_summary, write_launcher_error
from scout_core.progress.classify import HangVerdict
from scout_core.progress.episode import EpisodeOutcome
from scout_core.progress.record import Phase, ProgressRecord, ProgressSnapshot
from scout_core.progress.spec import ObserverSpec
from scout_core.progress.stacks import ANSWER_S, capture_stacks, main_thread_frames, stacks_path
from scout_core.report import STALL_KINDS, Incident, IncidentKind, IncidentScope, JsonlSink, LoggingSink, Reporter
from scout_core.run_log import RunLog

__all__ = ["VerdictReporting", "incident_reporter"]

_log = logging.getLogger("scout")
_STALLS = tuple(IncidentKind(k) for k in STALL_KINDS)
STACKS_MAX_RANKS = 8
"""A verdict naming more ranks (a whole peer group waiting in one collective) gets no stack files: they would all
show that collective, one file per rank of the group."""


def _wants_stacks(inc: Incident) -> bool:
    return inc.kind in _STALLS and 0 < len(inc.ranks) <= STACKS_MAX_RANKS


class _Stopped(Exception):
    """The observer stopped its trainer on a verdict: a deliberate end, not a failure."""


def incident_reporter(spec: ObserverSpec) -> Reporter:
    """The observer's reporter: the log, and the incident file where one is configured."""
    sinks: list[Any] = [LoggingSink(spec.log_level)]
    if spec.jsonl_path:
        sinks.append(JsonlSink(spec.jsonl_path, fsync=spec.fsync))
    return Reporter(sinks, run_id=spec.run_id, rank=spec.rank)


class VerdictReporting:
    """The observer's reporting half: what it writes and calls once an episode has a verdict, and after."""

    # Provided by the observer this is mixed into.
    spec: ObserverSpec
    record: ProgressRecord | None
    reporter: Reporter
    _watch: tuple[int, list[Incident], float] | None
    _watch_from: tuple[int, int] | None
    _stopped_at: int | None
    proto: Any
    _plane_reported: bool
    _critical_section: Callable[..., contextlib.AbstractContextManager[None]]
    _trainer_gone: Callable[[], bool]
    _trainer_closing: Callable[[], bool]

    def _live_settings(self) -> bool:
        """Apply what the trainer changed live (``scout ctl set``) since our start; whether to stop on a verdict."""
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
        act = hang_action(self.spec.exclusions_path, self.spec.on_incident)
        for inc in incidents:
            try:
                act(inc)
            except Exception:  # a user callback must not kill the observer
                traceback.print_exc()
        # A verdict over values someone outside the job wrote names nobody and never stops a trainer.
        steered = any("tampered" in v.evidence for v in outcome.verdicts)
        if not steered and any(self.spec.rank in inc.ranks for inc in incidents if _wants_stacks(inc)):
            # After the callbacks (every observer runs them at once; a frozen trainer's dump waits its 2 s), before
            # a stop ends the trainer: peers stopping theirs wait for the file.
            self._save_stacks(outcome.episode)
        if stop_on_verdict and incidents and not steered:
            # The named ranks' stacks first: a launcher ends every worker once one of them ends.
            self._await_stacks(incidents)
            if not self._trainer_gone() and not self._trainer_closing():  # a closing trainer is ending already
                if self.spec.launcher_error_file:  # torchrun's summary names the verdict, not a SIGTERM
                    write_launcher_error(stop_message([verdict_summary(i) for i in incidents], how="SIGTERM",
                                                      records=self.spec.jsonl_path), self.spec.launcher_error_file)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.spec.trainer_pid, signal.SIGTERM)
                self._stopped_at = snap.step  # for the end record, once the trainer is out (observer.run)
            # Stopped, also when our trainer is already gone (a launcher ended it after a peer's stop): no episode
            # answers for it after a stop. Out of the critical section: _see_trainer_out answers its close.
            raise _Stopped
        return incidents

    def _end_record_of_stop(self) -> None:
        """Rank 0's observer writes the run's end record after a hang stop, once its trainer is out: such trainers
        end by a signal, without close(); one that closed (its SIGTERM handler exits) wrote its own."""
        closed = self.record is not None and self.record.read().phase is Phase.CLOSED
        if self.spec.rank == 0 and self._stopped_at is not None and not closed:
            RunLog(self.spec.jsonl_path, rank=0, run_id=self.spec.run_id, fsync=self.spec.fsync).ended_by_stop(
                "stopped on a hang verdict", self._stopped_at)

    def _await_stacks(self, incidents: list[Incident]) -> None:
        """Until the named ranks' stack files are written (their observers write them before stopping their own
        trainers), at most a dump's answer time and a little more."""
        paths = [p for inc in incidents if _wants_stacks(inc) for p in inc.evidence.get("stack_files", {}).values()]
        deadline = time.monotonic() + ANSWER_S + 1.0
        while paths and time.monotonic() < deadline:
            paths = [p for p in paths if not os.path.exists(p)]
            if paths:
                time.sleep(0.05)

    def _save_stacks(self, episode: int) -> None:
        """A verdict names our rank: its trainer's stacks into the file the incident names (and the innermost
        frames of its main thread into the log)."""
        spec = self.spec
        if spec.trainer_stacks is None or self._trainer_gone():
            return
        fd, sig, main_thread = spec.trainer_stacks
        dump = capture_stacks(spec.trainer_pid, fd, sig)
        frames = main_thread_frames(dump, main_thread)
        _log.warning("SCOUT: rank %d's training thread at the verdict of episode %d: %s", spec.rank, episode,
                     " <- ".join(frames) if frames else dump.strip().splitlines()[0] if dump.strip() else "(empty)")
        if spec.jsonl_path:
            path = stacks_path(spec.jsonl_path, spec.run_id, spec.launch, episode, spec.rank)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(f"{path}.tmp", "w") as fh:  # whole when it appears: peers wait for it to exist
                    fh.write(dump)
                os.replace(f"{path}.tmp", path)
            except OSError as exc:
                _log.warning("SCOUT: rank %d's stacks not written to %s: %s", spec.rank, path, exc)

    def _resolved(self) -> None:
        """Write the follow-up of the verdict we reported: progress resumed (or the job closed normally)."""
        if self._watch is None:
            return
        self._live_settings()  # logged at the level the trainer set last
        with self._critical_section():  # a closing trainer's SIGTERM must not cut these records short
            self._emit_resolved()

    def _closed_while_watching(self) -> None:
        """Our trainer closed while a verdict we reported was watched: ``resolved`` when progress resumed first (a
        rank silent at the verdict moved again, or our own trainer got past where it was at the verdict: the stall
        ended and training went on), else ``shutdown``: the job ended with the verdict standing (Ctrl-C, a
        launcher's stop, an exception), which is no sign the stall ended."""
        if self._watch is None:
            return
        try:
            moved = self.proto is not None and self.proto.resumed(self._watch[0])
        except Exception:  # noqa: BLE001 - the store is gone with the job: nothing says anyone moved
            moved = False
        if not moved and self.record is not None and self._watch_from is not None:
            with contextlib.suppress(Exception):
                moved = self.record.read().coordinate[:2] != self._watch_from
        if moved:
            self._resolved()
            return
        self._live_settings()
        with self._critical_section():
            self._emit_follow_up(IncidentKind.SHUTDOWN, "the job ended while episode {episode}'s verdict stood; no "
                                 "progress was seen after it ({reason})")

    def _emit_resolved(self) -> None:
        self._emit_follow_up(IncidentKind.RESOLVED, "progress resumed after episode {episode}'s verdict ({reason})")

    def _emit_follow_up(self, kind: IncidentKind, reason: str) -> None:
        """The record that ends the watch of the verdict we reported (``reason`` formatted with the episode and the
        verdict's own reason), one per incident of that verdict."""
        assert self._watch is not None
        (episode, incidents, t_verdict), self._watch = self._watch, None
        for inc in incidents:
            self.reporter.emit(Incident(
                kind=kind, scope=inc.scope, ranks=list(inc.ranks), hosts=list(inc.hosts),
                devices=list(inc.devices), step=inc.step,
                evidence={"episode": episode, "verdict": inc.kind.value, "class": inc.evidence.get("class"),
                          "after_s": round(time.monotonic() - t_verdict, 3)},
                reason=reason.format(episode=episode, reason=inc.reason),
            ))

    def _stack_files(self, v: HangVerdict, episode: int) -> dict[str, Any]:
        """Where each named rank's observer writes its trainer's stacks (the same path on every observer): for the
        verdicts :meth:`_save_stacks` answers, of ranks whose trainer and observer are there to answer."""
        spec = self.spec
        if (not spec.jsonl_path or spec.trainer_stacks is None or IncidentKind(v.kind) not in _STALLS
                or not 0 < len(v.ranks) <= STACKS_MAX_RANKS or "tampered" in v.evidence
                or v.hang_class.value in ("lost", "exited")):
            return {}
        return {"stack_files": {str(r): stacks_path(spec.jsonl_path, spec.run_id, spec.launch, episode, r)
                                for r in v.ranks}}

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
                      **self._stack_files(v, episode),
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

    def _report_control_plane_lost(self, error: str) -> None:
        """Name the control store's machine lost, once per machine: by the observer of its lowest rank (no exchange
        is possible)."""
        spec = self.spec
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
                evidence={"class": "control_plane_lost", "error": error,
                          "control": {k: v for k, v in spec.control.to_dict().items() if k != "secret"}},
            ))


def _values(facts: Any) -> list[Any]:
    """A per-member fact list, or the distinct values (most frequent first) of a large group's summary."""
    if isinstance(facts, dict):
        return [value for value, _count in facts.get("distinct", [])]
    return list(facts or [])
