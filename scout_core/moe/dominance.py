"""Dominance compression of a shape catalog (paper section 6.2).

Within one kernel and scheduling fingerprint, shape ``a`` *dominates* shape ``b`` when ``a`` runs every
execution path at least as often as ``b``. Replaying ``a`` exercises everything ``b`` would, at least as many
times, so ``b`` need not be replayed. The kept set is the Pareto-maximal shapes, one per distinct count
vector: every admitted shape is dominated by a kept one, and no smaller set has that property (a maximal
vector is dominated only by itself, so its class must be represented). Among shapes with equal counts the
LAST in the given order is kept: callers list row counts ascending, so the kept shape has the widest tail tile
of its class (31 rows of a 16-row tile keeps a 15-row tail, where 17 would keep 1 row and miss a defect that
needs row 3 of a tail).

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
    mapping's order (the last of each class of equal counts). Shapes that run no path at all (zero rows) need
    no replay and are never kept."""
    last_of: dict[tuple[int, ...], Hashable] = {}
    for shape, vec in counts.items():
        last_of[tuple(vec)] = shape  # the widest tail of equal counts (see the module docstring)
    vectors = [v for v in last_of if any(v)]
    kept = {v for v in vectors if not any(w != v and dominates(w, v) for w in vectors)}
    return sorted((shape for vec, shape in last_of.items() if vec in kept), key=list(counts).index)
