"""The C3 comparison rules for one round: exact strict-majority consensus and the robust slow-outlier rule for
timings, pure functions that give every peer the same verdict from the same evidence.

Two rules exist:

* :func:`exact` for evidence whose healthy values are identical (signatures,
  progress coordinates, collective fingerprints).
* :func:`statistical` for timings, where only slow outliers relative to a
  robust median reference are flagged.

Neither rule ever names a rank without a strict healthy majority. They are re-exported by
:mod:`scout_core.consensus`, whose exchange applies them over a process group.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "C3Status",
    "C3Result",
    "exact",
    "statistical",
    "group_disagreements",
    "MAD_NORMAL_CONSISTENCY",
    "StatisticalRule",
    "result_of_flags",
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


def result_of_flags(bitmap: list[int], evidence: tuple, ranks: tuple[int, ...], surface: str,
                    reference: Any) -> C3Result:
    """The result a round's flags make: ``attributed`` where any peer is flagged, else ``agree``."""
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
    return result_of_flags(bitmap, values, ranks, surface, top_value)


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
    return result_of_flags(slow, xs, ranks, surface, median)


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
