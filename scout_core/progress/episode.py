"""One hang episode over the control store: who posts, who classifies, who reports (paper section 7).

Keys, under the job's prefix (``scout/<run id>/``):

* ``ep``: the current episode number; the reporter advances it after a verdict;
* ``ep/<n>/open``: set by the first observer whose trainer went silent;
* ``ep/<n>/r/<rank>``: that rank's evidence; every observer posts one, working or not;
* ``ep/<n>/g/<gid>/lead`` and ``ep/<n>/g/<gid>``: the first member of peer group ``gid``
  to post leads it: it reads the group's evidence (waiting at most ``gather_timeout_s``;
  members still silent then are lost) and posts the group's summary;
* ``ep/<n>/lead`` and ``ep/<n>/verdict``: the first observer to post reports: it reads
  the summaries, merges them, writes the records and posts the verdict that every
  observer reads for its user callback;
* ``ep/<n>/moved``: the observers whose trainer moved after the verdict (sealed entries); the
  reporter writes a ``resolved`` record once there is one;
* ``named``: ranks named by the last verdict with their progress coordinate, so that a later
  episode over the same stopped ranks (peers that went silent later) does not repeat it, even where a named
  rank is still working (publishing) at that point;
* ``closed``: the list of ranks whose trainers closed SCOUT (each entry sealed; a rank may appear twice after a
  retried close); a leader counts them gone, not lost, and does not wait for them.

Costs per episode: every observer posts once and reads the verdict (O(1)); a group leader
reads its group (O(peer group)); the reporter reads one summary per group. While healthy an
observer sends one ``check`` of ``ep/<n>/open`` per heartbeat and nothing else.

Leadership is first come, first served (``compare_set`` on an absent key): no observer is
special, so the death of any rank, rank 0 included, leaves the protocol whole.

Evidence, summaries, the verdict, ``named``, ``ep``, the opener, ``moved`` and the closed list are sealed with
the job's secret (:mod:`scout_core.progress.sealed`): a value someone outside the job wrote makes its episode's
verdict name nobody and say so, and never stops a trainer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from scout_core.progress.classify import Evidence, HangClass, HangVerdict, classify_group, deferred, merge
from scout_core.progress.record import Phase
from scout_core.progress.sealed import TamperedValue, seal, seal_entry, unseal, unseal_entries
from scout_core.progress.store_client import store_timeouts

__all__ = ["CLOSED_LIST", "EpisodeProtocol", "EpisodeOutcome", "tampered_verdict"]

CLOSED_LIST = "closed"
"""Comma-separated ranks whose trainer closed SCOUT (each observer appends its own once)."""


@dataclass
class EpisodeOutcome:
    episode: int
    verdicts: list[HangVerdict]
    reporter: bool
    """This observer reported the episode (wrote the records)."""
    repeat: bool = False
    """The verdict names the same stopped ranks as the last one: not written again."""
    deferred: bool = False
    """No verdict while a rank was inside tolerated I/O: the silent observers try again after that tolerance."""
    evidence: dict[str, Any] = field(default_factory=dict)


class EpisodeProtocol:
    """The store side of one observer; every method is a bounded number of store messages."""

    def __init__(self, store: Any, *, rank: int, peer_groups: Sequence[Sequence[int]], hosts: Mapping[int, str],
                 gather_timeout_s: float, heartbeat_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 gid: int | None = None, secret: str = "") -> None:
        self.store = store
        self.secret = secret  # the job's: seals what a verdict is built from (empty: the in-process simulations)
        self.rank = rank
        self.groups = peer_groups  # shared, never copied: a 100k-rank simulation holds 100k of these
        self.gid = gid if gid is not None else next(i for i, g in enumerate(peer_groups) if rank in g)
        self.hosts = hosts
        self.gather_timeout_s = gather_timeout_s
        self.heartbeat_s = heartbeat_s
        # Observers learn of an episode up to one heartbeat apart; a leader waits gather_timeout_s from its own
        # post, so whoever waits for a leader allows that much more (and a margin for the leader's own work).
        self.leader_slack_s = 2 * heartbeat_s + 2.0
        self.clock = clock
        self.episode = 0
        self.episode = self._counter()

    def _counter(self) -> int:
        """The job's episode number, sealed, read without ``add`` (the server drops a client that adds to a key
        someone set to a non-number). Created as 0 where absent. A value that does not verify leaves ours, and
        the callers never go back below theirs: a counter set ahead by an outsider would split the observers
        between two episodes (each side naming the other lost); one wound back would replay an old verdict."""
        raw = self.store.compare_set("ep", "", seal(self.secret, "ep", "0"))
        try:
            return int(unseal(self.secret, "ep", raw))
        except (TamperedValue, TypeError, ValueError):
            return self.episode

    def _advance(self, n: int) -> None:
        """Episode ``n`` is over: the job's counter moves to ``n + 1`` (if nobody moved it already)."""
        self.store.compare_set("ep", seal(self.secret, "ep", str(n)), seal(self.secret, "ep", str(n + 1)))

    # -- healthy path ------------------------------------------------------------------------------

    def opened(self) -> bool:
        """The heartbeat: one ``check``. True when episode ``self.episode`` is open (by one of the job's own
        observers: the opener's rank is sealed, so nobody outside the job opens episodes at will)."""
        key = f"ep/{self.episode}/open"
        if not self.store.check([key]):
            return False
        try:
            unseal(self.secret, key, self.store.get(key))
        except TamperedValue:
            return False
        return True

    def open(self) -> None:
        key = f"ep/{self.episode}/open"
        self.store.compare_set(key, "", seal(self.secret, key, str(self.rank)))

    # -- one episode -----------------------------------------------------------------------------

    def run(self, mine: Evidence) -> EpisodeOutcome | None:
        """Post our evidence, lead or report if first, and return the verdict (None: no verdict came)."""
        n = self.episode
        if self.store.check([f"ep/{n}/verdict"]):  # we arrived after it was decided
            return self._finish(n, self._read_verdict(n), reporter=False)
        start = self.post(mine)
        leads, reports = self.claim(n)
        if leads:
            self.lead_group(n, start)
        if reports:
            return self.report(n, start)
        return self.await_verdict(n, start)

    # The steps of run(), apart so that the scale simulation can drive thousands of observers in order.

    def post(self, mine: Evidence) -> float:
        self._put(f"ep/{self.episode}/r/{self.rank}", mine.to_dict())
        return self.clock()

    def _put(self, key: str, doc: Any) -> None:
        self.store.set(key, seal(self.secret, key, json.dumps(doc, sort_keys=True)))

    def _read(self, key: str, raw: bytes) -> Any:
        """A value this job's observers wrote under ``key``; TamperedValue where someone else wrote it."""
        return json.loads(unseal(self.secret, key, raw))

    def claim(self, n: int) -> tuple[bool, bool]:
        """First come, first served: (we lead our group, we report the episode)."""
        return self._claim(f"ep/{n}/g/{self.gid}/lead"), self._claim(f"ep/{n}/lead")

    def await_verdict(self, n: int, start: float) -> EpisodeOutcome | None:
        if not self._wait_for([f"ep/{n}/verdict"], start + 2 * (self.gather_timeout_s + self.leader_slack_s)):
            # The reporter died mid-episode: move on so that a later stall gets a fresh round. Never back to an
            # earlier episode (an old genuine counter value put back must not make its verdict be read again).
            self._advance(n)
            self.episode = max(self.episode, n + 1, self._counter())
            return None
        return self._finish(n, self._read_verdict(n), reporter=False)

    def _claim(self, key: str) -> bool:
        return self.store.compare_set(key, "", str(self.rank)) == str(self.rank).encode()

    def _wait_for(self, keys: list[str], deadline: float) -> bool:
        """Block until every key exists (one ``wait``, served by the store, not a polling loop) or the deadline."""
        remaining = deadline - self.clock()
        if remaining <= 0:
            return bool(self.store.check(keys))
        try:
            self.store.wait(keys, timedelta(seconds=remaining))
            return True
        except store_timeouts():
            return bool(self.store.check(keys))

    def lead_group(self, n: int, start: float) -> None:
        self._put(f"ep/{n}/g/{self.gid}", self._summarize(n, self.gid, start + self.gather_timeout_s))

    def _summarize(self, n: int, gid: int, deadline: float) -> dict[str, Any]:
        group = self.groups[gid]
        # Members whose trainer closed SCOUT (the job ended there, or it closed after its collective failed)
        # are gone, not lost, and not waited for: one read of the job's list of closed ranks.
        closed = self._closed_ranks()
        waited = [r for r in group if r not in closed]
        keys = [f"ep/{n}/r/{r}" for r in waited]
        if not keys or self._wait_for(keys, deadline):
            present = waited
        else:
            present = [r for r, k in zip(waited, keys, strict=True) if self.store.check([k])]
        present += [r for r in group if r in closed and self.store.check([f"ep/{n}/r/{r}"])]  # posted at close
        values = self.store.multi_get([f"ep/{n}/r/{r}" for r in present]) if present else []
        evidence, tampered = {}, []
        for r, v in zip(present, values, strict=True):
            try:
                evidence[r] = Evidence.from_dict(self._read(f"ep/{n}/r/{r}", v))
            except TamperedValue as bad:
                tampered.append(bad.key)
        for r in group:
            if r not in evidence and r in closed:
                evidence[r] = Evidence(rank=r, step=-1, op_id=0, phase=int(Phase.CLOSED), pending=False, fp_hash=0,
                                       fingerprint="", silent_s=0.0, silent=True, alive=False)
        summary = classify_group(group, evidence)
        if tampered:  # the verdict is not built from it (the reporter names nobody)
            summary["tampered"] = tampered
        return summary

    def _closed_ranks(self) -> set[int]:
        if not self.store.check([CLOSED_LIST]):
            return set()
        return {int(r) for r in unseal_entries(self.secret, CLOSED_LIST, self.store.get(CLOSED_LIST))
                if r.isdigit()}

    def report(self, n: int, start: float) -> EpisodeOutcome:
        keys = [f"ep/{n}/g/{g}" for g in range(len(self.groups))]
        # Leaders wait at most gather_timeout_s for their members, from their own post (up to a heartbeat
        # after ours); a group whose leader died, or that has no live member, never posts: we read its
        # members' evidence ourselves (none at all: every member is lost).
        if self._wait_for(keys, start + self.gather_timeout_s + self.leader_slack_s):
            present = list(range(len(self.groups)))
        else:
            present = [g for g, k in enumerate(keys) if self.store.check([k])]
        values = self.store.multi_get([keys[g] for g in present]) if present else []
        summaries, tampered = [], []
        for g, v in zip(present, values, strict=True):
            try:
                summaries.append(self._read(keys[g], v))
            except TamperedValue as bad:
                tampered.append(bad.key)
        for g in sorted(set(range(len(self.groups))) - set(present)):
            summaries.append(self._summarize(n, g, self.clock()))
        tampered += [k for s in summaries for k in s.get("tampered", [])]
        if tampered:
            verdict = tampered_verdict(tampered)
            self._put(f"ep/{n}/verdict", {"verdicts": [verdict.to_dict()], "repeat": False, "reporter": self.rank,
                                          "deferred": False})
            self._advance(n)
            self.episode = n + 1
            return EpisodeOutcome(n, [verdict], reporter=True)
        verdicts = merge(summaries, self.hosts)
        named = {r: where for s in summaries for r, where in s["named"].items()
                 if any(int(r) in v.ranks for v in verdicts)}
        lost = sorted(r for v in verdicts if v.hang_class.value == "lost" for r in v.ranks)
        signature = {"named": named, "lost": lost}
        previous = None
        if self.store.check(["named"]):
            try:
                previous = self._read("named", self.store.get("named"))
            except TamperedValue:
                previous = None  # not ours: the verdict is written again rather than suppressed
        signature = json.loads(json.dumps(signature))  # as it reads back: keys are strings
        repeat = bool(verdicts) and signature == previous
        if verdicts and not repeat:
            self._put("named", signature)
        later = deferred(summaries, verdicts)
        self._put(f"ep/{n}/verdict", {"verdicts": [v.to_dict() for v in verdicts], "repeat": repeat,
                                      "reporter": self.rank, "deferred": later})
        self._advance(n)
        self.episode = n + 1
        return EpisodeOutcome(n, verdicts, reporter=True, repeat=repeat, deferred=later)

    def _read_verdict(self, n: int) -> dict[str, Any]:
        key = f"ep/{n}/verdict"
        try:
            return self._read(key, self.store.get(key))
        except TamperedValue:
            return {"verdicts": [tampered_verdict([key]).to_dict()]}

    def _finish(self, n: int, doc: Mapping[str, Any], *, reporter: bool) -> EpisodeOutcome:
        self.episode = max(self.episode, n + 1, self._counter())
        return EpisodeOutcome(n, [HangVerdict.from_dict(v) for v in doc["verdicts"]], reporter=reporter,
                              repeat=bool(doc.get("repeat")), deferred=bool(doc.get("deferred")))

    # -- after a verdict ---------------------------------------------------------------------------

    def moved(self, n: int) -> None:
        """Our trainer moved again after episode ``n``'s verdict (a sealed entry: only the job's observers can
        make the reporter write that progress resumed)."""
        key = f"ep/{n}/moved"
        self.store.append(key, seal_entry(self.secret, key, str(self.rank)))

    def resumed(self, n: int) -> bool:
        key = f"ep/{n}/moved"
        return bool(self.store.check([key])) and bool(unseal_entries(self.secret, key, self.store.get(key)))


def tampered_verdict(keys: Sequence[str]) -> HangVerdict:
    """The verdict of an episode whose values did not all verify: nobody is named, and it says why."""
    shown = ", ".join(list(keys)[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return HangVerdict(HangClass.INCONCLUSIVE, (), (),
                       f"the control store holds values this job's observers did not write ({shown}): a process "
                       "outside the job reached the store, so this episode names no rank",
                       {"tampered": sorted(keys)[:16]})
