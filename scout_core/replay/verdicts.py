"""Verdicts of one check: the incident records its results call for, and the one rank that writes each.

Pure functions of the results and of facts every peer shares (no collective, no state): every rank of a group
decides alike from the same exchange, so each record is written once, by the rank these functions name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scout_core.consensus import C3Result, C3Status, group_disagreements
from scout_core.replay.layer import GATHERED_RECEIPT, GATHERED_SHARD
from scout_core.replay.result import REPLICA_UNTRUSTED, REPLICATED_STATE, BoundaryResult
from scout_core.report import Incident, IncidentKind, IncidentScope

__all__ = ["UNTRUSTED_REASON", "Records", "TimingFindings", "VerdictContext", "check_verdicts",
           "explained_by_shard_mates", "incident",
           "peer_writer", "replica_verdicts", "sdc_verdicts", "timing_verdicts", "vetting_verdicts", "world_writer"]

UNTRUSTED_REASON = {
    "nondeterministic": "nondeterministic: the layer replayed twice on this rank signed differently, so its "
                        "replay cannot be compared bitwise (see docs/replay.md: deterministic replay)",
    "environment": "environment: this rank replays with other software, hardware or precision settings than "
                   "its peers' majority (evidence.environment), so equal inputs need not give equal bits",
}
"""The record's reason for each way a rank is found not to be evidence (``replay.vetting``)."""


@dataclass(frozen=True)
class VerdictContext:
    """Who decides: this rank, its peer group, its replica group and the job at one step (alike on every peer)."""

    rank: int
    step: int
    peers: tuple[int, ...]
    world_size: int
    hosts: Mapping[int, str] = field(default_factory=dict)
    all_peers: tuple[tuple[int, ...], ...] = ()
    replica_ranks: tuple[int, ...] = ()


@dataclass
class Records:
    """Incident records and the one rank that writes them (None: no rank does)."""

    incidents: list[Incident]
    writer: int | None
    job_wide: bool = False
    """The records are the job's, not one peer group's (``BoundaryResult.incidents_global``)."""


@dataclass(frozen=True)
class TimingFindings:
    """What the timing judge has confirmed after this round (``replay.judge``)."""

    new_stragglers: tuple[int, ...] = ()
    """Compute stragglers of this round confirmed just now."""
    rounds: int = 2
    """The consecutive rounds that confirm a straggler."""
    by_persistence: tuple[int, ...] = ()
    """Of ``new_stragglers``, those the persistence path named (the others beyond the noise floor)."""
    persist_rounds: int = 3
    """The consecutive rounds in which a persistently slower rank is named (``consensus.persist_rounds``)."""
    machine_confirmed: bool = False
    """The cross-group localization has been named for ``rounds`` rounds in a row."""
    group_slowdown_confirmed: bool = False
    """The group's slowdown against its own history has just reached its confirmation count."""


def incident(ctx: VerdictContext, kind: IncidentKind, scope: IncidentScope, ranks: Sequence[int],
             results: Sequence[C3Result], reason: str) -> Incident:
    """One record naming ``ranks``, its evidence the ``results`` that found it."""
    return Incident(kind=kind, scope=scope, ranks=list(ranks), hosts=[ctx.hosts.get(r, "?") for r in ranks],
                    devices=[], step=ctx.step, surface=";".join(r.surface for r in results),
                    evidence={"surfaces": {r.surface: r.to_dict() for r in results}}, reason=reason)


def peer_writer(peers: Sequence[int], incidents: Sequence[Incident]) -> int | None:
    """The lowest peer not named by a rank-scoped verdict writes a peer group's records (group-scoped verdicts
    name everyone, and any member may report those); None when there is nothing to write."""
    if not incidents:
        return None
    named = {r for i in incidents if i.scope is IncidentScope.RANK for r in i.ranks}
    return min((r for r in peers if r not in named), default=min(peers))


