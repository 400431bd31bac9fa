"""Hang classification from gathered progress evidence (paper section 7). Pure.

Once one observer has seen its trainer silent beyond the threshold, an episode
opens and EVERY observer posts its rank's state, progressing or not. Per
equivalent peer group (:func:`classify_group`, run by one leader per group):

1. exact C3 over the progress coordinate ``(step, i, done)``: ``i`` is the
   rank's point in its step's collective sequence (the oldest collective it
   launched that has not completed, or the last one launched), ``done`` whether
   that one completed;
2. exact C3 over the fingerprint of the collective each rank waits in.

A progress minority is a *lagging* rank when it is behind the majority and
not inside a collective (frozen host thread, blocked before a collective, or
still working while its peers wait for it), a *data stall* or *checkpoint
stall* when its phase is the data loader or checkpoint I/O, and a *protocol
mismatch* otherwise (it is ahead of its peers or waits in a collective they
never entered: control-flow divergence). At equal progress, a silent rank
that is not inside a collective while peers at the same point keep working is
lagging too, and a fingerprint minority is a protocol mismatch (same point,
incompatible collective). Agreement on both, with every peer silent, is an
*equal-progress stall*: the culprit is below the software, and the verdict is
group-scoped for device and fabric diagnosis. A group whose members all keep
working has no verdict.

Ranks whose observers did not answer are *lost*: named per machine when every
rank of a machine is lost. A rank whose trainer exited while a live peer waits in a collective
is *exited*; if anyone is lost, exited trainers are the victims of that loss
(on gloo, a peer's death makes the survivors' collectives fail).

:func:`merge` (run by the episode's reporter on the groups' summaries):
peer groups in which every member agrees while another group names a culprit
are victims and produce no verdict of their own. So are ranks that are behind
their peers only because they wait inside a collective (on another group, e.g.
an HSDP shard group) while a rank elsewhere is named for not reaching one: they
wait for that rank. While some rank is still inside a data fetch or checkpoint
I/O within its tolerance and nobody else is named, ranks waiting behind are not
named either: that rank is judged in the episode its observer opens when the
tolerance ends (:func:`deferred`: the silent observers retry then too).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scout_core.consensus_rules import C3Result, C3Status, exact
from scout_core.progress.record import DDP_REDUCTION, Phase

__all__ = ["Evidence", "HangClass", "HangVerdict", "classify", "classify_group", "deferred", "merge"]


class HangClass(enum.StrEnum):
    LAGGING = "lagging"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    EQUAL_PROGRESS_STALL = "equal_progress_stall"
    DATA_STALL = "data_stall"
    CHECKPOINT_STALL = "checkpoint_stall"
    LOST = "lost"
    EXITED = "exited"
    INCONCLUSIVE = "inconclusive"


# HangClass -> (incident kind, incident scope)
_KIND_SCOPE = {
    HangClass.LAGGING: ("hang", "rank"),
    HangClass.PROTOCOL_MISMATCH: ("hang", "rank"),
    HangClass.EQUAL_PROGRESS_STALL: ("hang", "peer_group"),
    HangClass.DATA_STALL: ("data_stall", "rank"),
    HangClass.CHECKPOINT_STALL: ("checkpoint_stall", "rank"),
    HangClass.LOST: ("hang", "rank"),
    HangClass.EXITED: ("hang", "rank"),
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
    silent: bool = True
    """Silent past its observer's threshold when posted; False: the rank is still making progress."""
    alive: bool = True
    """False once the trainer process is gone (its observer answers for it)."""
    seq: int = 0
    """The record's sequence when posted: the same seq in a later episode means the rank has not moved."""

    @property
    def coordinate(self) -> tuple[int, int, int]:
        return (self.step, self.op_id, 0 if self.pending else 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Evidence:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

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

    scope_override: str = ""
    waits_behind: bool = False
    """Every named rank waits inside a collective behind its group's majority: a victim of a culprit
    elsewhere (set by :func:`classify_group`, read by :func:`merge`)."""

    @property
    def scope(self) -> str:
        return self.scope_override or _KIND_SCOPE[self.hang_class][1]

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.hang_class.value, "ranks": list(self.ranks), "peer_group": list(self.peer_group),
                "reason": self.reason, "evidence": self.evidence, "scope": self.scope_override,
                "waits_behind": self.waits_behind}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HangVerdict:
        return cls(HangClass(d["class"]), tuple(d["ranks"]), tuple(d["peer_group"]), d["reason"],
                   dict(d["evidence"]), d.get("scope", ""), bool(d.get("waits_behind", False)))


