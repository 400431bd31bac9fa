"""Hang classification from gathered progress evidence (paper section 7). Pure.

After visible progress has been silent beyond the threshold, every observer
holds the same gathered evidence and runs :func:`classify`, so every observer
derives the same verdicts. Per equivalent peer group:

1. exact C3 over the progress coordinate ``(step, op_id)``;
2. exact C3 over the pending collective fingerprint.

A progress minority is a *lagging* rank when it is behind the majority and
not inside a collective (frozen host thread, blocked before a collective), a
*data stall* or *checkpoint stall* when its phase is the data loader or
checkpoint I/O, and a *protocol mismatch* otherwise (it is ahead of its peers
or waits in a collective they never entered: control-flow divergence). A
fingerprint minority at equal progress is a protocol mismatch (same point,
incompatible collective). Agreement on both is an *equal-progress stall*:
every peer waits at the same point, so the culprit is below the software, and
the verdict is group-scoped for device and fabric diagnosis. Ranks whose
observers did not answer are *lost* and are named as such.

Peer groups in which every member agrees while another group names a culprit
are victims and produce no verdict of their own. So are ranks that are behind
their peers only because they wait inside a collective (on another group, e.g.
an HSDP shard group) while a rank elsewhere is named for not reaching one: they
wait for that rank.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scout_core.consensus import C3Status, exact
from scout_core.progress.record import Phase

__all__ = ["Evidence", "HangClass", "HangVerdict", "classify"]


class HangClass(enum.StrEnum):
    LAGGING = "lagging"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    EQUAL_PROGRESS_STALL = "equal_progress_stall"
    DATA_STALL = "data_stall"
    CHECKPOINT_STALL = "checkpoint_stall"
    LOST = "lost"
    INCONCLUSIVE = "inconclusive"


# HangClass -> (incident kind, incident scope)
_KIND_SCOPE = {
    HangClass.LAGGING: ("hang", "rank"),
    HangClass.PROTOCOL_MISMATCH: ("hang", "rank"),
    HangClass.EQUAL_PROGRESS_STALL: ("hang", "peer_group"),
    HangClass.DATA_STALL: ("data_stall", "rank"),
    HangClass.CHECKPOINT_STALL: ("checkpoint_stall", "rank"),
    HangClass.LOST: ("hang", "rank"),
    HangClass.INCONCLUSIVE: ("hang", "peer_group"),
}


@dataclass(frozen=True)
class Evidence:
    """What one observer posts for its rank."""

    rank: int
    step: int
    op_id: int
    phase: int
    pending: bool
    fp_hash: int
    fingerprint: str
    silent_s: float

    @property
    def coordinate(self) -> tuple[int, int]:
        return (self.step, self.op_id)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Evidence:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class HangVerdict:
    hang_class: HangClass
    ranks: tuple[int, ...]
    peer_group: tuple[int, ...]
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return _KIND_SCOPE[self.hang_class][0]

    @property
    def scope(self) -> str:
        return _KIND_SCOPE[self.hang_class][1]


def _minority_class(e: Evidence, majority: tuple[int, int]) -> HangClass:
    phase = Phase(e.phase)
    if phase is Phase.DATALOADER:
        return HangClass.DATA_STALL
    if phase in (Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE):
        return HangClass.CHECKPOINT_STALL
    if e.coordinate < majority and not e.pending:
        return HangClass.LAGGING
    return HangClass.PROTOCOL_MISMATCH


def _group_verdicts(group: Sequence[int], evidence: Mapping[int, Evidence]) -> list[HangVerdict]:
    members = [r for r in group if r in evidence]
    if not members:
        return []
    ev = [evidence[r] for r in members]
    facts = {
        "peer_ranks": members,
        "coordinates": [list(e.coordinate) for e in ev],
        "phases": [Phase(e.phase).name.lower() for e in ev],
        "pending": [e.pending for e in ev],
        "fingerprints": [e.fingerprint if e.pending else "" for e in ev],
    }
    progress = exact([e.coordinate for e in ev], peer_ranks=members, surface="progress")
    facts["progress_c3"] = progress.to_dict()
    if progress.status is C3Status.ATTRIBUTED:
        majority = progress.reference
        by_class: dict[HangClass, list[int]] = {}
        for e in ev:
            if e.rank in progress.outlier_ranks:
                by_class.setdefault(_minority_class(e, majority), []).append(e.rank)
        out = []
        for cls, ranks in by_class.items():
            where = ", ".join(f"r{r} at {evidence[r].coordinate} ({Phase(evidence[r].phase).name.lower()})"
                              for r in ranks)
            out.append(HangVerdict(cls, tuple(ranks), tuple(group),
                                   f"{cls.value.replace('_', ' ')}: {where}; peers wait at {tuple(majority)}", facts))
        return out
    if progress.status is C3Status.INCONCLUSIVE:
        return [HangVerdict(HangClass.INCONCLUSIVE, tuple(members), tuple(group),
                            "peers stopped at different points without a strict majority", facts)]
    fps = exact([(e.pending, e.fp_hash if e.pending else 0) for e in ev], peer_ranks=members, surface="fingerprint")
    facts["fingerprint_c3"] = fps.to_dict()
    if fps.status is C3Status.ATTRIBUTED:
        bad = fps.outlier_ranks
        what = "; ".join(f"r{r}: {evidence[r].fingerprint or 'not in a collective'}" for r in bad)
        return [HangVerdict(HangClass.PROTOCOL_MISMATCH, tuple(bad), tuple(group),
                            f"collective metadata differs from the majority ({what})", facts)]
    if fps.status is C3Status.INCONCLUSIVE:
        return [HangVerdict(HangClass.INCONCLUSIVE, tuple(members), tuple(group),
                            "fingerprints disagree without a strict majority", facts)]
    where = f"{tuple(ev[0].coordinate)} in {ev[0].fingerprint or Phase(ev[0].phase).name.lower()}"
    return [HangVerdict(HangClass.EQUAL_PROGRESS_STALL, tuple(members), tuple(group),
                        f"every peer waits at the same point {where}: runtime or transport stall", facts)]


def _waits_behind(v: HangVerdict, evidence: Mapping[int, Evidence]) -> bool:
    """Every rank of ``v`` sits inside a collective BEHIND its group's majority: it waits for someone."""
    if v.hang_class is not HangClass.PROTOCOL_MISMATCH:
        return False
    majority = v.evidence.get("progress_c3", {}).get("reference")
    if majority is None:
        return False
    return all(evidence[r].pending and evidence[r].coordinate < tuple(majority) for r in v.ranks)


