"""A compute straggler too mild for the noise floor, named from what its peers measured in the same rounds.

The one-round rule and the noise floor (:mod:`scout_core.confirmation`) name a rank whose replay is slower than
the host's heavy tail ever makes a healthy one. On a noisy host that floor stands at 1.5-1.8x, so a rank 1.3x
slower (the paper's straggler) is never named by them. What tells such a rank from noise is persistence: a
healthy rank is slow in one round now and then, a slowed one in every round, by about the same factor. So
:class:`Persistence` names a rank that, in ``rounds`` consecutive rounds of one kind of work, was

* slower than the round's other peers by more than their own spread in that round: its ratio to their median
  above 1 + one robust sigma of theirs (MAD x 1.4826 over the median), and above ``min_step`` (the one-round
  rule's ``consensus.min_ratio``, 1.1x: a device a few percent slower by binning is not a straggler, and its
  streak must not wait for two freak rounds to carry the average); and
* on average (geometric mean) at least ``ratio`` x their median, each round's ratio capped at ``CAP``, so one
  freak round cannot carry the average.

Pure and deterministic like the rules: every peer feeds the same results and reaches the same state.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scout_core.confirmation import streak_keys
from scout_core.consensus_rules import MAD_NORMAL_CONSISTENCY, C3Result, C3Status

__all__ = ["Persistence", "round_ratios"]

CAP = 1.35
"""Each round's ratio counts at most this much towards the average."""
MIN_PEERS = 4
"""Fewer peers give no spread to judge a rank against (and two cannot be told apart)."""
EXACT_UP_TO = 64
"""Each rank is judged against its peers without itself up to this many peers; beyond, against all of them
(the rank's own weight in the median and MAD is then below 1.6 %)."""


def _median_and_sigma(values: Sequence[float]) -> tuple[float, float]:
    """Median and robust sigma (MAD x 1.4826) relative to the median; sigma is inf for a zero median."""
    med = statistics.median(values)
    if med <= 0:
        return med, math.inf
    mad = statistics.median(abs(v - med) for v in values)
    return med, MAD_NORMAL_CONSISTENCY * mad / med


def round_ratios(times: Sequence[float], min_step: float = 1.1) -> list[tuple[float, float]] | None:
    """Per peer: (its time over the other peers' median, the bar it must exceed: 1 + their robust sigma, at
    least ``min_step``). None when the round is no evidence (too few peers, a missing or non-finite time)."""
    if len(times) < MIN_PEERS or any(t is None or not math.isfinite(t) or t < 0 for t in times):
        return None
    xs = [float(t) for t in times]
    full = _median_and_sigma(xs)
    out = []
    for i, x in enumerate(xs):
        med, sigma = _median_and_sigma(xs[:i] + xs[i + 1:]) if len(xs) <= EXACT_UP_TO else full
        if med <= 0:
            return None
        out.append((x / med, max(min_step, 1.0 + sigma)))
    return out


@dataclass
class Persistence:
    """Names a rank slower than its peers beyond their spread in ``rounds`` consecutive rounds of one kind of
    work, on average at least ``ratio`` x their median. ``rounds=0`` turns it off.

    Rounds may name the ``kind`` of work they measured; as in :class:`~scout_core.confirmation.Confirmation`, a
    rank's streak is kept over all rounds and over each kind's own rounds, and rounds of another kind neither
    count for a kind's streak nor break it. A round without a strict majority of peers within their spread (a
    noisy round, a slow machine) is no evidence for anyone and breaks the streaks it covers (all rounds' and its
    kind's). A rank is newly named once per episode: until a round in which it is not slower breaks all its
    streaks (a later episode is recorded again).
    """

    rounds: int = 3
    ratio: float = 1.22
    min_step: float = 1.1
    _streaks: dict[tuple[str, int], dict[Hashable, deque[float]]] = field(default_factory=dict)
    _named: set[tuple[str, int]] = field(default_factory=set)
    newly: tuple[int, ...] = ()
    """The ranks the last :meth:`update` named that were not named before it (one record per episode)."""
    means: dict[int, float] = field(default_factory=dict)
    """The ranks the last :meth:`update` named, with their average ratio over the rounds that named them."""

    def __post_init__(self) -> None:
        if self.rounds < 0 or not 1.0 <= self.ratio <= CAP or self.min_step < 1.0:
            raise ValueError(f"need rounds >= 0, 1 <= ratio <= {CAP} (each round counts at most {CAP}x) and "
                             f"min_step >= 1; got {self.rounds}, {self.ratio}, {self.min_step}")

    @classmethod
    def from_config(cls, cfg: Any) -> Persistence:
        """From a :class:`scout_core.config.ConsensusConfig` (``persist_rounds``, ``persist_ratio``, ``min_ratio``)."""
        return cls(rounds=cfg.persist_rounds, ratio=cfg.persist_ratio, min_step=cfg.min_ratio)

    def update(self, result: C3Result, kind: Hashable = None) -> tuple[int, ...]:
        """Feed one timing round (the rule's result, before any noise floor): the ranks named by it."""
        self.newly, self.means = (), {}
        if not self.rounds or result.status is C3Status.NO_MEASUREMENT:
            return ()
        judged = round_ratios(result.evidence, self.min_step)
        if judged is None:
            return ()
        slower = {rank: r for rank, (r, bar) in zip(result.peer_ranks, judged, strict=True) if r > bar}
        if 2 * len(slower) >= len(judged):
            slower = {}  # no majority within its spread: nobody's evidence, and every streak is broken
        keys = streak_keys(kind)
        named, newly = [], []
        for rank in result.peer_ranks:
            who = (result.surface, rank)
            streaks = self._streaks.get(who, {})
            for key in keys:
                if rank in slower:
                    streaks.setdefault(key, deque(maxlen=self.rounds)).append(math.log(min(slower[rank], CAP)))
                else:
                    streaks.pop(key, None)
            if not streaks:
                self._streaks.pop(who, None)
                self._named.discard(who)  # the episode is over: a later one is recorded again
                continue
            self._streaks[who] = streaks
            mean = max((sum(s) / len(s) for key in keys if len(s := streaks.get(key, ())) == self.rounds),
                       default=None)
            if mean is not None and mean >= math.log(self.ratio):
                named.append(rank)
                self.means[rank] = math.exp(mean)
                if who not in self._named:
                    self._named.add(who)
                    newly.append(rank)
        self.newly = tuple(newly)
        return tuple(named)

    def naming(self, surface: str, rank: int) -> bool:
        """Whether ``rank`` is in an episode this named on ``surface``."""
        return (surface, rank) in self._named

    def reset(self) -> None:
        self._streaks.clear()
        self._named.clear()