_IO_PHASES = (Phase.DATALOADER, Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE)


def _stopped_class(e: Evidence) -> HangClass:
    """A rank that is not where its peers wait, and not inside a collective: by the phase it stopped in."""
    phase = Phase(e.phase)
    if phase is Phase.DATALOADER:
        return HangClass.DATA_STALL
    if phase in (Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE):
        return HangClass.CHECKPOINT_STALL
    return HangClass.LAGGING


def _in_tolerated_io(e: Evidence) -> bool:
    """A live rank inside a data-loader fetch or checkpoint I/O, within the silence tolerated there."""
    return e.alive and not e.silent and not e.pending and Phase(e.phase) in _IO_PHASES


def _minority_class(e: Evidence, majority: tuple[int, int, int]) -> HangClass:
    phase = Phase(e.phase)
    if phase in (Phase.DATALOADER, Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE):
        return _stopped_class(e)
    if e.coordinate < majority and not e.pending:
        return HangClass.LAGGING
    return HangClass.PROTOCOL_MISMATCH


_LISTED_MEMBERS = 64
"""Larger groups post their facts as distinct values with counts: the reporter reads one summary per group,
and its size must not grow with the group (a 100k-rank job has peer groups of thousands)."""


def _compact(facts: dict[str, Any], members: int) -> dict[str, Any]:
    if members <= _LISTED_MEMBERS:
        return facts
    out: dict[str, Any] = {}
    for key, value in facts.items():
        if isinstance(value, (list, tuple)) and len(value) == members:
            counts: dict[str, int] = {}
            for item in value:
                text = json.dumps(item)
                counts[text] = counts.get(text, 0) + 1
            out[key] = {"distinct": [[json.loads(t), n] for t, n in sorted(counts.items(), key=lambda kv: -kv[1])[:8]],
                        "members": members}
        else:
            out[key] = value
    return out


_DOING = {Phase.FORWARD: "in the forward pass", Phase.BACKWARD: "in the backward pass",
          Phase.OPTIMIZER: "in the optimizer step", Phase.STEP_END: "between steps"}


def where_in_words(e: Evidence) -> str:
    """Where a rank is, in plain words: the step it is running (its count of finished steps, plus one) and what it
    was doing at its last published point (inside which collective, in the data loader, in a checkpoint, or in
    Python and compute outside any collective)."""
    phase = Phase(e.phase)
    if e.pending:
        what = f"waiting inside collective {e.op_id} of the step" + (f" ({e.fingerprint})" if e.fingerprint else "")
    elif phase is Phase.DATALOADER:
        what = "in the data loader"
    elif phase in (Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE):
        what = f"{'reading' if phase is Phase.CHECKPOINT_READ else 'writing'} a checkpoint"
    elif phase is Phase.STARTING:
        what = "before its first published point"
    elif phase is Phase.CLOSED:
        what = "closed"
    else:
        after = f"after collective {e.op_id} of the step" if e.op_id else "before any collective of the step"
        what = f"{_DOING.get(phase, 'in compute or Python code')}, outside any collective, {after}"
    return f"step {e.step + 1}, {what}"


def _peers_at(coordinate: Sequence[int]) -> str:
    """The majority's place, in plain words (a coordinate is finished steps, collective, 0 while inside it)."""
    step, op, done = coordinate[:3]
    if not op:
        return f"its peers are at the start of step {step + 1}"
    return f"its peers are {'inside' if not done else 'past'} collective {op} of step {step + 1}"


def _named(cls: HangClass, ranks: list[int], group: Sequence[int], evidence: Mapping[int, Evidence],
           facts: dict[str, Any], peers: str) -> HangVerdict:
    where = ", ".join(f"r{r} in {where_in_words(evidence[r])} (last progress {evidence[r].silent_s:.1f} s ago)"
                      for r in ranks)
    return HangVerdict(cls, tuple(ranks), tuple(group), f"{cls.value.replace('_', ' ')}: {where}; {peers}", facts)