def world_writer(named: Collection[int], world_size: int) -> int:
    """The lowest rank of the job a job-wide record does not name writes it (one record for the whole job)."""
    return min((r for r in range(world_size) if r not in named), default=0)


def _strict_majority(values: Sequence[Any]) -> Any:
    """The value more than half of ``values`` hold, or None."""
    for v in values:
        if sum(1 for w in values if w == v) * 2 > len(values):
            return v
    return None


def explained_by_shard_mates(results: Sequence[C3Result]) -> list[C3Result]:
    """``results`` without the disagreements a shard-group mate explains (HSDP). A replica whose gathered copy
    of another position's shard differs (``<layer>.gathered_shard.<j>``), while that copy is what the shard's
    owner holds (``j`` is not in its ``<layer>.gathered_receipt``), computes that layer from the owner's shard:
    every surface of that layer differs on it through no fault of its own. The owner, in another peer group, is
    named there by its local shard. A part received otherwise than its owner holds it is this rank's own fault
    and explains nothing; nor does a receipt this rank could not give."""
    receipts: dict[tuple[int, str], set[int] | None] = {}  # None: no receipt from that rank
    for r in results:
        if r.surface.endswith(GATHERED_RECEIPT):
            layer = r.surface[:-len(GATHERED_RECEIPT)]
            for rank, parts in zip(r.peer_ranks, r.evidence, strict=True):
                receipts[rank, layer] = set(parts) if isinstance(parts, (tuple, list)) else None
    explained: dict[int, set[str]] = {}
    for r in results:
        if GATHERED_SHARD in r.surface and r.status is C3Status.ATTRIBUTED:
            layer, _, part = r.surface.partition(GATHERED_SHARD)
            for rank in r.outlier_ranks:
                otherwise = receipts.get((rank, layer))
                if otherwise is not None and int(part) not in otherwise:
                    explained.setdefault(rank, set()).add(layer + ".")
    if not explained:
        return list(results)
    return [r for r in results
            if r.status is not C3Status.ATTRIBUTED or r.surface.endswith(".local_shard")
            or not all(any(r.surface.startswith(layer) for layer in explained.get(o, ())) for o in r.outlier_ranks)]


def sdc_verdicts(ctx: VerdictContext, result: BoundaryResult, resolved: Collection[str] = ()) -> list[Incident]:
    """One SDC record per set of culprit ranks (all its surfaces in the evidence), one group-scoped record for
    surfaces without a majority, except those the replica group ``resolved`` (see :func:`replica_verdicts`) and
    those a shard-group mate explains (:func:`explained_by_shard_mates`)."""
    incidents = []
    by_ranks, inconclusive = group_disagreements(explained_by_shard_mates(result.surfaces))
    for ranks, rs in by_ranks.items():
        incidents.append(incident(ctx, IncidentKind.SDC, IncidentScope.RANK, ranks, rs,
                                  f"{len(rs)} replayed surface(s) differ from the strict majority"))
    inconclusive = [r for r in inconclusive if r.surface not in resolved]
    if inconclusive:
        group = incident(ctx, IncidentKind.SDC, IncidentScope.PEER_GROUP, ctx.peers, inconclusive,
                         "replayed surfaces disagree without a strict majority")
        if result.replica_surfaces:  # why the replica group did not name a rank instead (replica_verdicts)
            group.evidence["replica_surfaces"] = {
                r.surface: {"status": r.status.value, "peer_ranks": list(r.peer_ranks), "bitmap": list(r.bitmap)}
                for r in result.replica_surfaces}
        incidents.append(group)
    return incidents


