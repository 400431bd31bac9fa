"""Consensus Collective Communication (C3), paper section 5.

C3 maps one piece of evidence per peer to a result ``(status, bitmap, evidence)``.
The comparison rules are pure functions so that every peer, given the same
gathered evidence, derives the same verdict without a coordinator. The
transport (:func:`c3_exchange`) all-gathers local evidence over a process group
and applies the rule locally on every member.

Two rules exist:

* :func:`exact` for evidence whose healthy values are identical (signatures,
  progress coordinates, collective fingerprints).
* :func:`statistical` for timings, where only slow outliers relative to a
  robust median reference are flagged.

Neither rule ever names a rank without a strict healthy majority.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = [
    "C3Status",
    "C3Result",
    "exact",
    "statistical",
    "c3_exchange",
    "Confirmation",
    "group_disagreements",
    "MAD_NORMAL_CONSISTENCY",
    "NoiseFloor",
    "StatisticalRule",
    "tail_floor",
]

# Scales the median absolute deviation to the standard deviation of a normal
# distribution (1 / Phi^-1(3/4)), so kappa reads as "robust sigmas".
MAD_NORMAL_CONSISTENCY = 1.4826


class C3Status(enum.StrEnum):
    """Outcome of one C3 comparison."""

    AGREE = "agree"
    ATTRIBUTED = "attributed"
    INCONCLUSIVE = "inconclusive"
    NO_MEASUREMENT = "no_measurement"
    """A timing round in which some peer measured nothing (``None``): it neither flags nor clears anyone."""


@dataclass(frozen=True)
class C3Result:
    """Verdict of one comparison over an ordered peer group.

    ``bitmap[i] == 1`` attributes the divergence to ``peer_ranks[i]``. An
    ``inconclusive`` result always carries an all-zero bitmap.
    """

    status: C3Status
    bitmap: tuple[int, ...]
    evidence: tuple[Any, ...]
    peer_ranks: tuple[int, ...]
    surface: str = ""
    reference: Any = None
    """The majority value (exact) or the median (statistical), when one exists."""

    @property
    def outlier_ranks(self) -> tuple[int, ...]:
        """Global ranks whose bit is set, in peer order."""
        return tuple(r for r, b in zip(self.peer_ranks, self.bitmap) if b)

    @property
    def group_size(self) -> int:
        return len(self.peer_ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "bitmap": list(self.bitmap),
            "evidence": [_jsonable(e) for e in self.evidence],
            "peer_ranks": list(self.peer_ranks),
            "surface": self.surface,
            "reference": _jsonable(self.reference),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _default_ranks(n: int, peer_ranks: Sequence[int] | None) -> tuple[int, ...]:
    if peer_ranks is None:
        return tuple(range(n))
    if len(peer_ranks) != n:
        raise ValueError(f"peer_ranks has {len(peer_ranks)} entries for {n} pieces of evidence")
    return tuple(int(r) for r in peer_ranks)


def _finish(bitmap: list[int], evidence: tuple, ranks: tuple[int, ...], surface: str, reference: Any) -> C3Result:
    status = C3Status.ATTRIBUTED if any(bitmap) else C3Status.AGREE
    return C3Result(status, tuple(bitmap), evidence, ranks, surface, reference)


def exact(
    evidence: Sequence[Hashable],
    *,
    peer_ranks: Sequence[int] | None = None,
    surface: str = "",
) -> C3Result:
    """Exact strict-majority consensus (paper Algorithm 1).

    The most frequent value ``v*`` with count ``c*`` is the reference when
    ``c* > N/2``; every peer holding another value is flagged. Otherwise the
    result is inconclusive with a zero bitmap: no side is chosen.
    """
    values = tuple(evidence)
    n = len(values)
    if n == 0:
        raise ValueError("exact consensus needs at least one piece of evidence")
    ranks = _default_ranks(n, peer_ranks)
    # Counter preserves first-seen order, so ties resolve identically on every
    # peer; ties never reach attribution anyway (a tie cannot be a majority).
    top_value, top_count = Counter(values).most_common(1)[0]
    if 2 * top_count <= n:
        return C3Result(C3Status.INCONCLUSIVE, (0,) * n, values, ranks, surface, None)
    bitmap = [0 if v == top_value else 1 for v in values]
    return _finish(bitmap, values, ranks, surface, top_value)


def statistical(
    values: Sequence[float],
    *,
    kappa: float = 4.0,
    min_ratio: float = 1.1,
    min_delta: float = 0.001,
    mad_floor_fraction: float = 0.01,
    peer_ranks: Sequence[int] | None = None,
    surface: str = "",
) -> C3Result:
    """Robust slow-outlier detection for elapsed times (paper section 5.4).

    Reference is the median ``m``; scale is ``MAD * 1.4826``, floored at
    ``mad_floor_fraction * m`` so identical healthy timings do not make every
    tiny deviation significant. A peer is flagged only if its time exceeds
    ``m + kappa * scale`` AND ``m * min_ratio`` AND ``m + min_delta``: it must
    be statistically, relatively and absolutely slow. Fast peers are never
    flagged. Healthy peers must remain a strict majority, otherwise the result
    is inconclusive. Two peers cannot be told apart and a disagreement between
    them is inconclusive (group-scoped).
    """
    if any(v is None for v in values):
        none = tuple(values)
        return C3Result(C3Status.NO_MEASUREMENT, (0,) * len(none), none, _default_ranks(len(none), peer_ranks),
                        surface, None)
    xs = tuple(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("statistical consensus needs at least one timing")
    if any(math.isnan(x) or x < 0 for x in xs):
        raise ValueError(f"timings must be non-negative numbers, got {xs}")
    if kappa <= 0 or min_ratio < 1.0 or min_delta < 0 or mad_floor_fraction < 0:
        raise ValueError("kappa must be > 0, min_ratio >= 1, min_delta >= 0, mad_floor_fraction >= 0")
    ranks = _default_ranks(n, peer_ranks)
    if n == 2:
        # The median of two is their mean, which hides the disagreement; compare
        # the slower peer with the faster one instead. Even then there is no
        # majority to say which of the two is at fault: group-scoped only.
        fast, slow_t = sorted(xs)
        differ = slow_t > max(fast * min_ratio, fast + min_delta)
        status = C3Status.INCONCLUSIVE if differ else C3Status.AGREE
        return C3Result(status, (0, 0), xs, ranks, surface, statistics.median(xs))
    median = statistics.median(xs)
    mad = statistics.median(abs(x - median) for x in xs)
    scale = max(mad * MAD_NORMAL_CONSISTENCY, mad_floor_fraction * median)
    threshold = max(median + kappa * scale, median * min_ratio, median + min_delta)
    slow = [1 if x > threshold else 0 for x in xs]
    healthy = n - sum(slow)
    if not any(slow):
        return C3Result(C3Status.AGREE, (0,) * n, xs, ranks, surface, median)
    if 2 * healthy <= n:
        return C3Result(C3Status.INCONCLUSIVE, (0,) * n, xs, ranks, surface, median)
    return _finish(slow, xs, ranks, surface, median)


@dataclass(frozen=True, kw_only=True)
class StatisticalRule:
    """Parameters of :func:`statistical`, bundled so a surface can carry them."""

    kappa: float = 4.0
    min_ratio: float = 1.1
    min_delta: float = 0.001
    mad_floor_fraction: float = 0.01

    @classmethod
    def from_config(cls, cfg: Any) -> StatisticalRule:
        """Build from a :class:`scout_core.config.ConsensusConfig`."""
        return cls(kappa=cfg.kappa, min_ratio=cfg.min_ratio, min_delta=cfg.min_delta_s,
                   mad_floor_fraction=cfg.mad_floor_fraction)

    @classmethod
    def for_communication(cls, cfg: Any) -> StatisticalRule:
        """The same, with the communication floors (``consensus.comm_min_ratio``, ``comm_min_delta_s``)."""
        return cls(kappa=cfg.kappa, min_ratio=max(cfg.min_ratio, cfg.comm_min_ratio),
                   min_delta=max(cfg.min_delta_s, cfg.comm_min_delta_s), mad_floor_fraction=cfg.mad_floor_fraction)

    def __call__(
        self, values: Sequence[float], *, peer_ranks: Sequence[int] | None = None, surface: str = ""
    ) -> C3Result:
        return statistical(
            values,
            kappa=self.kappa,
            min_ratio=self.min_ratio,
            min_delta=self.min_delta,
            mad_floor_fraction=self.mad_floor_fraction,
            peer_ranks=peer_ranks,
            surface=surface,
        )


def c3_exchange(
    local_evidence: Sequence[Any],
    *,
    group: dist.ProcessGroup | None = None,
    surfaces: Sequence[str] | None = None,
    rule: str | StatisticalRule = "exact",
) -> list[C3Result]:
    """All-gather K pieces of local evidence in ONE exchange and return K results.

    Every member of ``group`` must call this with the same K and surfaces. The
    returned list is identical on every member because the same deterministic
    rule runs on the same gathered evidence. ``rule`` is ``"exact"`` or a
    :class:`StatisticalRule` applied to every surface.
    """
    local = list(local_evidence)
    k = len(local)
    names = list(surfaces) if surfaces is not None else [f"surface{i}" for i in range(k)]
    if len(names) != k:
        raise ValueError(f"{len(names)} surface names for {k} pieces of evidence")
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    # One object all-gather carries every surface; shape checks happen after so
    # a peer with a different K is reported instead of deadlocking the group.
    dist.all_gather_object(gathered, (names, local), group=group)
    peer_ranks = _group_ranks(group, world)
    for peer, (peer_names, peer_local) in zip(peer_ranks, gathered):
        if list(peer_names) != names or len(peer_local) != k:
            raise RuntimeError(
                f"C3 exchange mismatch: rank {peer} sent surfaces {peer_names}, this rank expected {names}"
            )
    results = []
    for i, name in enumerate(names):
        column = [peer_local[i] for _, peer_local in gathered]
        if rule == "exact":
            results.append(exact(column, peer_ranks=peer_ranks, surface=name))
        elif isinstance(rule, StatisticalRule):
            results.append(rule(column, peer_ranks=peer_ranks, surface=name))
        else:
            raise ValueError(f"unknown C3 rule {rule!r}; use 'exact' or a StatisticalRule")
    return results


def group_disagreements(results: Sequence[C3Result]) -> tuple[dict[tuple[int, ...], list[C3Result]], list[C3Result]]:
    """(attributed results by the culprit ranks they name, results without a majority): one record per set of
    culprits with every surface that named them, one group-scoped record for the rest."""
    by_ranks: dict[tuple[int, ...], list[C3Result]] = {}
    inconclusive = []
    for r in results:
        if r.status is C3Status.ATTRIBUTED:
            by_ranks.setdefault(r.outlier_ranks, []).append(r)
        elif r.status is C3Status.INCONCLUSIVE:
            inconclusive.append(r)
    return by_ranks, inconclusive


def _group_ranks(group: dist.ProcessGroup | None, world: int) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(world))
    return tuple(dist.get_process_group_ranks(group))


_ALL_ROUNDS = None
"""The streak key of every round, whatever its kind of work."""


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
        # This round's streaks: over all rounds, and over this kind's (another kind's streak is judged in its own
        # rounds: its count says nothing about this one).
        keys = (_ALL_ROUNDS,) if kind is None else (_ALL_ROUNDS, kind)
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
        return _finish(list(bitmap), result.evidence, result.peer_ranks, result.surface, result.reference), floor
