"""Across C3 rounds: a straggler is confirmed only after repeated flags (:class:`Confirmation`), and only
beyond the noise floor healthy peers have lately shown (:class:`NoiseFloor`).

Both are pure and deterministic like the one-round rules (:mod:`scout_core.consensus_rules`): every peer feeds the
same results and reaches the same state. They are re-exported by :mod:`scout_core.consensus`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from scout_core.consensus_rules import C3Result, C3Status, result_of_flags

__all__ = ["Confirmation", "NoiseFloor", "streak_keys", "tail_floor"]


_ALL_ROUNDS = None
"""The streak key of every round, whatever its kind of work."""


def streak_keys(kind: Hashable = None) -> tuple[Hashable, ...]:
    """The streaks a round of ``kind`` extends: over all rounds, and over this kind's (another kind's streak is
    judged in its own rounds: its count says nothing about this one)."""
    return (_ALL_ROUNDS,) if kind is None else (_ALL_ROUNDS, kind)


@dataclass
class Confirmation:
    """Reports a rank only after it was flagged in at least ``rounds`` rounds.

    ``consecutive=True`` (the straggler protocol) requires the flags to come in
    consecutive rounds for the same surface; an unflagged round resets the
    count. Counting is keyed per surface so two surfaces never pool evidence.

    Rounds may also name the ``kind`` of work they measured (a layer class and its parameters). Rounds of one
    kind then confirm among themselves too: where checks alternate kinds of work (an MoE block's attention and
    its router), a rank slow in only one of them is flagged in every other round, and the count over all rounds
    never reaches ``rounds``; the count over that kind's rounds does, while rounds of other kinds neither count
    for it nor reset it. A rank is newly confirmed once per episode: from its first confirmation until none of its
    streaks on the surface is left.
    """

    rounds: int = 2
    consecutive: bool = True
    _streaks: dict[tuple[str, int], dict[Hashable, int]] = field(default_factory=dict)
    _confirmed: set[tuple[str, int]] = field(default_factory=set)
    newly: tuple[int, ...] = ()
    """The ranks the last :meth:`update` confirmed that were not confirmed before it (one record per episode)."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")

    def update(self, result: C3Result, kind: Hashable = None) -> tuple[int, ...]:
        """Feed one round; return the global ranks confirmed by this round. A round without a measurement
        neither counts nor resets: it is not evidence either way."""
        self.newly = ()
        if result.status is C3Status.NO_MEASUREMENT:
            return ()
        flagged = set(result.outlier_ranks) if result.status is C3Status.ATTRIBUTED else set()
        confirmed, newly = [], []
        keys = streak_keys(kind)
        for rank in result.peer_ranks:
            who = (result.surface, rank)
            streaks = self._streaks.get(who, {})
            for key in keys:
                if rank in flagged:
                    streaks[key] = streaks.get(key, 0) + 1
                elif self.consecutive:
                    streaks.pop(key, None)
            if streaks:
                self._streaks[who] = streaks
            else:
                self._streaks.pop(who, None)
                self._confirmed.discard(who)  # the episode is over: a later one is recorded again
            if rank in flagged and max(streaks.get(key, 0) for key in keys) >= self.rounds:
                confirmed.append(rank)
                if who not in self._confirmed:
                    self._confirmed.add(who)
                    newly.append(rank)
        self.newly = tuple(newly)
        return tuple(confirmed)

    def count(self, surface: str, rank: int, kind: Hashable = None) -> int:
        """The rank's current streak on ``surface`` over all rounds, or over the rounds of ``kind``."""
        return self._streaks.get((surface, rank), {}).get(kind, 0)

    def naming(self, surface: str, rank: int) -> bool:
        """Whether ``rank`` is in an episode this confirmed on ``surface``."""
        return (surface, rank) in self._confirmed

    def reset(self, ranks: Iterable[int] | None = None) -> None:
        if ranks is None:
            self._streaks.clear()
            self._confirmed.clear()
            return
        drop = set(ranks)
        for who in [w for w in self._streaks if w[1] in drop]:
            del self._streaks[who]
        self._confirmed = {w for w in self._confirmed if w[1] not in drop}


def tail_floor(ratios: Sequence[float], multiple: float) -> float:
    """``1 + multiple x (q99 - 1)`` of healthy ratios to their usual value (1.0 without any): how far beyond its
    own noise a reading must be to count as slow. The 99th percentile, but never the single largest value: in
    the first rounds there are a few dozen values, and one freak among them would set the floor alone (a
    1.65x reading, a 2.95x floor)."""
    body = sorted(r for r in ratios if math.isfinite(r))
    if not body:
        return 1.0
    q99 = body[max(0, min(int(0.99 * len(body)), len(body) - 2))]
    return 1.0 + multiple * max(q99 - 1.0, 0.0)