def _member_facts(ev: Sequence[Evidence], ranks: list[int]) -> dict[str, Any]:
    """What a group's verdict shows of its live members, one list entry per member."""
    return {
        "peer_ranks": ranks,
        "coordinates": [list(e.coordinate) for e in ev],
        "phases": [Phase(e.phase).name.lower() for e in ev],
        "pending": [e.pending for e in ev],
        "silent": [e.silent for e in ev],
        "silent_s": [e.silent_s for e in ev],
        "fingerprints": [e.fingerprint if e.pending else "" for e in ev],
    }


def _progress_minority_verdicts(progress: C3Result, ev: Sequence[Evidence], group: Sequence[int],
                                evidence: Mapping[int, Evidence], facts: dict[str, Any]) -> list[HangVerdict]:
    """One verdict per class of the ranks off the progress majority. A protocol mismatch whose every rank waits
    inside a collective behind the majority ``waits_behind`` it (:func:`merge` reads that)."""
    majority = progress.reference
    by_class: dict[HangClass, list[int]] = {}
    for e in ev:
        if e.rank in progress.outlier_ranks:
            by_class.setdefault(_minority_class(e, majority), []).append(e.rank)
    out: list[HangVerdict] = []
    for cls, named in by_class.items():
        v = _named(cls, named, group, evidence, facts, _peers_at(majority))
        behind = cls is HangClass.PROTOCOL_MISMATCH and all(
            evidence[r].pending and evidence[r].coordinate < tuple(majority) for r in named)
        out.append(HangVerdict(v.hang_class, v.ranks, v.peer_group, v.reason, v.evidence, waits_behind=behind))
    return out


def _group_verdicts(group: Sequence[int], evidence: Mapping[int, Evidence]) -> list[HangVerdict]:
    members = [r for r in group if r in evidence]
    live = [evidence[r] for r in members if evidence[r].alive]
    gone = [r for r in members if not evidence[r].alive]
    waiting = [e for e in live if e.silent]
    out: list[HangVerdict] = []
    # Named only when a live member waits in a collective (that the gone ranks will never join): a member
    # silent outside any collective is stuck on its own, and the exit was an ordinary one.
    if gone and any(e.pending for e in waiting):
        out.append(HangVerdict(HangClass.EXITED, tuple(gone), tuple(group),
                               f"the trainers of ranks {gone} exited while their peers wait",
                               {"exited": gone, "waiting": [e.rank for e in waiting]}))
    if not waiting:
        return out  # everyone here is working (or gone): nobody in this group waits
    if any(_in_tolerated_io(e) for e in live):
        # A member is still in a data-loader fetch or a checkpoint read/write, within the silence tolerated
        # there: a rank-0-only save with its peers at a barrier, or a rank that finished its shard first.
        return out
    ev = live
    ranks = [e.rank for e in ev]
    facts = _member_facts(ev, ranks)
    progress = exact([e.coordinate for e in ev], peer_ranks=ranks, surface="progress")
    facts["progress_c3"] = _compact(progress.to_dict(), len(ev))
    if len(ev) > _LISTED_MEMBERS:
        facts = _compact(facts, len(ev))
    if progress.status is C3Status.ATTRIBUTED:
        return out + _progress_minority_verdicts(progress, ev, group, evidence, facts)
    if progress.status is C3Status.INCONCLUSIVE and len(ev) == 2:
        # Two peers (HSDP with 2 replicas, DP 2 under TP/PP) have no majority, but one that waits silently
        # in a collective while the other is behind it outside any collective waits for that other one.
        a, b = sorted(ev, key=lambda e: e.coordinate)
        if b.pending and b.silent and not a.pending:
            return out + [_named(_stopped_class(a), [a.rank], group, evidence, facts,
                                 f"r{b.rank} waits for it, in {where_in_words(b)}")]
    if progress.status is C3Status.INCONCLUSIVE:
        return out + [HangVerdict(HangClass.INCONCLUSIVE, tuple(ranks), tuple(group),
                                  "peers stopped at different points without a strict majority", facts)]
    stuck = [e.rank for e in waiting if not e.pending]
    if len(waiting) < len(ev) and stuck:
        # Same point, but some peers keep working while these are silent outside any collective.
        by_class: dict[HangClass, list[int]] = {}
        for r in stuck:
            by_class.setdefault(_stopped_class(evidence[r]), []).append(r)
        return out + [_named(cls, named, group, evidence, facts, "peers at the same point keep working")
                      for cls, named in by_class.items()]
    fps = exact([(e.pending, e.fp_hash if e.pending else 0) for e in ev], peer_ranks=ranks, surface="fingerprint")
    facts["fingerprint_c3"] = _compact(fps.to_dict(), len(ev))
    if fps.status is C3Status.ATTRIBUTED:
        bad = fps.outlier_ranks
        what = "; ".join(f"r{r}: {evidence[r].fingerprint or 'not in a collective'}" for r in bad)
        return out + [HangVerdict(HangClass.PROTOCOL_MISMATCH, tuple(bad), tuple(group),
                                  f"collective metadata differs from the majority ({what})", facts)]
    if fps.status is C3Status.INCONCLUSIVE:
        return out + [HangVerdict(HangClass.INCONCLUSIVE, tuple(ranks), tuple(group),
                                  "fingerprints disagree without a strict majority", facts)]
    if len(waiting) < len(ev):
        return out  # same point, same collective, some still working: not a stall of this group
    where = f"({where_in_words(ev[0])})"
    if gone and not any(e.pending for e in ev):
        if all(Phase(evidence[r].phase) is Phase.CLOSED for r in gone):
            return out  # the others closed SCOUT in order (the job ended): nobody waits for them
        # They may wait for the crashed ranks outside any collective we see (a store wait, a file barrier):
        # "below the software" would send the operator to the hardware.
        return out + [HangVerdict(HangClass.INCONCLUSIVE, tuple(ranks), tuple(group),
                                  f"every live peer is silent at the same point {where}, outside any collective, "
                                  f"while the trainers of ranks {gone} exited", {**facts, "exited": gone})]
    if ev[0].pending and ev[0].fingerprint.startswith(DDP_REDUCTION):
        # DDP's reduction is published per backward, not per bucket (observer.ddp_bucket_hook off): a rank stopped
        # in its backward launched it as its peers did, and is not told apart from them.
        return out + [HangVerdict(HangClass.EQUAL_PROGRESS_STALL, tuple(ranks), tuple(group),
                                  f"every peer stopped inside DDP's backward gradient reduction {where}: a transport "
                                  "stall, or a rank stopped in its backward computation (observer.ddp_bucket_hook "
                                  "publishes each bucket and names such a rank)", facts)]
    return out + [HangVerdict(HangClass.EQUAL_PROGRESS_STALL, tuple(ranks), tuple(group),
                              f"every peer waits at the same point {where}: runtime or transport stall", facts)]


