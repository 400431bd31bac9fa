"""The restart path (paper section 8, CheckpointRetrieval): one call at start-up, on every rank.

:meth:`Restarter.resume` runs right after ``enable()`` in a (re)started job:

1. reads the last record of ``decisions.jsonl``: a retrieval decision taken by
   the previous run at a verdict, or nothing (the job died on a hang or crash);
2. takes inventory of the in-memory slots on every rank (own snapshots and the
   replicas kept for partners) and votes on ``latest``: the newest step for
   which every rank's snapshot exists somewhere; votes on ``verified`` in the
   durable store (the newest generation every rank holds intact);
3. without a recorded decision, decides now: ``machine_unreachable`` when some
   rank's own snapshot is gone (its machine was replaced), else ``other`` with
   the emergency sweep: the latest state is restored and every layer is
   replayed on the newest saved calls across peers, and every expert on every
   shape of the MoE shape catalog (``extra_sweeps``); latest only if clean (a
   dirty sweep puts the state back as it was before it);
4. loads the chosen generation: from memory where every rank can get it (a rank
   whose machine was lost receives its shard from the partner keeping its
   replica, over SCOUT's gloo group), else from the durable store;
5. restores model, optimizer, RNG, caller state and SCOUT's own schedule
   bitwise, deletes every in-memory snapshot newer than what it restored (they
   hold state judged unsafe: a second restart must not find them as latest),
   and appends a ``resume`` record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scout_core.checkpoint.certify import Certifier, FailureKind, decide_retrieval
from scout_core.checkpoint.coordinator import CheckpointCoordinator, read_records, record_decision
from scout_core.checkpoint.store import agree_on_generation

__all__ = ["ResumeResult", "Restarter", "drop_newer", "vote_latest"]

_log = logging.getLogger("scout")


@dataclass
class ResumeResult:
    """What :meth:`Restarter.resume` did (identical on every rank except ``fetched``)."""

    step: int | None
    """The restored step (the last optimizer step contained in the state), or None: nothing to resume."""
    source: str = "none"
    """``latest`` or ``verified``, or ``none`` on a fresh start."""
    reason: str = ""
    from_memory: bool = False
    fetched: bool = False
    """This rank's shard came from its partner's replica (its own machine lost it)."""
    decision: dict[str, Any] = field(default_factory=dict)

    @property
    def next_step(self) -> int:
        """The step the training loop continues with (0 on a fresh start)."""
        return 0 if self.step is None else self.step


def _binding(record: dict[str, Any] | None, latest: int | None) -> bool:
    """A recorded decision binds the restart when the run stopped on it and nothing newer was captured."""
    if not record or record.get("record", "decision") != "decision" or not record.get("binding", True):
        return False
    decided_at = (record.get("certifier") or {}).get("latest")
    return latest is None or decided_at is None or latest <= decided_at


def vote_latest(inventories: list[dict[str, Any]]) -> tuple[int | None, dict[int, int]]:
    """Newest step whose snapshot exists for EVERY rank (own slot or a partner's replica), and for each
    rank without its own copy the rank that holds its replica. Pure."""
    steps = {inv["own"] for inv in inventories if inv["own"] is not None}
    steps |= {s for inv in inventories for s in inv["replicas"].values()}
    for step in sorted(steps, reverse=True):
        fetch: dict[int, int] = {}
        for r, inv in enumerate(inventories):
            if inv["own"] == step:
                continue
            holder = next((h for h, other in enumerate(inventories) if other["replicas"].get(r) == step), None)
            if holder is None:
                break
            fetch[r] = holder
        else:
            return step, fetch
    return None, {}


def _worst(a: str, b: str) -> str:
    """Two sweep outcomes combined: SDC anywhere is dirty; else a part that could not run leaves it failed."""
    return next(o for o in ("dirty", "failed", "clean") if o in (a, b))


class Restarter:
    """The product's restart path over the coordinator's memory slots and durable store."""

    def __init__(self, coordinator: CheckpointCoordinator, *, control_group: Any, engine: Any = None,
                 restore: Any, after_restore: Any = None, current: Any = None,
                 extra_sweeps: Sequence[Callable[[int], str]] = ()) -> None:
        self.coord = coordinator
        # More of the catalog for the emergency sweep (the experts' shapes): callable(step) -> "clean",
        # "dirty" or "failed", the same on every rank.
        self.extra_sweeps = list(extra_sweeps)
        self.current = current  # callable() -> the state as it is now (a snapshot dict), to undo a dirty sweep
        self.group = control_group
        self.replay = engine
        self.restore = restore  # callable(snapshot dict): model, optimizer, RNG, caller state
        self.after_restore = after_restore  # callable(snapshot dict, certifier state) on every rank
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def _broadcast(self, value: Any) -> Any:
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def resume(self, failure: str | None = None) -> ResumeResult:
        coord = self.coord
        path = coord.decisions_path
        last = self._broadcast((read_records(path) or [None])[-1] if path else None)
        inventories: list[Any] = [None] * self.world
        dist.all_gather_object(inventories, coord.memory.inventory(), group=self.group)
        latest, fetch = vote_latest(inventories)
        verified = agree_on_generation(coord.store, "verified", group=self.group)
        stale = latest is not None and verified is not None and latest < verified
        if stale:
            # In-memory snapshots older than the verified checkpoint come from an earlier run on these
            # machines (a /dev/shm or disk fallback that outlived it): never roll back to them.
            _log.warning("SCOUT resume: in-memory snapshots of step %d are older than verified generation %d: "
                         "ignored and deleted", latest, verified)
            coord.memory.drop_newer(-1, coord.sources)
            latest, fetch = None, {}
        self._sweep_failed = False
        recorded = last if _binding(last, latest) else None
        if recorded is not None:
            decision = dict(recorded)
        else:
            if latest is None and verified is None:
                return ResumeResult(step=None, reason="no snapshot or verified checkpoint: fresh start")
            # A machine was lost when some rank has no snapshot of its own left at all. A rank whose own
            # slot is merely older (killed while writing the newest) fetches it, but nothing was lost.
            lost = any(inv["own"] is None for inv in inventories)
            kind = FailureKind(failure) if failure else (
                FailureKind.MACHINE_UNREACHABLE if lost else FailureKind.OTHER)
            certifier = Certifier(latest=latest, verified=verified)
            sweep = (lambda: self._sweep(latest, fetch)) if kind is FailureKind.OTHER and latest is not None else None
            d = decide_retrieval(certifier, kind, sweep=sweep)
            reason = d.reason
            if self._sweep_failed:  # not SDC: the sweep could not run (a diagnosis_error record says why)
                reason = ("the emergency sweep could not run on every rank, so the latest state is not proven "
                          "clean: restoring verified")
            decision = {"record": "decision", "source": d.source, "generation": d.generation, "reason": reason,
                        "failure": d.failure, "sweep_clean": d.sweep_clean, "sweep_failed": self._sweep_failed}
            if path and self.rank == 0:
                record_decision(path, {k: v for k, v in decision.items() if k != "record"}, certifier=certifier)
        gen, source, reason = decision["generation"], decision["source"], decision["reason"]
        if source == "latest" and gen != latest:
            reason += f"; latest generation {gen} is not held for every rank: using verified {verified}"
            source, gen = "verified", verified
        if source == "verified" and gen != verified:
            reason += f"; verified generation {gen} is not intact on every rank: using {verified}"
            gen = verified
        if gen is None:  # e.g. SDC before anything was certified: nothing SCOUT holds is safe to load
            reason += f"; no {source} generation is held by every rank: nothing restored"
            self._drop_newer(-1, keep_verified=True)  # a partial verified generation stays for forensics
            _log.error("SCOUT resume: %s. The model keeps the state it had before resume() (a fresh "
                       "initialization unless you loaded one); the unsafe snapshots were deleted.", reason)
            if path and self.rank == 0:
                record_decision(path, {"source": "none", "generation": None, "reason": reason}, kind="resume")
            return ResumeResult(step=None, reason=reason, decision=decision)
        from_memory = gen == latest
        snap = self._load(gen, fetch if from_memory else {})
        self.restore(snap)
        if self.after_restore is not None:
            self.after_restore(snap, {"latest": gen, "verified": verified if verified is not None else None})
        # Whatever is newer than what was restored is unsafe (the state judged bad) or partial (a verified
        # generation intact on every rank would have been the vote): a later restart, after training has
        # reached those step numbers again, must never mix such a shard with new ones.
        self._drop_newer(gen)
        result = ResumeResult(step=gen, source=source, reason=reason, from_memory=from_memory,
                              fetched=from_memory and self.rank in fetch, decision=decision)
        if path and self.rank == 0:
            record_decision(path, {"source": source, "generation": gen, "reason": reason,
                                   "from_memory": from_memory, "fetched_for": sorted(fetch) if from_memory else []},
                            kind="resume")
        dist.barrier(group=self.group)
        return result

    def _load(self, gen: int, fetch: dict[int, int]) -> dict[str, Any]:
        """This rank's snapshot of ``gen``: own slot, a partner's replica sent over the group, or the store."""
        coord = self.coord
        own = coord.memory.inventory()["own"] == gen
        if not fetch and not own:
            return coord.store.load(gen)
        received = self._exchange_replicas(gen, fetch)
        if received is not None:
            import io

            return torch.load(io.BytesIO(memoryview(received.numpy())), weights_only=True)
        return coord.memory.load("own", self.rank, gen)

    def _exchange_replicas(self, gen: int, fetch: dict[int, int]) -> torch.Tensor | None:
        """Holders send the replicas that lost ranks need (size, then bytes); returns ours if we needed one.

        Every rank walks the pairs in the same order, so the earliest unfinished pair always has both
        of its ranks waiting on it: no deadlock, whatever the pairing.
        """
        mine = None
        for r, holder in sorted(fetch.items()):
            if self.rank == holder:
                payload = self.coord.memory.raw("replica", r, gen)
                dist.send(torch.tensor([payload.numel()], dtype=torch.int64), r, group=self.group)
                dist.send(payload, r, group=self.group)
            elif self.rank == r:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, holder, group=self.group)
                mine = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(mine, holder, group=self.group)
        return mine

    def _drop_newer(self, step: int, *, keep_verified: bool = False) -> None:
        drop_newer(self.coord, step, rank=self.rank, keep_verified=keep_verified)

    def _sweep(self, latest: int, fetch: dict[int, int]) -> bool:
        """Restore the latest state and replay every layer on its saved calls; clean on every rank.

        A dirty sweep puts back the state the model had before it (what the user built or loaded before
        ``resume()``), so suspect weights never stay loaded, whatever is restored next."""
        before = self.current() if self.current is not None else None
        schedule = self.replay.sweep_state() if self.replay is not None else None
        snap = self._load(latest, fetch)
        self.restore(snap)
        outcome = "clean"
        if self.replay is not None:
            self.replay.load_sweep_state(snap["extra"].get("scout", {"step": latest, "checks": 0}))
            outcome = self.replay.sweep()  # the same on every rank: its agreements are job-wide
        for extra in self.extra_sweeps:  # every part runs, so a dirty one is recorded whatever the others say
            outcome = _worst(outcome, extra(latest))
        self._sweep_failed = outcome == "failed"
        flag = torch.tensor([1 if outcome == "clean" else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        clean = bool(flag.item())
        if not clean:
            if before is not None:
                self.restore(before)
            if schedule is not None:
                self.replay.load_sweep_state(schedule)
        return clean


def drop_newer(coord: CheckpointCoordinator, step: int, *, rank: int, keep_verified: bool = False) -> None:
    """This rank deletes its in-memory snapshots and durable generations newer than ``step`` (-1: all of them;
    ``keep_verified``: durable candidates only): what a restart from ``step`` abandoned must never be mixed
    with the new run's shards at a later restart."""
    gone = coord.memory.drop_newer(step, coord.sources)
    store = coord.store
    for gen, role in sorted(store.local_generations(check_bytes=False).items()):
        if gen > step and not (keep_verified and role == "verified"):
            store.remove(gen)
            gone.append(f"durable {role} generation {gen}")
    if gone:
        _log.warning("SCOUT resume: rank %d deleted %d in-memory snapshot(s) newer than step %d: %s",
                     rank, len(gone), step, ", ".join(gone))