class NoiseFloor:
    """How much slower than usual healthy peers have lately been: a compute straggler must beat that too.

    :func:`statistical` scales its threshold by one round's spread (MAD), which assumes light tails. A
    device's clock can have heavy ones: on a shared host a healthy rank's replay reads above 1.3x its peers'
    median in about one rank-round in 250, above 1.5x in one in 1,000, a whole round at a time
    (docs/consensus.md, measured noise). Two such rounds in a row on one rank confirm a false straggler, and
    over a few thousand rank-rounds that happens. So a flagged peer keeps its flag only if its ratio to the
    round's median also exceeds

        floor = 1 + ``multiple`` x (q99 - 1),

    q99 being the 99th percentile of the healthy body: each peer's ratios of the last ``window`` rounds in
    which the rule did not flag it, divided by that peer's own median ratio (from peers with ``OWN_AFTER``
    such rounds; before any has, the raw ratios of all), leaving out peers the rule keeps flagging
    (``SUSPECT``).
    Dividing by its own median keeps what a peer always is out of the body: a device a few percent slower
    by binning, a straggler in a group too small for the rule to flag it every round, a slow machine's
    ranks. What is left is how far a rank strays from its own usual, which is the noise. The multiple
    extrapolates from the body to the tail, as kappa does from the MAD. On a quiet device (a GPU's events)
    the floor stays near ``min_ratio``; on a noisy one the threshold in force rises with the noise instead of
    naming healthy ranks. Nothing is flagged in the first ``WARMUP`` rounds: a floor from one or two rounds is
    a guess.

    Pure and deterministic like the rules: every peer feeds the same results and holds the same floor. A
    caller keeps one per kind of work (layer class and shapes): different work has different noise.
    ``window=0`` disables it.
    """

    WARMUP = 3
    OWN_AFTER = 8
    SUSPECT = (2, 8)
    """A peer the rule flagged in 2 of its last 8 usable rounds gives nothing to the body: it may be a
    straggler the rule misses now and then (small groups, several slow ranks), whose missed rounds would
    otherwise read as noise and lift the floor over its own slowdown."""

    def __init__(self, window: int = 64, *, multiple: float = 3.0) -> None:
        if not 0 <= window <= 1024 or multiple < 1:
            raise ValueError(f"need 0 <= window <= 1024 rounds and multiple >= 1; got {window}, {multiple}")
        self.window, self.multiple = window, multiple
        self._peers: dict[int, deque[float]] = {}
        self._flags: dict[int, deque[bool]] = {}  # the rule's verdicts on each peer, newest last
        self.rounds = 0
        """Rounds seen (the warm-up is over at ``WARMUP``)."""

    @property
    def floor(self) -> float:
        """The ratio to the median a flagged peer must exceed now (1.0 before any round)."""
        times, of = self.SUSPECT
        healthy = {p: r for p, r in self._peers.items() if sum(list(self._flags.get(p, ()))[-of:]) < times}
        # Once some peers have their own median, the body is theirs alone: a peer the rule nearly always
        # flags never gets one, and the few rounds it slipped through say nothing of noise.
        own_after = min(self.OWN_AFTER, self.window)
        known = [ratios for ratios in healthy.values() if len(ratios) >= own_after]
        body: list[float] = []
        for ratios in known:
            own = statistics.median(ratios)
            if own > 0 and math.isfinite(own):  # a clock that read 0 s has no usual to stray from
                body += [r / own for r in ratios if math.isfinite(r)]
        if not known:
            body = [r for ratios in healthy.values() for r in ratios if math.isfinite(r)]
        return tail_floor(body, self.multiple)

    def apply(self, result: C3Result) -> tuple[C3Result, float | None]:
        """``result`` with the flags at or below the floor cleared (all of them during the warm-up), and the
        floor that was in force (None when nothing was flagged or the floor is off); the round's unflagged
        ratios then join the window.

        Rounds without a usable median (no measurement, inconclusive, a zero median) pass unchanged and
        leave the window as it is."""
        if (not self.window or result.status not in (C3Status.AGREE, C3Status.ATTRIBUTED)
                or not isinstance(result.reference, (int, float)) or result.reference <= 0):
            return result, None
        median = float(result.reference)
        ratios = [float(x) / median for x in result.evidence]
        floor = None
        bitmap = result.bitmap
        if any(bitmap):  # computed only when it matters: a flagged round
            floor = self.floor if self.rounds >= self.WARMUP else math.inf
            bitmap = tuple(1 if b and r > floor else 0 for b, r in zip(result.bitmap, ratios, strict=True))
        for rank, ratio, flagged in zip(result.peer_ranks, ratios, result.bitmap, strict=True):
            self._flags.setdefault(rank, deque(maxlen=self.SUSPECT[1])).append(bool(flagged))
            if not flagged:
                self._peers.setdefault(rank, deque(maxlen=self.window)).append(ratio)
        self.rounds += 1
        if bitmap == result.bitmap:
            return result, floor
        kept = result_of_flags(list(bitmap), result.evidence, result.peer_ranks, result.surface, result.reference)
        return kept, floor