def replica_verdicts(ctx: VerdictContext, result: BoundaryResult, untrusted: Collection[int] = ()
                     ) -> tuple[set[str], Records]:
    """Name the ranks the replica group's strict majority sets apart on a hidden layer's output where their
    own peer group has none (two data-parallel replicas under tensor parallelism). Every member of the
    replica group decides alike from the same exchange; its lowest member not named writes the records.
    Returns the surfaces resolved for this rank's own peer group (its no-majority record drops them) and the
    job-wide records. ``untrusted``: the ranks this rank's own group found not to be evidence."""
    untrusted = set(untrusted)
    for res in result.replica_surfaces:
        if res.surface == REPLICA_UNTRUSTED:
            untrusted.update(r for ranks in res.evidence for r in ranks)
    # The replicas' outputs are comparable only while the parameters they hold as copies are the same on
    # all of them: a corrupted step trains those copies apart for good (Megatron keeps tensor-parallel
    # copies equal only by computing the same), and then the replicas disagree without anyone faulty now.
    if any(r.surface.endswith(REPLICATED_STATE) and r.status is not C3Status.AGREE
           for r in result.replica_surfaces):
        return set(), Records([], None, job_wide=True)
    peer_of = {r: g for g in ctx.all_peers for r in g}
    named: dict[tuple[int, ...], list[C3Result]] = {}
    resolved: set[str] = set()
    for res in result.replica_surfaces:
        if (res.status is not C3Status.ATTRIBUTED or untrusted & set(res.peer_ranks)
                or res.surface.endswith(REPLICATED_STATE) or res.surface == REPLICA_UNTRUSTED):
            continue
        value = dict(zip(res.peer_ranks, res.evidence))
        # Only where the culprit's own peer group could not say: otherwise its own verdict stands.
        # (A peer group of one rank compares that rank with nobody: it has no majority.)
        culprits = tuple(r for r in res.outlier_ranks if len(peer_of.get(r, (r,))) < 2
                         or _strict_majority([value[p] for p in peer_of[r]]) is None)
        if culprits:
            named.setdefault(culprits, []).append(res)
            if set(culprits) & set(ctx.peers):
                resolved.add(res.surface)
    records = [incident(ctx, IncidentKind.SDC, IncidentScope.RANK, ranks, rs,
                        f"{len(rs)} replayed output(s) differ from the strict majority of the replica "
                        f"group {list(ctx.replica_ranks)} (its peer group has no majority)")
               for ranks, rs in named.items()]
    culprits_all = {r for ranks in named for r in ranks}
    writer = min((r for r in ctx.replica_ranks if r not in culprits_all), default=None) if records else None
    return resolved, Records(records, writer, job_wide=True)


def vetting_verdicts(ctx: VerdictContext, result: BoundaryResult,
                     new_untrusted: Sequence[tuple[str, tuple[int, ...]]] = (),
                     misconfigured: C3Result | None = None) -> list[Incident]:
    """One ``inconclusive`` record per reason for the ranks newly found not to be evidence (never SDC), and one
    record for an optimizer self-check most peers fail (``misconfigured``, passed once)."""
    out = []
    for reason, ranks in new_untrusted:
        inc = incident(ctx, IncidentKind.INCONCLUSIVE, IncidentScope.RANK, ranks, result.unreliable,
                       UNTRUSTED_REASON[reason])
        inc.evidence["reason"] = reason
        out.append(inc)
    if misconfigured is not None:
        failed = [r for r, ok in zip(misconfigured.peer_ranks, misconfigured.evidence, strict=True) if ok is False]
        inc = incident(
            ctx, IncidentKind.DIAGNOSIS_ERROR, IncidentScope.PEER_GROUP, ctx.peers, [misconfigured],
            f"misconfiguration: the optimizer self-check fails on {len(failed)} of {len(ctx.peers)} peers "
            "(the replayed update does not reproduce the live one: an unsupported optimizer, fused kernel "
            "or schedule); optimizer evidence is not used")
        inc.evidence["reason"] = "misconfiguration"
        out.append(inc)
    return out