def classify_group(group: Sequence[int], evidence: Mapping[int, Evidence]) -> dict[str, Any]:
    """One peer group's summary (what its leader posts): verdicts, lost ranks, where the named ranks stand."""
    verdicts = _group_verdicts(group, evidence)
    # Where a named rank stands (its progress coordinate), not its record's sequence: a lagging rank that is
    # still working publishes all the while, and a peer that went silent later must not name it again.
    named = {str(r): list(evidence[r].coordinate) for v in verdicts for r in v.ranks if r in evidence}
    # The collectives that live members wait in without being silent yet (at most a few, whatever the group
    # size): another group's stall in one of them is not settled while these members may still be named.
    unsettled = sorted({e.fingerprint for r in group if (e := evidence.get(r)) is not None
                        and e.alive and e.pending and not e.silent})[:8]
    in_io = any(_in_tolerated_io(e) for r in group if (e := evidence.get(r)) is not None)
    return {"group": list(group), "lost": [r for r in group if r not in evidence],
            "verdicts": [v.to_dict() for v in verdicts], "named": named, "unsettled": unsettled, "in_io": in_io}


def _lost_verdicts(lost: Sequence[int], hosts: Mapping[int, str], answered: int) -> list[HangVerdict]:
    by_host: dict[str, list[int]] = {}
    for r in lost:
        by_host.setdefault(hosts.get(r, f"rank-{r}"), []).append(r)
    machine_ranks: dict[str, list[int]] = {}
    for r, h in hosts.items():
        machine_ranks.setdefault(h, []).append(r)
    out, single = [], []
    for host, ranks in sorted(by_host.items(), key=lambda kv: kv[1][0]):
        if len(machine_ranks.get(host, [])) > 1 and sorted(ranks) == sorted(machine_ranks[host]):
            out.append(HangVerdict(HangClass.LOST, tuple(ranks), tuple(ranks),
                                   f"machine {host} lost: no answer from the observers of any of its ranks "
                                   f"{list(ranks)}", {"host": host, "answered": answered}, scope_override="machine"))
        else:
            single.extend(ranks)
    if single:
        out.insert(0, HangVerdict(HangClass.LOST, tuple(sorted(single)), tuple(sorted(single)),
                                  f"no answer from the observers of ranks {sorted(single)}: trainer and observer "
                                  "gone or unreachable", {"answered": answered}))
    return out


