"""The checkpoint coordinator: replay verdicts in, snapshots, replicas and decisions out.

At every replay boundary each rank calls :meth:`CheckpointCoordinator.on_boundary`
with its local evidence. ONE all-reduce (MAX over nine flags, on SCOUT's gloo
control group) combines SDC, inconclusive, missing, straggler and busy evidence
across the job, says whether some rank's parameters are not finite, whether some rank
could not make the candidate or the newest verified generation durable, and whether
every rank's replay coverage is complete. The job-wide evidence then drives the
:class:`~.certify.Certifier`, identically on every rank: a verified generation is
offered to a restart only once every rank has confirmed its write (the evidence alone
promotes, and labels the framework's checkpoints).

In-memory snapshots live in a RAM-backed directory (``/dev/shm``), one folder
per machine, so they survive the trainer process and a restarted job can
resume from ``latest``. Each rank keeps ONE slot of its own (the newest
capture) and one replica slot for each rank whose partner it is, on another
machine when there is one: at rest two copies of its state, written by
streaming (no serialized copy in memory) and replaced by atomic rename.
Candidates and verified generations go to the :class:`~.store.DurableStore`.
Every retrieval decision is written as a JSON line beside the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier, FailureKind, decide_retrieval
from scout_core.checkpoint.memory import MemorySlots, partners
from scout_core.checkpoint.snapshot import SnapshotEngine, UnusableSnapshot
from scout_core.checkpoint.store import DurableStore
from scout_core.progress.hooks import unobserved
from scout_core.run_log import read_json_objects

__all__ = ["CheckpointCoordinator", "combine_evidence", "partners", "record_decision"]

_log = logging.getLogger("scout")


def combine_evidence(local: BoundaryEvidence, group: Any) -> BoundaryEvidence:
    """Job-wide evidence: one MAX all-reduce of the flags on ``group`` (gloo). ``covered`` is combined as AND
    (every rank's coverage complete): its negation goes through the MAX."""
    flags = torch.tensor([local.sdc, local.inconclusive, local.missing, local.straggler, local.busy,
                          local.lost_candidate, local.lost_verified, local.nonfinite, not local.covered],
                         dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    *eight, uncovered = (bool(f) for f in flags.tolist())
    return BoundaryEvidence(*eight, covered=not uncovered)


def _in_background(work: Callable[[], None]) -> None:
    """``work`` on a background thread of SCOUT's: at the lowest CPU priority for this thread only (serialization,
    hashing and replication use host cores the training threads would otherwise get; Linux schedules threads by
    their own nice value), and unobserved (SCOUT's own traffic is not the trainer's progress)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    with unobserved():
        work()


class CheckpointCoordinator:
    def __init__(
        self,
        engine: SnapshotEngine,
        store: DurableStore,
        certifier: Certifier,
        *,
        memory: MemorySlots,
        control_group: Any = None,
        replicate: bool = True,
        decisions_path: str | None = None,
        keep_generations: int = 3,
        on_error: Callable[[BaseException, str], None] | None = None,
        extra_later: bool = False,
    ) -> None:
        self.engine = engine
        self.store = store
        self.certifier = certifier
        self.memory = memory
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.control = control_group
        self.partner_of = partners(memory.hosts) if replicate else {}
        self.sources = sorted(r for r, p in self.partner_of.items() if p == self.rank)
        # A separate gloo group so replication on the background thread never interleaves with
        # the training thread's collectives.
        self.repl_group = dist.new_group(backend="gloo") if self.partner_of else None
        self.decisions_path = decisions_path
        self.keep = keep_generations
        self._space_checked = False
        self.on_error = on_error
        self.extra_later = extra_later  # the caller's state is added at the end of the step (engine.complete_extra)
        self._bg: threading.Thread | None = None
        self._bg_error: BaseException | None = None
        self._lock = threading.Lock()  # _bg_error, _failed and _news are written by the background thread
        # The durability agreement: generations this rank could not write or relabel (-> why), those failures
        # not reported yet, and the generations asked to become verified whose durability is not yet agreed
        # (the same on every rank).
        self._failed: dict[int, str] = {}
        self._news: list[tuple[int, str]] = []
        self._promoting: set[int] = set()

    # -- at every replay boundary --------------------------------------------------------------

    def on_boundary(self, step: int, local: BoundaryEvidence) -> tuple[Action, BoundaryEvidence]:
        """Combine the evidence job-wide, advance the certifier, capture what it asks for."""
        busy = self.busy  # first: a thread found finished has recorded every failure _lost() reads
        local = dataclasses.replace(local, busy=busy, **self._lost())
        evidence = combine_evidence(local, self.control)
        self._settle_durability(step, evidence)
        return self.apply(step, evidence), evidence

    @property
    def busy(self) -> bool:
        """The previous capture is still being written or replicated in the background."""
        return self._bg is not None and self._bg.is_alive()

    def apply(self, step: int, evidence: BoundaryEvidence) -> Action:
        """Advance the certifier (identically on every rank) and start what it asks for.

        A local failure (no space, a copy that raised, persistence that failed last time) is
        reported through ``on_error`` and never raised: the background thread still takes part in
        the replica exchange, so partners never wait for a snapshot that will not come.
        """
        promoted_before = self.certifier.verified
        if evidence.busy and self.certifier.verified in self._promoting:
            # The last promotion is not agreed durable yet (that needs a boundary where nobody writes): promoting
            # again now would leave it unconfirmed, and a failure of the new one would fall back past it.
            evidence = dataclasses.replace(evidence, covered=False)
        action = self.certifier.on_boundary(step, evidence)
        if action in (Action.CAPTURE, Action.CAPTURE_AND_PERSIST):
            self._join_background()
            captured = self._guarded("snapshot capture", lambda: self._capture(step))
            persist_role = None
            if action is Action.CAPTURE_AND_PERSIST:
                persist_role = "verified" if self.certifier.static else "candidate"
            cert = self.certifier
            promoted = cert.verified if cert.verified != promoted_before else None
            if promoted in cert.unstored:  # some rank does not hold it: not relabelled, never confirmed
                promoted = None
            if promoted is not None:
                self._promoting.add(promoted)
            # What pruning keeps, whatever else is old: the generations the certifier names and those in flight.
            protect = {g for g in (cert.durable, cert.verified, cert.candidate, step) if g is not None}
            self._bg = threading.Thread(target=self._background, daemon=True, name="scout-snapshot",
                                        args=(step, captured, persist_role, promoted, protect | self._promoting))
            self._bg.start()
        elif action is Action.PROMOTE and self.certifier.verified not in self.certifier.unstored:
            # A write is in flight: the label follows it, on a thread of its own that stays "busy" until done, so
            # the durability agreement waits for the label as for any write.
            promoted = self.certifier.verified
            self._promoting.add(promoted)
            self._bg = threading.Thread(target=self._label_after, daemon=True, name="scout-snapshot",
                                        args=(self._bg, promoted))
            self._bg.start()
        return action

    def _label_after(self, previous: threading.Thread | None, promoted: int) -> None:
        if previous is not None:
            previous.join()
        with self._lock:
            if promoted in self._failed:  # its write failed here (reported): the agreement marks it unstored
                return
        _in_background(lambda: self._durably(promoted, "label it verified",
                                             lambda: self.store.set_role(promoted, "verified")))

    def _capture(self, step: int) -> bool:
        if not self._space_checked:
            self._space_checked = True
            # At the peak a slot exists twice (the previous one is deleted only once the new one is complete:
            # a crash mid-write must leave a whole slot behind): the own slot while it is written, then each
            # replica while it is written (the old own slot is gone by then).
            replicas = len(self.sources)
            self.memory.ensure_space(self.engine.state_bytes(), copies=max(2 + replicas, 1 + 2 * replicas))
        self.engine.capture(step, extra_later=self.extra_later)
        return True

    def _guarded(self, where: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            if self.on_error is None:
                raise
            self.on_error(exc, where)
            return None

    def _background(self, step: int, captured: bool, persist_role: str | None, promoted: int | None,
                    protect: set[int]) -> None:
        _in_background(lambda: self._persist(step, captured, persist_role, promoted, protect))

    def _keep_error(self, exc: BaseException) -> None:
        with self._lock:  # surfaced on the training thread at the next boundary
            self._bg_error = exc

    def _persist(self, step: int, captured: bool, persist_role: str | None, promoted: int | None,
                 protect: set[int]) -> None:
        path, missing, report = None, "its capture failed", True
        try:
            if captured:
                path = self.memory.write_own(self.engine.result())
        except UnusableSnapshot as exc:  # the caller-state check reported it already
            missing, report = str(exc), False
        except BaseException as exc:  # noqa: BLE001 - surfaced on the training thread at the next boundary
            self._keep_error(exc)
            missing = f"its in-memory snapshot could not be written ({type(exc).__name__}: {exc})"
        finally:
            self.engine.release()  # the state is in the slot now: one host copy less from here on
        try:
            if self.repl_group is not None:
                self._replicate(path, step)  # always: a partner waits for our size, even "nothing"
        except BaseException as exc:  # noqa: BLE001
            self._keep_error(exc)
        if persist_role is None:
            return
        if promoted is not None and promoted != step:
            self._durably(promoted, "label it verified", lambda: self.store.set_role(promoted, "verified"))
        if path is None:
            self._fail(step, f"nothing to write: {missing}", report=report)
        else:  # the slot's bytes, not a re-serialization
            self._durably(step, "write it", lambda: self.store.write_file(step, path, role=persist_role))
        try:
            self._prune(protect)
        except BaseException as exc:  # noqa: BLE001
            self._keep_error(exc)

    def _durably(self, generation: int, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - kept for the next agreement: no rank promotes it
            self._fail(generation, f"could not {what} ({type(exc).__name__}: {exc})")

    def _fail(self, generation: int, why: str, *, report: bool = True) -> None:
        with self._lock:
            self._failed[generation] = why
            if report:
                self._news.append((generation, why))

    def _prune(self, protect: set[int]) -> None:
        """Keep the generations the certifier names (the durable verified one, which a restart is sure to find,
        the verified one, the candidate) and those in flight; with fewer than ``keep_generations``, the newest
        ones too. Everything else goes: a dropped candidate, a generation some rank could not write."""
        keep = set(protect)
        if len(keep) < self.keep:
            keep |= set(sorted(self.store.local_generations(check_bytes=False))[-self.keep:])
        self.store.prune(keep)

    # -- the durability agreement (rides on the boundary's all-reduce) -----------------------------

    def _lost(self) -> dict[str, bool]:
        """This rank's part: did its write of the candidate, or its write or relabelling of the verified
        generation not yet agreed durable, fail?"""
        cert = self.certifier
        with self._lock:
            failed = set(self._failed)
        return {"lost_candidate": cert.candidate in failed,
                "lost_verified": cert.verified in self._promoting and cert.verified in failed}

    def _settle_durability(self, step: int, evidence: BoundaryEvidence) -> None:
        """The same on every rank: a generation some rank could not make durable is never offered to a restart;
        once no rank is still writing, the verified generation no rank failed to write and label is durable."""
        cert = self.certifier
        for generation, lost in ((cert.candidate, evidence.lost_candidate), (cert.verified, evidence.lost_verified)):
            if lost and generation is not None:
                cert.not_durable(step, generation, "some rank could not make it durable (its diagnosis_error "
                                                   "record says which and why)")
                self._promoting.discard(generation)
        if not evidence.busy:  # every rank's writes are finished: what nobody reported failed is durable
            if cert.verified in self._promoting:
                cert.confirm(step, cert.verified)  # never one marked unstored
            self._promoting.clear()
            with self._lock:
                self._failed.clear()
        self._report_failures()

    def _report_failures(self) -> None:
        """One diagnosis_error record for each generation this rank could not write or relabel."""
        with self._lock:
            news, self._news = self._news, []
        for generation, why in news:
            exc = RuntimeError(f"rank {self.rank} could not make generation {generation} durable: {why}; a restart "
                               f"is never offered it (verified generation {self.certifier.durable}, durable on "
                               "every rank, is kept)")
            if self.on_error is None:
                _log.warning("SCOUT: %s", exc)
            else:
                self.on_error(exc, "durable store")

    def _replicate(self, path: str | None, step: int) -> None:
        """Send our slot to our partner; receive those we keep. (size, step) first, then the bytes;
        size -1 says this rank has no slot this time (its capture failed)."""
        size = os.path.getsize(path) if path is not None else -1
        payload = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if path else None
        dst = self.partner_of[self.rank]
        incoming = {s: torch.zeros(2, dtype=torch.int64) for s in self.sources}
        works = [dist.isend(torch.tensor([size, step], dtype=torch.int64), dst, group=self.repl_group)]
        works += [dist.irecv(t, s, group=self.repl_group) for s, t in incoming.items()]
        for w in works:
            w.wait()
        bufs: dict[int, torch.Tensor] = {}
        for s, t in incoming.items():
            if int(t[0]) >= 0:
                with contextlib.suppress(RuntimeError, MemoryError):  # no room: say so, the sender skips
                    bufs[s] = torch.empty(int(t[0]), dtype=torch.uint8)
        # Each receiver tells its source whether it can take the bytes before they are sent: a sender
        # never blocks (until the gloo timeout) on a partner that could not allocate the buffer.
        ready = torch.zeros(1, dtype=torch.int64)
        works = [dist.isend(torch.tensor([1 if s in bufs else 0], dtype=torch.int64), s, group=self.repl_group)
                 for s in incoming]
        works.append(dist.irecv(ready, dst, group=self.repl_group))
        for w in works:
            w.wait()
        send = payload is not None and int(ready) == 1
        works = [dist.isend(payload, dst, group=self.repl_group)] if send else []
        works += [dist.irecv(b, s, group=self.repl_group) for s, b in bufs.items()]
        for w in works:
            w.wait()
        if payload is not None and not send:
            _log.warning("rank %d: partner %d could not take the replica of step %d", self.rank, dst, step)
        del payload
        for s in list(bufs):
            self.memory.write_replica(s, int(incoming[s][1]), bufs.pop(s))

    def _join_background(self, timeout_s: float | None = None) -> None:
        if self._bg is not None:
            self._bg.join(timeout_s)
            if self._bg.is_alive():  # only with a timeout: a daemon thread the exiting process abandons
                _log.warning("rank %d: snapshot persistence still running after %.0f s; not waiting for it",
                             self.rank, timeout_s)
                return
            self._bg = None
        self._report_failures()
        with self._lock:
            err, self._bg_error = self._bg_error, None
        if err is not None:
            exc = RuntimeError(f"checkpoint snapshot or persistence failed: {err}")
            exc.__cause__ = err
            if self.on_error is None:
                raise exc
            self.on_error(exc, "snapshot persistence")

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the capture, replication and persistence in flight (at most ``timeout_s``)."""
        self._join_background(timeout_s)

    # -- recovery ------------------------------------------------------------------------------

    def decide(self, failure: FailureKind | str, *, sweep: Callable[[], bool] | None = None,
               incident: dict[str, Any] | None = None, binding: bool = True) -> Any:
        """Retrieval decision (identical on every rank); rank 0 writes it as a JSON line.

        ``binding``: the job stops now and the restart must follow this decision. A decision taken
        while training goes on (``actions.on_verdict: log``) is kept for the operator only.
        """
        decision = decide_retrieval(self.certifier, FailureKind(failure), sweep=sweep)
        if self.decisions_path and self.rank == 0:
            record_decision(self.decisions_path, decision, certifier=self.certifier, incident=incident,
                            binding=binding)
        return decision


def record_decision(path: str, decision: Any, *, certifier: Certifier | None = None,
                    incident: dict[str, Any] | None = None, kind: str = "decision",
                    binding: bool = True) -> dict[str, Any]:
    """Append a retrieval decision (or a resume record) as one fsync'ed JSON line."""
    body = asdict(decision) if not isinstance(decision, Mapping) else dict(decision)
    record = {"record": kind, "time_unix": time.time(), **body, "incident": incident or {}, "binding": binding}
    if certifier is not None:
        record["certifier"] = {"latest": certifier.latest, "candidate": certifier.candidate,
                               "verified": certifier.verified, "steps_capture_to_verified": certifier.verified_after}
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return record


def read_records(path: str) -> list[dict[str, Any]]:
    """Every decision and resume record, oldest first (a torn last line, or a line that is not a JSON object,
    is ignored)."""
    return read_json_objects(path)
