"""The checkpoint coordinator: replay verdicts in, snapshots, replicas and decisions out.

At every replay boundary each rank calls :meth:`CheckpointCoordinator.on_boundary`
with its local evidence. ONE all-reduce (MAX over six flags) combines SDC,
inconclusive, missing and straggler evidence across the job and checks that
every rank agrees whether this check closes a recipe cycle; disagreement
raises. The job-wide evidence then drives the :class:`~.certify.Certifier`,
identically on every rank.

In-memory slots live in RAM-backed files (``/dev/shm``): they survive the
trainer process, so a restarted job can resume from ``latest``, and each rank's
snapshot is also replicated to a partner on another machine when one exists.
Candidates and verified generations go to the :class:`~.store.DurableStore`.
Every retrieval decision is written as a JSON line beside the incident records.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier, FailureKind, decide_retrieval
from scout_core.checkpoint.snapshot import SnapshotEngine
from scout_core.checkpoint.store import DurableStore, _atomic_write, agree_on_generation

__all__ = ["CheckpointCoordinator", "agree_on_latest", "load_latest", "memory_dir_for", "partners", "record_decision"]


def memory_dir_for(run_id: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return os.path.join(base, f"scout-ckpt-{run_id}")


def partners(hosts: Mapping[int, str]) -> dict[int, int]:
    """rank -> the rank that keeps its replica: same local index on the next machine.

    Works for any world size and uneven machines (indices wrap). On a single
    machine the partner is the next rank, which covers process loss only.
    """
    by_host: dict[str, list[int]] = {}
    for r in sorted(hosts):
        by_host.setdefault(hosts[r], []).append(r)
    names = sorted(by_host)
    out = {}
    if len(names) == 1:
        ranks = by_host[names[0]]
        return {r: ranks[(i + 1) % len(ranks)] for i, r in enumerate(ranks)} if len(ranks) > 1 else {}
    for h, name in enumerate(names):
        nxt = by_host[names[(h + 1) % len(names)]]
        for i, r in enumerate(by_host[name]):
            out[r] = nxt[i % len(nxt)]
    return out


def _to_bytes(snap: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(snap, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


class CheckpointCoordinator:
    def __init__(
        self,
        engine: SnapshotEngine,
        store: DurableStore,
        certifier: Certifier,
        *,
        run_id: str,
        hosts: Mapping[int, str],
        replicate: bool = True,
        decisions_path: str | None = None,
        keep_generations: int = 3,
    ) -> None:
        self.engine = engine
        self.store = store
        self.certifier = certifier
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.memory_dir = memory_dir_for(run_id)
        os.makedirs(self.memory_dir, mode=0o700, exist_ok=True)
        self.partner_of = partners(hosts) if replicate else {}
        self.sources = sorted(r for r, p in self.partner_of.items() if p == self.rank)
        # A separate gloo group so replication on the background thread never interleaves with
        # the training thread's collectives.
        self.repl_group = dist.new_group(backend="gloo") if self.partner_of else None
        self.decisions_path = decisions_path
        self.keep = keep_generations
        self._bg: threading.Thread | None = None
        self._bg_error: BaseException | None = None

    # -- paths ---------------------------------------------------------------------------------

    def _slot(self, owner: int, which: str) -> str:
        return os.path.join(self.memory_dir, f"rank-{owner:05d}-{which}.pt")

    # -- at every replay boundary --------------------------------------------------------------

    def on_boundary(self, step: int, local: BoundaryEvidence) -> Action:
        at_boundary = self.certifier.at_cycle_boundary
        flags = torch.tensor([local.sdc, local.inconclusive, local.missing, local.straggler,
                              at_boundary, not at_boundary], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the one collective of the job-wide agreement
        if flags[4] and flags[5]:
            raise RuntimeError(f"step {step}: ranks disagree whether this check closes a recipe cycle "
                               f"(rank {self.rank} says {at_boundary})")
        evidence = BoundaryEvidence(*(bool(f) for f in flags[:4].tolist()))
        promoted_before = self.certifier.verified
        action = self.certifier.on_boundary(step, evidence)
        if action in (Action.CAPTURE, Action.CAPTURE_AND_PERSIST):
            self._join_background()
            self.engine.capture(step)
            persist_role = None
            if action is Action.CAPTURE_AND_PERSIST:
                persist_role = "verified" if self.certifier.static else "candidate"
            promoted = self.certifier.verified if self.certifier.verified != promoted_before else None
            self._bg = threading.Thread(target=self._background, args=(step, persist_role, promoted), daemon=True)
            self._bg.start()
        return action

    def _background(self, step: int, persist_role: str | None, promoted: int | None) -> None:
        try:
            snap = self.engine.result()
            data = _to_bytes(snap)
            cur = self._slot(self.rank, "current")
            if os.path.exists(cur):
                os.replace(cur, self._slot(self.rank, "previous"))
            _atomic_write(cur, data)
            if self.repl_group is not None:
                self._replicate(data)
            if persist_role is not None:
                self.store.write(step, snap, role=persist_role)
            if promoted is not None and promoted != step:
                self.store.set_role(promoted, "verified")
            if persist_role is not None:
                keep = {g for g in (self.certifier.candidate, self.certifier.verified, step) if g is not None}
                if len(keep) < self.keep:
                    keep |= set(sorted(self.store.local_generations(check_bytes=False))[-self.keep:])
                self.store.prune(keep)
        except BaseException as exc:
            self._bg_error = exc

    def _replicate(self, data: bytes) -> None:
        """Send our snapshot to our partner; receive those we keep. Sizes first, then bytes."""
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        dst = self.partner_of[self.rank]
        incoming = {s: torch.zeros(1, dtype=torch.int64) for s in self.sources}
        works = [dist.isend(size, dst, group=self.repl_group)]
        works += [dist.irecv(t, s, group=self.repl_group) for s, t in incoming.items()]
        for w in works:
            w.wait()
        bufs = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in incoming.items()}
        works = [dist.isend(payload, dst, group=self.repl_group)]
        works += [dist.irecv(b, s, group=self.repl_group) for s, b in bufs.items()]
        for w in works:
            w.wait()
        for s, b in bufs.items():
            cur = self._slot(s, "replica-current")
            if os.path.exists(cur):
                os.replace(cur, self._slot(s, "replica-previous"))
            _atomic_write(cur, b.numpy().tobytes())

    def _join_background(self) -> None:
        if self._bg is not None:
            self._bg.join()
            self._bg = None
        if self._bg_error is not None:
            err, self._bg_error = self._bg_error, None
            raise RuntimeError("checkpoint persistence failed") from err

    def flush(self) -> None:
        """Wait for the capture, replication and persistence in flight."""
        self._join_background()

    # -- recovery ------------------------------------------------------------------------------

    def decide(self, failure: FailureKind | str, *, sweep: Callable[[], bool] | None = None,
               incident: dict[str, Any] | None = None) -> Any:
        """Retrieval decision (identical on every rank); rank 0 writes it as a JSON line."""
        self._join_background()
        decision = decide_retrieval(self.certifier, FailureKind(failure), sweep=sweep)
        if self.decisions_path and self.rank == 0:
            record_decision(self.decisions_path, decision, certifier=self.certifier, incident=incident)
        return decision


def record_decision(path: str, decision: Any, *, certifier: Certifier | None = None,
                    incident: dict[str, Any] | None = None) -> dict[str, Any]:
    """Append a retrieval decision as one fsync'ed JSON line beside the incident records."""
    record = {"time_unix": time.time(), **asdict(decision), "incident": incident or {}}
    if certifier is not None:
        record["certifier"] = {"latest": certifier.latest, "candidate": certifier.candidate,
                               "verified": certifier.verified}
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return record