def merge(summaries: Sequence[Mapping[str, Any]], hosts: Mapping[int, str] | None = None) -> list[HangVerdict]:
    """The episode's verdicts from every group's summary; identical for identical input."""
    lost = sorted(r for s in summaries for r in s["lost"])
    answered = sum(len(s["group"]) - len(s["lost"]) for s in summaries)
    verdicts = _lost_verdicts(lost, hosts or {}, answered) if lost else []
    per_group = [[HangVerdict.from_dict(v) for v in s["verdicts"]] for s in summaries]
    if lost:  # survivors whose trainers died with the lost ones are victims
        per_group = [[v for v in vs if v.hang_class is not HangClass.EXITED] for vs in per_group]
    culprits = [v for vs in per_group for v in vs
                if v.hang_class not in (HangClass.EQUAL_PROGRESS_STALL, HangClass.INCONCLUSIVE)]
    if culprits:
        roots = [v for v in culprits if not v.waits_behind]
        # Groups that merely wait are victims of the named ranks, and so are ranks that wait behind. With nobody
        # else named, ranks waiting behind may wait for a rank still inside a data fetch or checkpoint I/O within
        # its tolerance (HSDP: rank 9's fetch stalls, its shard-group mates wait in an all-gather behind their
        # replicate peers and cross their threshold first): nobody is named yet; the fetching rank's observer opens
        # the next episode when its tolerance ends, and the waiting ones retry then (:func:`deferred`).
        if roots or lost or not any(s.get("in_io") for s in summaries):
            return verdicts + (roots or culprits)
        return verdicts
    if lost:
        return verdicts  # survivors waiting on a lost peer are victims too
    inconclusive = [v for vs in per_group for v in vs if v.hang_class is HangClass.INCONCLUSIVE]
    if inconclusive:
        return inconclusive
    # "Every peer waits at the same point" means no software culprit anywhere, which cannot be concluded while
    # ranks of another group wait in the same collective without being silent yet: the first of them past its
    # threshold opens the next episode, where they are judged (a rank among them with other metadata would be
    # named there, and this group is its victim). Matched by fingerprint, so ranks in unrelated collectives
    # never postpone a real stall.
    unsettled = {f for s in summaries for f in s.get("unsettled", [])}
    return [v for vs in per_group for v in vs
            if not (v.hang_class is HangClass.EQUAL_PROGRESS_STALL and unsettled & _fingerprints(v))]


def deferred(summaries: Sequence[Mapping[str, Any]], verdicts: Sequence[HangVerdict]) -> bool:
    """An episode without a verdict while some rank was inside tolerated I/O: its silent observers try again once
    that tolerance has passed (the rank may have left its I/O by closing, and opens no episode of its own then)."""
    return not verdicts and any(s.get("in_io") for s in summaries)


def _fingerprints(verdict: HangVerdict) -> set[str]:
    """The collectives a verdict's members wait in (its facts list them, or count them in a large group)."""
    listed = verdict.evidence.get("fingerprints", [])
    if isinstance(listed, Mapping):  # compacted: {"distinct": [[value, count], ...], "members": n}
        listed = [value for value, _n in listed.get("distinct", [])]
    return {str(f) for f in listed if f}


def classify(
    evidence: Mapping[int, Evidence],
    peer_groups: Sequence[Sequence[int]],
    hosts: Mapping[int, str] | None = None,
) -> list[HangVerdict]:
    """Verdicts for one stall episode; identical on every observer for identical input."""
    return merge([classify_group(g, evidence) for g in peer_groups], hosts)