def timing_verdicts(ctx: VerdictContext, result: BoundaryResult, found: TimingFindings,
                    incidents: list[Incident]) -> list[Records]:
    """Straggler records of a timed round: appended to this group's ``incidents`` (which also gain the round's
    replay times as evidence), or returned as job-wide records (a job-wide comparison, a named machine)."""
    timing = result.timing
    assert timing is not None
    job: list[Records] = []
    for inc in incidents:  # the round's replay time of every peer, for the report's per-rank heatmap
        if inc.kind is IncidentKind.SDC:
            inc.evidence["timing"] = {timing.surface: timing.to_dict()}
    new = found.new_stragglers
    if new:
        straggler = incident(ctx, IncidentKind.STRAGGLER, IncidentScope.RANK, new, [timing],
                             _straggler_reason(result, found, new))
        straggler.evidence["path"] = {str(r): "persistent" if r in found.by_persistence else "floor" for r in new}
        if found.by_persistence:  # each named rank's average ratio to its peers' median over its rounds
            straggler.evidence["persistent"] = {str(r): round(result.persistent[r], 4) for r in found.by_persistence}
        if result.timing_world:  # every peer group saw the same job-wide verdict: one record for the job
            job.append(Records([straggler], world_writer(new, ctx.world_size), job_wide=True))
        else:
            incidents.append(straggler)
    loc = result.localization
    if loc is not None and found.machine_confirmed:
        machine = incident(ctx, IncidentKind.STRAGGLER, IncidentScope(loc.scope), loc.ranks, [result.comm_timing],
                           f"communication: {loc.reason}")
        machine.hosts = list(loc.hosts)
        machine.evidence["slow_groups"] = [[d, list(g)] for d, g in loc.slow_groups]
        job.append(Records([machine], world_writer(loc.ranks, ctx.world_size), job_wide=True))
    if result.group_slowdown and found.group_slowdown_confirmed:
        incidents.append(incident(
            ctx, IncidentKind.STRAGGLER, IncidentScope.PEER_GROUP, ctx.peers, [result.comm_timing],
            "the whole group's communication is slow against its own clean history; no member is an "
            "outlier (one group spans every peer): inspect the group's fabric"))
    return job


def check_verdicts(ctx: VerdictContext, result: BoundaryResult, *, untrusted: Collection[int] = (),
                   new_untrusted: Sequence[tuple[str, tuple[int, ...]]] = (),
                   misconfigured: C3Result | None = None, timing: TimingFindings | None = None) -> list[Records]:
    """Every record one check calls for, in the order they are written: the replica group's, the job's
    straggler and machine records, last this peer group's own (SDC, set-aside ranks, stragglers).

    Every check's SDC evidence becomes records, also one without the hidden recipe (an embedding or LM-head
    check on its own cadence). ``timing`` is None in a check without a timing round.
    """
    resolved, replica = replica_verdicts(ctx, result, untrusted)
    incidents = sdc_verdicts(ctx, result, resolved) + vetting_verdicts(ctx, result, new_untrusted, misconfigured)
    job = timing_verdicts(ctx, result, timing, incidents) if timing is not None and result.timing is not None else []
    own = Records(incidents, peer_writer(ctx.peers, incidents))
    return [r for r in (replica, *job) if r.incidents] + [own]


def _straggler_reason(result: BoundaryResult, found: TimingFindings, new: Sequence[int]) -> str:
    """Why ``new`` are stragglers: beyond this work's noise floor, or persistently slower than their peers."""
    mild = [r for r in new if r in found.by_persistence]
    fast = [r for r in new if r not in mild]
    parts = []
    if fast:
        parts.append(f"replay compute slower than peers in {found.rounds} consecutive rounds"
                     + (f" (beyond this work's noise floor, {result.noise_floor:.2f}x the median)"
                        if result.noise_floor is not None else "") + (f": rank(s) {fast}" if mild else ""))
    if mild:
        ratios = ", ".join(f"rank {r} {result.persistent[r]:.2f}x" for r in mild)
        parts.append(f"replay compute slower than the same rounds' peers beyond their spread in "
                     f"{found.persist_rounds} consecutive rounds, on average {ratios} their median")
    return "; ".join(parts)
