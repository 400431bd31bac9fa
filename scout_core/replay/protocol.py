"""One check's collective sequence: call metadata, scratch reservation, agreement, broadcast and evidence exchange.

Every rank of the job takes these steps in the same order. Local work between them runs through the check's
:class:`~scout_core.replay.guard.DiagnosisGuard`, and before each collective a rank could otherwise miss, all ranks
agree: a failure on any rank makes every rank skip the rest of the check together, so no peer is left waiting in a
collective. The call metadata's broadcast and the evidence exchange need no agreement before them (every member
joins them whatever happened before; a member that failed sends nothing to compare); the one after each covers
it. A check's cost on a busy host is mostly its collectives' latency, so each
one here is one the check needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scout_core.consensus import C3Result, StatisticalRule, c3_exchange, c3_exchange_unless_failed
from scout_core.groups import ScoutGroups
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.health import RecipeHealth
from scout_core.replay.layer import device_of
from scout_core.replay.recipe import RecipeRunner, Replayed
from scout_core.replay.result import REPLICA_UNTRUSTED, REPLICATED_STATE, BoundaryResult
from scout_core.replay.scratch import Scratch
from scout_core.replay.shipping import ShippedCall, broadcast_call, call_meta, receive_buffers
from scout_core.replay.spec_codec import decode_metadata, encode_metadata
from scout_core.report import Reporter
from scout_core.signature import sign_many
from scout_core.wire import broadcast_bytes

__all__ = ["DIAGNOSIS_ERROR", "CheckProtocol"]

DIAGNOSIS_ERROR = "diagnosis error"
"""``BoundaryResult.skipped`` when a local failure on some rank made every rank skip the check."""


@dataclass(eq=False)
class CheckProtocol:
    """The collectives of one engine's checks and the guard their local work runs in."""

    groups: ScoutGroups
    recipes: RecipeRunner
    rank: int
    health: RecipeHealth
    reporter: Reporter | None = None
    hosts: dict[int, str] = field(default_factory=dict)
    replay_context: Callable[[], AbstractContextManager[Any]] | None = None
    """Entered around each check: what the framework must switch off while SCOUT calls its layers outside
    training (Megatron's parameter all-gather pre-hooks)."""
    replay_pairs_across_groups: bool = False
    replicated_parameters: Callable[[torch.nn.Module], list[torch.Tensor]] | None = None
    """The parameters of a layer that replica-group members hold as copies, not shards (replica verdicts)."""

    def __post_init__(self) -> None:
        # Skips are agreed job-wide: replay has cross-group collectives (HSDP timing, the machine intersection).
        self.guard = DiagnosisGuard(self.groups.world_control, rank=self.rank, reporter=self.reporter,
                                    hosts=self.hosts)

    @contextlib.contextmanager
    def framework_paused(self, step: int) -> Iterator[None]:
        """The adapter's replay context around a check; a failure to enter it skips the check on every rank
        (the guard's next agreement), a failure to leave it is reported, never raised into training."""
        if self.replay_context is None:
            yield
            return
        ctx = None
        try:
            ctx = self.replay_context()
            ctx.__enter__()
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.guard.fail(exc, "entering the framework's replay context")
            ctx = None
        try:
            yield
        finally:
            if ctx is not None:
                try:
                    ctx.__exit__(None, None, None)
                except Exception as exc:  # noqa: BLE001
                    self.guard.report(step, "replay", exc, "leaving the framework's replay context")

    def finish(self) -> str | None:
        """End the check: this rank's failed stage (None if none), and a clean guard for the next check."""
        where = self.guard.failure.where if self.guard.failure is not None else None
        self.guard.reset()
        return where

    def agree_inputs(self, result: BoundaryResult, due: Sequence[tuple[str, int]], src: int,
                     failed_before: BaseException | None = None, *, time_all_reduce: bool
                     ) -> tuple[dict[int, ShippedCall], dict[int, Scratch]] | None:
        """Share the source's call metadata, take its buffers' shapes, reserve every collective's memory, and
        agree to go on: (calls, scratch), or None with ``result.skipped`` saying why every rank stops.
        ``time_all_reduce``: this rank asks to time the scratch all-reduce; the agreement decides for every rank
        (timed where any asked), and where it is not timed its buffer is let go (``_timed`` then times none)."""
        guard, step = self.guard, result.step
        if failed_before is not None:
            guard.fail(failed_before, "optimizer slice capture")
        captured, metas = self._call_metadata(due, src)
        not_run = [self.recipes.names[idx] for _, idx in due if metas.get(idx) is None] if guard.ok else []
        calls: dict[int, ShippedCall] = {}

        def buffers() -> None:
            for _, idx in due:
                if metas.get(idx) is not None:
                    calls[idx] = receive_buffers(metas[idx], captured.get(idx),
                                                 device_of(self.recipes.layers[idx]), self.rank == src)

        guard.run("receive buffers", buffers)
        scratch = self._reserve_scratch(due, calls)
        status, timed = guard.agree_and_ask(step, skip=bool(not_run), ask=time_all_reduce)
        if status != "ok":
            # A sampled layer that did not run on a source (conditional layers, MoE) skips the check
            # everywhere: other peer groups' replays would otherwise meet this group in cross-group timing.
            result.skipped = DIAGNOSIS_ERROR if status == "error" else (
                f"sampled layer(s) {', '.join(not_run) or 'of another peer group'} did not run on the source")
            if status == "skip":
                self.health.skipped(step, result.skipped)
            return None
        if not timed:
            for reserved in scratch.values():
                reserved.all_reduce = None
        return calls, scratch

    def _call_metadata(self, due: Sequence[tuple[str, int]], src: int) -> tuple[dict[int, Any], dict[int, Any]]:
        """Take this step's captures and broadcast the source's call metadata: (captured, metadata); the
        metadata is empty where the source or this rank failed (the agreement after it skips the check)."""
        guard = self.guard
        captured = guard.run("capture", lambda: {idx: self.recipes.captures[idx].take() for _, idx in due}) or {}
        payload = None
        if self.rank == src:  # encoded here, so an argument that is not plain data is a local failure, not a hang
            payload = guard.run("call metadata", lambda: encode_metadata(
                {idx: None if captured.get(idx) is None else call_meta(captured[idx], self.recipes.rng_providers)
                 for _, idx in due}))
        # No agreement before this broadcast: every member joins it whatever its own state (a source that failed
        # sends an empty payload and reports its own failure), and the agreement that follows the buffers and
        # scratch reservation decides for every rank at once: one collective less per check.
        raw = guard.attempt("call metadata", lambda: broadcast_bytes(
            (payload or b"") if self.rank == src else b"", src, self.groups.peer_control, what="call metadata"))
        if not raw:
            return captured, {}
        return captured, guard.run("call metadata", lambda: decode_metadata(raw, src)) or {}

    def _reserve_scratch(self, due: Sequence[tuple[str, int]], calls: dict[int, ShippedCall]) -> dict[int, Scratch]:
        """Everything the collectives below allocate, allocated now: an out-of-memory error inside a
        collective would hang the peers; here it is a failure every rank agrees on next."""
        scratch: dict[int, Scratch] = {}
        # One unshard probe for the check, the largest recipe's (they unshard one after another), held by
        # the first recipe to unshard; each recipe's reservation is its own stage, so a recipe that never
        # fits is the one switched off (replay.health).
        needs = {idx: self.recipes.unshard_bytes(idx, self.guard) for _, idx in due if idx in calls}
        probe_at = next((idx for idx, n in needs.items() if n), None)  # the first recipe to unshard
        for recipe, idx in due:
            if idx in calls:
                headroom = max(needs.values()) if idx == probe_at else 0
                self.guard.run(f"scratch memory of {self.recipes.names[idx]}",
                               lambda recipe=recipe, idx=idx, h=headroom: scratch.__setitem__(
                                   idx, self.recipes.reserve(idx, timed=recipe == "hidden", headroom=h)))
        return scratch

    def broadcast(self, calls: dict[int, ShippedCall], due: Sequence[tuple[str, int]], src: int) -> None:
        """The source's inputs, output gradients and RNG states to every peer (agreed on: all ranks are here)."""
        for _, idx in due:
            broadcast_call(calls[idx], src, self.groups.peer, self.groups.peer_control)

    def exchange(self, result: BoundaryResult, replayed: Replayed, *, timed: bool, rule: StatisticalRule,
                 expects_evidence: bool) -> tuple[list[C3Result], list[C3Result] | None] | None:
        """Exchange every surface's signature (exact C3) and, in a timed check, the compute and communication
        times (statistical C3 by ``rule``) in one all-gather, then agree; None: every rank skips.

        ``expects_evidence``: this rank's peer group replays something in this check (from the schedule, the
        same on every peer; a pipeline stage without the due module has nothing to exchange but still agrees).
        No agreement before the exchange (one collective less per check): every peer joins it whatever its own
        state, a rank that failed earlier in the check sends no evidence, then no rank compares, and the
        agreement after it skips the check on every rank with one record, the failed rank's."""
        guard, step, evidence = self.guard, result.step, replayed.evidence
        # Signatures (exact) and, in a timed check, the two times (statistical) travel in one all-gather. A peer
        # that sent other surfaces makes the comparison raise on every peer alike.
        values, names = [v for _, v in evidence], [n for n, _ in evidence]
        rules: list[str | StatisticalRule] = ["exact"] * len(values)
        if timed:
            values += [replayed.compute_s, replayed.comm_s]
            names += ["replay.compute_s", "replay.comm_s"]
            rules += [rule, rule]
        exchanged: tuple[list[C3Result], list[C3Result] | None] | None = ([], None)
        if expects_evidence:
            ok = guard.ok
            results = guard.attempt("evidence exchange", lambda: c3_exchange_unless_failed(
                values if ok else None, group=self.groups.peer_control, surfaces=names, rule=rules))
            exchanged = None if results is None else (results[:-2], results[-2:]) if timed else (results, None)
        if not guard.agree(step) or exchanged is None:
            result.skipped = DIAGNOSIS_ERROR
            return None
        return exchanged

    def share_nondeterminism(self, nondeterministic: bool) -> bool:
        """Whether any rank that must replay as often as this one found a rank nondeterministic."""
        if self.replay_pairs_across_groups and len(self.groups.all_peers) > 1:
            # Every peer group replays as often as every other: tensor- or context-parallel partners sit in other
            # groups and pair their collectives with this one's in replay (a second run on one side only would
            # leave the other waiting). All ranks are here: the agreement above passed. (Elsewhere a group's
            # second run is local compute, and only the group that needs it pays for it.)
            flag = torch.tensor([int(nondeterministic)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.world_control)
            nondeterministic = bool(flag.item())
        return nondeterministic

    def replica_exchange(self, result: BoundaryResult, due: Sequence[tuple[str, int]],
                         evidence: Sequence[tuple[str, Any]], untrusted: dict[int, str]) -> bool:
        """Compare the hidden layer's outputs across the replica group, where the adapter declares one, into
        ``result.replica_surfaces``. False: every rank skips the rest of the check.

        It runs after the job-wide agreement of the exchange (a peer group that failed its own exchange must not
        leave its replica partners waiting in this one) and after this check's vetting (a rank its own group
        just found nondeterministic is no evidence for the replica group either)."""
        if self.groups.replica_control is None:
            return True
        copy_error: list[BaseException] = []
        replicated = self._replicated_surfaces(due, evidence, untrusted, copy_error)
        result.replica_surfaces = self.guard.run("replica exchange", lambda: c3_exchange(
            [v for _, v in replicated], group=self.groups.replica_control,
            surfaces=[n for n, _ in replicated])) or []
        if copy_error:
            self.guard.fail(copy_error[0], "replicated parameters")
        if not self.guard.agree(result.step):
            result.skipped = DIAGNOSIS_ERROR
            return False
        return True

    def _replicated_surfaces(self, due: Sequence[tuple[str, int]], evidence: Sequence[tuple[str, Any]],
                             untrusted: dict[int, str], copy_error: list[BaseException]) -> list[tuple[str, Any]]:
        """The hidden layer's outputs, its copied parameters' signatures and this rank's untrusted ranks."""
        hidden_idx = next(idx for r, idx in due if r == "hidden")
        hidden = self.recipes.names[hidden_idx]
        replicated = [(n, v) for n, v in evidence if n.startswith(f"{hidden}.x") and n.endswith(".output")]
        if replicated and self.replicated_parameters is not None:
            try:
                params = [p.detach() for p in self.replicated_parameters(self.recipes.layers[hidden_idx])]
                copies: Any = tuple((s.signature, s.nonfinite) for s in sign_many(params))
            except Exception as exc:  # noqa: BLE001 - still exchanged (every member joins), as "unavailable"
                copy_error.append(exc)
                copies = ("unavailable", self.rank)  # differs from every other member's: no replica verdict
            replicated.append((f"{hidden}{REPLICATED_STATE}", copies))
        if replicated:  # every member's ranks that are not evidence: the verdict must be the same on all
            replicated.append((REPLICA_UNTRUSTED, tuple(sorted(untrusted))))
        return replicated
