"""The restart path (paper section 8, CheckpointRetrieval): one call at start-up, on every rank.

:meth:`Restarter.resume` runs right after ``enable()`` in a (re)started job:

1. reads the last record of ``decisions.jsonl``: a retrieval decision taken by
   the previous run at a verdict, or nothing (the job died on a hang or crash);
2. takes inventory of the in-memory slots on every rank (own snapshots and the
   replicas kept for partners) and votes on ``latest``: the newest step for
   which every rank's snapshot exists somewhere; votes on ``verified`` in the
   durable store (the newest generation every rank holds intact);
3. without a recorded decision, decides now: ``machine_unreachable`` when some rank's own snapshot
   is gone (its machine was replaced) or another machine wrote it (its boot id differs), else
   ``other`` with the emergency sweep: the latest state is restored and every layer is replayed on
   the newest saved calls across peers, and every expert on every shape of the MoE shape catalog
   (``extra_sweeps``); latest only if clean (a dirty sweep puts the state back as it was before it).
   A recorded straggler stop is decided again the same way: slowness says nothing about whether an
   SDC no check has reached yet sits in the latest state;
4. loads the chosen generation: from memory where every rank can get it (a rank
   whose machine was lost receives its shard from the partner keeping its
   replica, over SCOUT's gloo group), else from the durable store;
5. restores model, optimizer, RNG, caller state and SCOUT's own schedule
   bitwise, deletes every in-memory snapshot newer than what it restored (they
   hold state judged unsafe: a second restart must not find them as latest),
   and appends a ``resume`` record.

Every step runs under replay's agreement (:class:`~scout_core.replay.guard.DiagnosisGuard`):
a rank whose work raises (a slot that does not load, a restore that fails half-way)
writes a ``diagnosis_error`` record, and every rank falls back together: to the
next older verified generation, then to nothing (a fresh start, recorded). No
rank restores before every rank has loaded and checked its shard. Once, before
the first restore begins, every rank copies the state it has before resume()
into pageable host memory, under its own agreement (a copy that fails anywhere
is dropped everywhere: the restart goes on without it, and says so); a restore
that fails on some rank is replaced on every rank by the fallback's, or by that
copy. No rank waits for a peer that gave up.
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
from scout_core.checkpoint.fetch import exchange_replicas, load_shard, vote_latest
from scout_core.checkpoint.store import DurableStore, agree_on_generation
from scout_core.replay.guard import DiagnosisGuard
from scout_core.wire import all_gather_data, broadcast_data

__all__ = ["ResumeResult", "Restarter", "drop_newer", "vote_latest"]

_log = logging.getLogger("scout")
_UNTRUSTED = {"latest": None, "verified": None}
_OUTCOMES = ("dirty", "failed", "clean")
"""A sweep's outcomes, worst first: SDC anywhere is dirty; else a part that could not run leaves it failed."""
"""The certification state of the state from before ``resume()`` put back: nothing vouched for."""


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
    intact: bool = True
    """False only with ``step`` None: a restore began and the state from before resume() could not be put
    back on every rank (no copy of it, or putting it back raised somewhere): model, optimizer, RNG and caller
    state may hold a partly restored generation, and differ between ranks. The reason says why."""

    @property
    def next_step(self) -> int:
        """The step the training loop continues with (0 on a fresh start)."""
        return 0 if self.step is None else self.step


@dataclass
class _Survey:
    """What every rank holds, as every rank sees it after the votes."""

    last: dict[str, Any] | None
    inventories: list[dict[str, Any]]
    latest: int | None
    fetch: dict[int, int]
    verified: int | None
    notes: str = ""
    """Said in every outcome's reason: another job's slots deleted, a survey that failed on some rank."""


def _binding(record: dict[str, Any] | None, latest: int | None) -> bool:
    """A recorded decision binds the restart when the run stopped on it, nothing newer was captured and it is whole."""
    if not record or record.get("record", "decision") != "decision" or not record.get("binding", True) \
            or record.get("source") not in ("latest", "verified") or not isinstance(record.get("reason", ""), str):
        return False
    decided_at = c.get("latest") if isinstance(c := record.get("certifier") or {}, dict) else "?"
    return all(isinstance(v, (int, type(None))) for v in (decided_at, record.get("generation"))) \
        and (latest is None or decided_at is None or latest <= decided_at)


def _worst(a: str, b: str) -> str:
    """Two sweep outcomes combined (see ``_OUTCOMES``)."""
    return _OUTCOMES[min(_OUTCOMES.index(a), _OUTCOMES.index(b))]


