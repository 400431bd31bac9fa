"""What one expert check found (:class:`ExpertCheck`) and the incident records it makes: per expert-peer group,
and job-wide for the AllToAll replay's transfers and timings, each written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from scout_core.consensus import C3Result, C3Status, group_disagreements
from scout_core.replay.result import SurfaceVerdicts
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter

__all__ = ["ExpertCheck", "ExpertVerdicts"]


@dataclass
class ExpertCheck(SurfaceVerdicts):
    """One expert check on this rank (``sdc`` and ``inconclusive`` read as a dense boundary's)."""

    step: int
    layer: str
    expert: int
    rows: int
    source: int
    surfaces: list[C3Result] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    skipped: str = ""
    unit: int = -1
    """This check's place in the recipe cycle (certification's unit ``("expert", unit)``)."""
    localization: Any = None
    """A confirmed slow machine or group from the AllToAll replay's timings (``topology.Localization``)."""
    transfers: list[Any] = field(default_factory=list)
    """Endpoints of odd AllToAll transfers (``alltoall.TransferVerdict``), the same on every rank."""
    untrusted: dict[int, str] = field(default_factory=dict)
    """Expert peers whose replay is not evidence (``nondeterministic`` or ``environment``), found now."""
    unreliable: list[C3Result] = field(default_factory=list)
    """Disagreements set aside because a rank that is not evidence took part (never SDC)."""


class ExpertVerdicts:
    """The verdicts of this rank's expert checks, and which rank writes each record."""

    def __init__(self, *, rank: int, peers: Sequence[int], hosts: dict[int, str], reporter: Reporter | None) -> None:
        self.rank, self.peers, self.hosts, self.reporter = rank, peers, hosts, reporter
        self.reported: set[tuple[int, str]] = set()
        """(rank, reason) pairs already recorded ``inconclusive``: one record per rank and reason."""

    def judge(self, result: ExpertCheck) -> list[Incident]:
        """This expert group's verdicts (reported by its lowest rank not named) and the job-wide ones from the
        AllToAll replay (reported once, by the lowest rank of the job not named)."""
        # An odd AllToAll transfer makes its receiver the odd one among its replicas whichever endpoint did
        # it: those are judged job-wide (result.transfers), not per receiver.
        own = [r for r in result.surfaces
               if not (r.surface.startswith("alltoall.") and r.status is C3Status.ATTRIBUTED)]
        by_ranks, groupwide = group_disagreements(own)
        rows = f" ({result.rows} rows)" if result.rows >= 0 else ""
        out = [self._incident(IncidentScope.RANK, ranks, rs, f"expert replay: {len(rs)} surface(s) differ from "
                              f"the strict majority of the expert's replicas{rows}")
               for ranks, rs in by_ranks.items()]
        if groupwide:
            out.append(self._incident(IncidentScope.PEER_GROUP, self.peers, groupwide,
                                      "expert replay: the expert's replicas disagree without a strict majority"))
        out += self._vetting_verdicts(result)
        named = {r for i in out if i.scope is IncidentScope.RANK for r in i.ranks}
        reporter = min((r for r in self.peers if r not in named), default=min(self.peers))
        if out and self.rank == reporter and self.reporter is not None:
            for inc in out:
                inc.step = result.step
                self.reporter.emit(inc)
        return out + self._job_verdicts(result)

    def _job_verdicts(self, result: ExpertCheck) -> list[Incident]:
        """The AllToAll replay's odd transfers and confirmed slow group, the same on every rank: written once."""
        job = [Incident(kind=IncidentKind.SDC, scope=IncidentScope(t.scope), ranks=list(t.ranks),
                        hosts=[self.hosts.get(r, "?") for r in t.ranks], step=result.step,
                        surface="alltoall.transfers", evidence={"transfers": [list(x) for x in t.transfers]},
                        reason=t.reason) for t in result.transfers]
        loc = result.localization
        if loc is not None:
            job.append(Incident(kind=IncidentKind.STRAGGLER, scope=IncidentScope(loc.scope), ranks=list(loc.ranks),
                                hosts=list(loc.hosts), step=result.step, surface="alltoall.comm_s",
                                evidence={"slow_groups": [[d, list(g)] for d, g in loc.slow_groups]},
                                reason=f"AllToAll replay with one plan: {loc.reason}"))
        if job:  # the same on every rank: one record for the job
            named = {r for inc in job for r in inc.ranks}
            writer = min((r for r in range(dist.get_world_size()) if r not in named), default=0)
            if self.rank == writer and self.reporter is not None:
                for inc in job:
                    self.reporter.emit(inc)
        return job

    _UNTRUSTED_REASON = {
        "nondeterministic": "nondeterministic: the expert replayed twice on this rank signed differently, so its "
                            "replay cannot be compared bitwise",
        "environment": "environment: this rank replays the expert with other software, hardware or precision "
                       "settings than its replicas' majority, so equal inputs need not give equal bits",
    }

    def _vetting_verdicts(self, result: ExpertCheck) -> list[Incident]:
        """A rank that is not evidence: one ``inconclusive`` record per rank and reason, never SDC."""
        out = []
        for reason, text in self._UNTRUSTED_REASON.items():
            new = tuple(sorted(r for r, why in result.untrusted.items()
                               if why == reason and (r, reason) not in self.reported))
            if new:
                self.reported.update((r, reason) for r in new)
                inc = self._incident(IncidentScope.RANK, new, result.unreliable, text, kind=IncidentKind.INCONCLUSIVE)
                inc.evidence["reason"] = reason
                out.append(inc)
        return out

    def _incident(self, scope: IncidentScope, ranks: Sequence[int], results: Sequence[C3Result],
                  reason: str, *, kind: IncidentKind = IncidentKind.SDC) -> Incident:
        return Incident(kind=kind, scope=scope, ranks=list(ranks), step=None,
                        hosts=[self.hosts.get(r, "?") for r in ranks],
                        surface=";".join(r.surface for r in results),
                        evidence={"surfaces": {r.surface: r.to_dict() for r in results}}, reason=reason)
