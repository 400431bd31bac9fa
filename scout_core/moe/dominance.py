"""Dominance compression of a shape catalog (paper section 6.2).

Within one kernel and scheduling fingerprint, shape ``a`` *dominates* shape ``b`` when ``a`` runs every
execution path at least as often as ``b``. Replaying ``a`` exercises everything ``b`` would, at least as many
times, so ``b`` need not be replayed. The kept set is the Pareto-maximal shapes, one per distinct count
vector: every admitted shape is dominated by a kept one, and no smaller set has that property (a maximal
vector is dominated only by itself, so its class must be represented). Among shapes with equal counts the
first in the given order is kept (callers list the cheapest first).

What this does not guarantee: that a fault's effect grows with a path's count (a fault that needs a specific
row index inside a tail tile can still hide in a kept shape whose tail is a different width), or anything
across fingerprints (different kernels are different code: each fingerprint is compressed on its own).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

__all__ = ["compress", "dominates"]


def dominates(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether count vector ``a`` is at least ``b`` on every path."""
    if len(a) != len(b):
        raise ValueError(f"count vectors of different lengths: {len(a)} and {len(b)}")
    return all(x >= y for x, y in zip(a, b, strict=True))


def compress(counts: Mapping[Hashable, Sequence[int]]) -> list[Hashable]:
    """The minimum set of representatives of ``counts`` (shape -> path-count vector, one fingerprint), in the
    mapping's order. Shapes that run no path at all (zero rows) need no replay and are never kept."""
    first_of: dict[tuple[int, ...], Hashable] = {}
    for shape, vec in counts.items():
        first_of.setdefault(tuple(vec), shape)
    vectors = [v for v in first_of if any(v)]
    kept = {v for v in vectors if not any(w != v and dominates(w, v) for w in vectors)}
    return [shape for vec, shape in first_of.items() if vec in kept]