def _slot_paths(run_id: str, rank: int) -> list[str]:
    directory = memory_dir_for(run_id)
    return [os.path.join(directory, f"rank-{rank:05d}-{which}.pt")
            for which in ("current", "previous", "replica-current", "replica-previous")]


def _read_slot(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            return _from_bytes(fh.read())
    except (FileNotFoundError, RuntimeError, EOFError):
        return None  # absent, or never completed (its writer was stopped mid-way)


def latest_steps(run_id: str, rank: int) -> list[int]:
    """Steps of the in-memory snapshots available for ``rank`` (own slots, then the partner's replicas)."""
    steps = []
    for path in _slot_paths(run_id, rank):
        snap = _read_slot(path)
        if snap is not None:
            steps.append(int(snap["step"]))
    return sorted(set(steps))


def load_latest(run_id: str, rank: int, step: int | None = None) -> dict[str, Any]:
    """This rank's in-memory snapshot of ``step`` (default: its newest).

    Looks at the rank's own slots first, then at the replica its partner keeps
    (on another machine in production; there the launcher's restore path moves
    the file, here both live in one tmpfs).
    """
    best = None
    for path in _slot_paths(run_id, rank):
        snap = _read_slot(path)
        if snap is None:
            continue
        if step is not None and int(snap["step"]) == step:
            return snap
        if step is None and (best is None or snap["step"] > best["step"]):
            best = snap
    if best is None:
        raise FileNotFoundError(f"rank {rank}: no in-memory snapshot{'' if step is None else f' of step {step}'} "
                                f"in {memory_dir_for(run_id)}")
    return best


def agree_on_latest(run_id: str, group: Any = None) -> int | None:
    """The newest step for which every rank holds an in-memory snapshot (one all-gather)."""
    mine = latest_steps(run_id, dist.get_rank())
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    common = set(everyone[0])
    for steps in everyone[1:]:
        common &= set(steps)
    return max(common) if common else None


def verified_generation(store: DurableStore, group: Any = None) -> int | None:
    return agree_on_generation(store, "verified", group)