def classify(
    evidence: Mapping[int, Evidence],
    peer_groups: Sequence[Sequence[int]],
) -> list[HangVerdict]:
    """Verdicts for one stall episode; identical on every observer for identical input."""
    expected = sorted({r for g in peer_groups for r in g})
    lost = tuple(r for r in expected if r not in evidence)
    verdicts: list[HangVerdict] = []
    if lost:
        verdicts.append(HangVerdict(
            HangClass.LOST, lost, tuple(expected),
            f"no answer from the observers of ranks {list(lost)}: trainer and observer gone or unreachable",
            {"answered": sorted(evidence)},
        ))
    per_group = [_group_verdicts(g, evidence) for g in peer_groups]
    culprits = [v for vs in per_group for v in vs
                if v.hang_class not in (HangClass.EQUAL_PROGRESS_STALL, HangClass.INCONCLUSIVE)]
    if culprits:
        roots = [v for v in culprits if not _waits_behind(v, evidence)]
        # groups that merely wait are victims of the named ranks, and so are ranks that wait behind
        return verdicts + (roots or culprits)
    if lost:
        return verdicts  # survivors waiting on a lost peer are victims too
    inconclusive = [v for vs in per_group for v in vs if v.hang_class is HangClass.INCONCLUSIVE]
    if inconclusive:
        return inconclusive
    return [v for vs in per_group for v in vs]