class _Held:
    """The durable store as a vote sees it: a rank whose listing raised holds nothing (the guard keeps why;
    the vote's collective still runs), and with ``below`` only the generations older than that."""

    def __init__(self, store: DurableStore, guard: DiagnosisGuard, below: int | None = None) -> None:
        self.store, self.guard, self.below = store, guard, below

    def local_generations(self, *, check_bytes: bool = True) -> dict[int, str]:
        held = self.guard.attempt("listing the durable generations",
                                  lambda: self.store.local_generations(check_bytes=check_bytes)) or {}
        return {g: r for g, r in held.items() if self.below is None or g < self.below}


class Restarter:
    """The product's restart path over the coordinator's memory slots and durable store."""

    def __init__(self, coordinator: CheckpointCoordinator, *, control_group: Any, engine: Any = None,
                 restore: Any, after_restore: Any = None, current: Any = None,
                 extra_sweeps: Sequence[Callable[[int], str]] = (), guard: DiagnosisGuard | None = None) -> None:
        self.coord = coordinator
        # More of the catalog for the emergency sweep (the experts' shapes): callable(step) -> "clean",
        # "dirty" or "failed", the same on every rank.
        self.extra_sweeps = list(extra_sweeps)
        self.current = current  # callable() -> the state as it is now (a snapshot dict), to put it back
        self.group = control_group
        self.replay = engine
        self.restore = restore  # callable(snapshot dict): model, optimizer, RNG, caller state
        # callable(snapshot dict, certifier state) on every rank: SCOUT's schedule and trust of what was
        # restored; with latest None, of the state from before resume() put back.
        self.after_restore = after_restore
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.guard = guard if guard is not None else DiagnosisGuard(control_group, rank=self.rank, reporter=None)
        self._before: dict[str, Any] | None = None  # the state from before resume(), once a restore is to start
        self._net: bool | None = None  # that copy was tried: held on every rank (True) or on none (False)
        self._touched = False  # a restore began (every rank alike): the state from before is not loaded now
        self._memory_failed = self._sweep_failed = False  # an in-memory step failed; the sweep could not run

    def _broadcast(self, value: Any) -> Any:
        return broadcast_data(value if self.rank == 0 else None, 0, self.group, what="restore decision")

    def resume(self, failure: str | None = None) -> ResumeResult:
        self.guard.reset()
        self._before, self._net, self._touched = None, None, False
        self._memory_failed = self._sweep_failed = False
        try:
            return self._resume(failure)
        finally:
            self._before = None  # a whole copy of the state: not kept past resume()
            self.guard.reset()

    def _resume(self, failure: str | None) -> ResumeResult:
        s = self._survey()
        recorded = s.last if _binding(s.last, s.latest) else None
        if recorded is not None and recorded.get("failure") == FailureKind.STRAGGLER:
            # Binds the kind of failure, not the generation: latest only if the restart's sweep shows it clean.
            decision = self._decide_now(s, FailureKind.STRAGGLER)
        elif recorded is not None:
            decision = dict(recorded)
        elif s.latest is None and s.verified is None:
            return ResumeResult(step=None, reason="no snapshot or verified checkpoint: fresh start" + s.notes)
        else:
            decision = self._decide_now(s, failure)
        gen, source, reason = decision["generation"], decision["source"], decision["reason"]
        if source == "latest" and gen != s.latest:
            reason += f"; latest generation {gen} is not held for every rank: using verified {s.verified}"
            source, gen = "verified", s.verified
        if source == "verified" and gen != s.verified:
            reason += f"; verified generation {gen} is not intact on every rank: using {s.verified}"
            gen = s.verified
        reason += s.notes
        if gen is None:  # e.g. SDC before anything was certified: nothing SCOUT holds is safe to load
            return self._nothing(decision, reason + f"; no {source} generation is held by every rank")
        self._keep_before()
        while gen is not None:
            from_memory = gen == s.latest and not self._memory_failed
            # What a restored verified generation vouches for is itself (an older one after a fallback).
            trust = {"latest": gen, "verified": gen if source == "verified" else s.verified}
            if self._restore_agreed(gen, s.fetch if from_memory else {}, from_memory,
                                    lambda snap, t=trust: self._apply(snap, t)):
                return self._restored(s, decision, gen, source, reason, from_memory)
            older = agree_on_generation(_Held(self.coord.store, self.guard, gen + 1 if from_memory else gen),
                                        "verified", group=self.group)
            listed = self.guard.agree(None, "resume")  # a rank whose listing raised: its record says why
            self.guard.reset()
            older = older if listed else None
            reason += (f"; {'the in-memory snapshot of step' if from_memory else 'durable generation'} {gen} "
                       "could not be loaded or restored on every rank (a diagnosis_error record says where): "
                       + (f"falling back to verified {older}" if older is not None else
                          "no older verified generation is held by every rank" if listed else
                          "the older verified generations could not be listed on every rank (a diagnosis_error "
                          "record says where)"))
            gen, source = older, "verified"
        return self._nothing(decision, reason)

    def _survey(self) -> _Survey:
        """The recorded decision, every rank's inventory and the votes; a rank that could not take stock
        makes every rank leave memory and the recorded decision aside (verified only)."""
        coord, guard = self.coord, self.guard
        path = coord.decisions_path
        last = self._broadcast(guard.run("reading decisions.jsonl", lambda: (read_records(path) or [None])[-1])
                               if path and self.rank == 0 else None)
        held = guard.run("taking inventory of the in-memory snapshots",
                         lambda: (coord.memory.inventory(), coord.memory.foreign))
        gathered = all_gather_data(held or ({"own": None, "replicas": {}}, (0, "")), self.group,
                                   what="snapshot inventories")
        inventories = [inv for inv, _ in gathered]
        foreign = sum(n for _, (n, _why) in gathered)
        whys = dict.fromkeys(why for _, (_n, why) in gathered if why)
        notes = "".join(f"; {foreign} in-memory snapshot(s) of another job on these machines are not restored "
                        f"(deleted at this job's first capture): {why}" for why in whys)
        latest, fetch = vote_latest(inventories)
        verified = agree_on_generation(_Held(coord.store, guard), "verified", group=self.group)
        if not guard.agree(None, "resume"):
            guard.reset()
            self._memory_failed = True
            notes += ("; the restart could not take stock on every rank (a diagnosis_error record says where): "
                      "the in-memory snapshots and any recorded decision are left aside")
            return _Survey(None, inventories, None, {}, verified, notes)
        if latest is not None and verified is not None and latest < verified:
            # In-memory snapshots older than the verified checkpoint come from an earlier run on these
            # machines (a /dev/shm or disk fallback that outlived it): never roll back to them.
            _log.warning("SCOUT resume: in-memory snapshots of step %d are older than verified generation %d: "
                         "ignored and deleted", latest, verified)
            self._local("deleting the stale in-memory snapshots", lambda: coord.memory.drop_newer(-1, coord.sources))
            latest, fetch = None, {}
        return _Survey(last, inventories, latest, fetch, verified, notes)

    def _decide_now(self, s: _Survey, failure: str | None) -> dict[str, Any]:
        """The retrieval policy on what every rank holds (no decision recorded, or none that binds)."""
        # A machine was lost when some rank has no snapshot of its own left at all, or one another machine wrote
        # (its boot id differs). A rank whose own slot is merely older (killed while writing the newest) fetches
        # it, but nothing was lost.
        lost = any(inv["own"] is None or inv.get("moved") for inv in s.inventories)
        kind = FailureKind(failure) if failure else FailureKind.OTHER
        if lost and kind in (FailureKind.STRAGGLER, FailureKind.OTHER):
            # No sweep can replay on a machine that is gone: what it computed into latest cannot be shown clean.
            kind = FailureKind.MACHINE_UNREACHABLE
        certifier = Certifier(latest=s.latest, verified=s.verified)
        latest = s.latest
        swept = kind in (FailureKind.STRAGGLER, FailureKind.OTHER) and latest is not None
        sweep = (lambda: self._sweep(latest, s.fetch)) if swept else None
        d = decide_retrieval(certifier, kind, sweep=sweep)
        reason = d.reason
        if self._sweep_failed:  # not SDC: the sweep could not run (a diagnosis_error record says why)
            reason = ("the emergency sweep could not run on every rank, so the latest state is not proven "
                      "clean: restoring verified")
        decision = {"record": "decision", "source": d.source, "generation": d.generation, "reason": reason,
                    "failure": d.failure, "sweep_clean": d.sweep_clean, "sweep_failed": self._sweep_failed}
        path = self.coord.decisions_path
        if path and self.rank == 0:
            self._local("writing the retrieval decision", lambda: record_decision(
                path, {k: v for k, v in decision.items() if k != "record"}, certifier=certifier))
        return decision

    def _local(self, where: str, fn: Callable[[], Any]) -> None:
        """Bookkeeping of this rank alone (a record, deleting files) that changes nothing the peers wait for or
        restore: a failure is reported (a ``diagnosis_error`` record), never raised into a peer's wait."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the restart goes on; the record says what was not done
            self.guard.report(None, "resume", exc, where)

    def _apply(self, snap: dict[str, Any], trust: dict[str, Any]) -> None:
        self.restore(snap)
        if self.after_restore is not None:
            self.after_restore(snap, trust)

    def _keep_before(self) -> None:
        """Once, before the first restore begins (every rank alike): the state from before resume() in pageable
        host memory, under its own agreement. A copy that fails on some rank is dropped on every rank and the
        restart goes on without it (the reason says so); it never counts against a generation."""
        if self._net is not None or self.current is None:
            return
        copied = self.guard.run("copying the state from before resume()", self.current)
        self._net = self.guard.agree(None, "resume")
        self.guard.reset()
        self._before = copied if self._net else None
        del copied

    def _safety_note(self) -> str:
        if self._net is not False:
            return ""
        return ("; the state from before resume() could not be copied on every rank (a diagnosis_error record "
                "says where): the restart went on without that copy, so a failed restore could not be undone")

    def _restore_agreed(self, gen: int, fetch: dict[int, int], from_memory: bool,
                        apply: Callable[[dict[str, Any]], None]) -> bool:
        """Load and check this rank's snapshot of ``gen``; once every rank has, ``apply`` it on every rank.
        True when it took everywhere; otherwise the guard is clean again and the state may be half-restored on
        some ranks (whatever comes next replaces it on every rank)."""
        guard = self.guard
        snap = load_shard(self.coord, guard, rank=self.rank, gen=gen, from_memory=from_memory,
                          exchange=lambda: self._exchange_replicas(gen, fetch))
        if guard.agree(gen, "resume"):
            self._touched = True
            guard.run(f"restoring step {gen}", lambda: apply(snap))
            if guard.agree(gen, "resume"):
                return True
        self._memory_failed |= from_memory
        guard.reset()
        return False

    def _put_back(self, schedule: dict[str, Any] | None = None) -> bool:
        """Every rank: the state from before resume() again, after a restore began (nothing else is loaded);
        ``schedule``: SCOUT's as it was before a sweep (which loads nothing else of SCOUT's), else SCOUT's
        bookkeeping is put back through ``after_restore``. True when it is back on every rank (or no restore
        began); otherwise the state stays marked as touched, the same on every rank."""
        if not self._touched:
            return True
        before = self._before
        if before is None:  # no copy (no ``current``, or it failed on some rank): what the restore left stays
            _log.error("SCOUT resume: rank %d cannot put back the state from before resume()", self.rank)
            return False

        def undo() -> None:
            self.restore(before)
            if schedule is not None:
                self.replay.load_sweep_state(schedule)
            elif self.after_restore is not None:
                self.after_restore(before, dict(_UNTRUSTED))

        self.guard.run("putting back the state from before resume()", undo)
        back = self.guard.agree(None, "resume")
        self.guard.reset()
        self._touched = not back
        return back

    def _nothing(self, decision: dict[str, Any], reason: str) -> ResumeResult:
        """No generation restored on any rank: the state from before resume(), the unsafe snapshots gone."""
        reason += self._safety_note() + ": nothing restored"
        intact = self._put_back()
        if not intact:
            reason += ("; the state from before resume() could not be put back on every rank (a diagnosis_error "
                       "record says where, unless there was no copy): model, optimizer, RNG and caller state may "
                       "hold a partly restored generation")
        # A partial verified generation stays for forensics.
        self._local("deleting the unsafe snapshots", lambda: self._drop_newer(-1, keep_verified=True))
        _log.error("SCOUT resume: %s. %s; the unsafe snapshots were deleted.", reason,
                   "The model keeps the state it had before resume() (a fresh initialization unless you loaded "
                   "one)" if intact else "Do not train from this state: restart the job or load a checkpoint")
        path = self.coord.decisions_path
        if path and self.rank == 0:
            self._local("writing the resume record", lambda: record_decision(
                path, {"source": "none", "generation": None, "reason": reason, **({} if intact else
                                                                                  {"intact": False})},
                kind="resume"))
        return ResumeResult(step=None, reason=reason, decision=decision, intact=intact)

    def _restored(self, s: _Survey, decision: dict[str, Any], gen: int, source: str, reason: str,
                  from_memory: bool) -> ResumeResult:
        # Whatever is newer than what was restored is unsafe (the state judged bad) or partial (a verified
        # generation intact on every rank would have been the vote): a later restart, after training has
        # reached those step numbers again, must never mix such a shard with new ones.
        self._local(f"deleting the snapshots newer than step {gen}", lambda: self._drop_newer(gen))
        if self._memory_failed:  # an in-memory generation that did not load: not offered again
            self._local(f"deleting the in-memory snapshots of step {gen}",
                        lambda: self.coord.memory.drop_newer(gen - 1, self.coord.sources))
        fetch = s.fetch if from_memory else {}
        reason += self._safety_note()
        result = ResumeResult(step=gen, source=source, reason=reason, from_memory=from_memory,
                              fetched=self.rank in fetch, decision=decision)
        path = self.coord.decisions_path
        if path and self.rank == 0:
            self._local("writing the resume record", lambda: record_decision(
                path, {"source": source, "generation": gen, "reason": reason, "from_memory": from_memory,
                       "fetched_for": sorted(fetch)}, kind="resume"))
        dist.barrier(group=self.group)
        return result

    def _exchange_replicas(self, gen: int, fetch: dict[int, int]) -> torch.Tensor | None:
        """Holders send the replicas that lost ranks need; ours if we needed one (see ``exchange_replicas``)."""
        return exchange_replicas(lambda owner: self.coord.memory.raw("replica", owner, gen), self.guard,
                                 self.group, rank=self.rank, gen=gen, fetch=fetch)

    def _drop_newer(self, step: int, *, keep_verified: bool = False) -> None:
        drop_newer(self.coord, step, rank=self.rank, keep_verified=keep_verified)

    def _sweep(self, latest: int, fetch: dict[int, int]) -> bool:
        """Restore the latest state and replay every layer on its saved calls; clean on every rank.

        A dirty sweep, or a latest state that does not load or restore on some rank, puts back the state
        the model had before it (what the user built or loaded before ``resume()``), so suspect weights
        never stay loaded, whatever is restored next."""

        def for_the_sweep(snap: dict[str, Any]) -> None:
            self.restore(snap)
            if self.replay is not None:
                self.replay.load_sweep_state(snap["extra"].get("scout", {"step": latest, "checks": 0}))

        schedule = self.replay.sweep_state() if self.replay is not None else None
        self._keep_before()
        if not self._restore_agreed(latest, fetch, True, for_the_sweep):
            self._sweep_failed = True
            self._put_back(schedule)
            return False
        outcome = self._swept(latest)
        self._sweep_failed = outcome == "failed"
        if outcome != "clean":
            self._put_back(schedule)
        return outcome == "clean"

    def _swept(self, latest: int) -> str:
        """Every part of the sweep (each runs, so a dirty one is recorded whatever the others say), a part
        that raises counted as failed (its record says why), and the worst outcome of any rank, on every rank."""
        parts: list[tuple[str, Callable[[], str]]] = [("the emergency sweep", self.replay.sweep)] if (
            self.replay is not None) else []
        parts += [(f"extra sweep {i}", lambda e=extra: e(latest)) for i, extra in enumerate(self.extra_sweeps)]
        outcome = "clean"
        for where, part in parts:
            try:
                got = part()
                outcome = _worst(outcome, got)
            except Exception as exc:  # noqa: BLE001 - local work before a part's collectives is guarded inside it
                self.guard.reset()
                self.guard.report(latest, "sweep", exc, where)
                outcome = _worst(outcome, "failed")
        code = torch.tensor([_OUTCOMES.index(outcome)], dtype=torch.int32)
        dist.all_reduce(code, op=dist.ReduceOp.MIN, group=self.group)
        return _OUTCOMES[int(code.item())]


def drop_newer(coord: CheckpointCoordinator, step: int, *, rank: int, keep_verified: bool = False) -> None:
    """This rank deletes its in-memory snapshots and durable generations newer than ``step`` (-1: all of them;
    ``keep_verified``: durable candidates only): what a restart from ``step`` abandoned must never be mixed
    with the new run's shards at a later restart."""
    gone = coord.memory.drop_newer(step, coord.sources)
    for gen, role in sorted(coord.store.local_generations(check_bytes=False).items()):
        if gen > step and not (keep_verified and role == "verified"):
            coord.store.remove(gen)
            gone.append(f"durable {role} generation {gen}")
    if gone:
        _log.warning("SCOUT resume: rank %d deleted %d in-memory snapshot(s) newer than step %d: %s",
                     rank, len(gone), step, ", ".join(gone))
