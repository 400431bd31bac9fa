"""Equivalent peer groups and cross-process-group localization (paper sections 4, 6.1.2).

Pure functions: nothing here talks to a process group, so the same code
answers for 16 ranks in a test and 100,000 ranks in a planning tool.

A rank's logical address has six coordinates ``(d, s, t, p, c, e)``: data
replica, state shard, tensor shard, pipeline stage, context shard and expert
partition. Ranks are placed row-major over an axis order (the first axis
varies slowest). Two ranks are equivalent peers when every model-parallel
coordinate ``(t, p, c, e)`` matches; peers then differ along ``d`` (natural
replicas) or, when ``d == 1``, along ``s`` (state-shard peers, whose state is
synchronized for the diagnostic operation). Under HSDP (``d > 1`` and
``s > 1``) peers hold the same shard, so ``s`` stays fixed as well.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AXES",
    "MESH_DIM_AXES",
    "AttributionScope",
    "GroupTiming",
    "Localization",
    "attribution_scope",
    "axis_groups",
    "coords_of",
    "hosts_by_group",
    "localize_slow_groups",
    "normalize_shape",
    "peer_axis",
    "peer_groups",
    "peer_groups_from_mesh",
    "rank_grid",
]

AXES: tuple[str, ...] = ("d", "s", "t", "p", "c", "e")
"""Default placement order: data replica outermost, expert partition innermost."""

MESH_DIM_AXES: Mapping[str, str] = {
    "dp": "d",
    "dp_replicate": "d",
    "replicate": "d",
    "dp_shard": "s",
    "fsdp": "s",
    "shard": "s",
    "tp": "t",
    "pp": "p",
    "cp": "c",
    "ep": "e",
}
"""DeviceMesh dimension names (TorchTitan / torch conventions) mapped to axes."""


class AttributionScope(enum.StrEnum):
    """What a peer group of a given size can say about a disagreement."""

    NONE = "none"  # singleton: nothing to compare against
    GROUP = "peer_group"  # two peers: disagreement is visible, the culprit is not
    RANK = "rank"  # three or more: a strict majority can name minority ranks


def attribution_scope(group_size: int) -> AttributionScope:
    """1 = no comparison, 2 = group-scoped only, >= 3 = rank attribution."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    if group_size == 1:
        return AttributionScope.NONE
    if group_size == 2:
        return AttributionScope.GROUP
    return AttributionScope.RANK


def normalize_shape(shape: Mapping[str, int], order: Sequence[str] = AXES) -> dict[str, int]:
    """Validate ``shape`` against ``order``; missing axes default to size 1."""
    order = tuple(order)
    if sorted(order) != sorted(AXES):
        raise ValueError(f"order must be a permutation of {AXES}, got {order}")
    unknown = set(shape) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; allowed axes are {AXES}")
    out = {}
    for axis in order:
        size = int(shape.get(axis, 1))
        if size < 1:
            raise ValueError(f"axis {axis!r} must have size >= 1, got {size}")
        out[axis] = size
    return out


def rank_grid(shape: Mapping[str, int], order: Sequence[str] = AXES) -> torch.Tensor:
    """Global ranks laid out as a tensor with one dimension per axis of ``order``."""
    sizes = normalize_shape(shape, order)
    return torch.arange(math.prod(sizes.values()), dtype=torch.int64).reshape(tuple(sizes.values()))


def coords_of(rank: int, shape: Mapping[str, int], order: Sequence[str] = AXES) -> dict[str, int]:
    """Logical coordinates of a global rank under row-major placement."""
    sizes = normalize_shape(shape, order)
    world = math.prod(sizes.values())
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of size {world}")
    coords = {}
    rest = rank
    for axis in reversed(tuple(sizes)):
        rest, coords[axis] = divmod(rest, sizes[axis])
    return {axis: coords[axis] for axis in sizes}


def peer_axis(shape: Mapping[str, int]) -> str:
    """``d`` when natural replicas exist, else ``s`` (state-shard peers)."""
    return "d" if int(shape.get("d", 1)) > 1 else "s"


def _groups_along(grid: torch.Tensor, axis_index: int) -> list[tuple[int, ...]]:
    moved = torch.movedim(grid, axis_index, -1).reshape(-1, grid.shape[axis_index])
    return [tuple(row) for row in moved.tolist()]


def axis_groups(shape: Mapping[str, int], axis: str, order: Sequence[str] = AXES) -> list[tuple[int, ...]]:
    """Groups of ranks that differ only along ``axis`` (e.g. TP or FSDP groups)."""
    sizes = normalize_shape(shape, order)
    if axis not in sizes:
        raise ValueError(f"unknown axis {axis!r}; allowed axes are {AXES}")
    grid = rank_grid(sizes, tuple(sizes))
    return _groups_along(grid, tuple(sizes).index(axis))


def peer_groups(shape: Mapping[str, int], order: Sequence[str] = AXES) -> list[tuple[int, ...]]:
    """Equivalent peer groups: vary ``d`` (or ``s`` when ``d == 1``), fix the rest.

    >>> peer_groups({"d": 4, "t": 2})
    [(0, 2, 4, 6), (1, 3, 5, 7)]
    """
    return axis_groups(shape, peer_axis(shape), order)


def peer_groups_from_mesh(mesh: Any) -> list[tuple[int, ...]]:
    """Peer groups of a ``torch.distributed.device_mesh.DeviceMesh`` with named dims.

    Dimension names map to axes through :data:`MESH_DIM_AXES`; a mesh whose
    names are missing or unknown raises, because guessing which dimension holds
    replicas would compare non-equivalent ranks.
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("the DeviceMesh needs mesh_dim_names to derive peer groups")
    axes = []
    for name in names:
        if name not in MESH_DIM_AXES:
            raise ValueError(f"unknown mesh dimension {name!r}; known names: {sorted(MESH_DIM_AXES)}")
        axes.append(MESH_DIM_AXES[name])
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh dimensions {names} map to repeated axes {axes}")
    grid = mesh.mesh.detach().to("cpu", torch.int64)
    shape = {a: int(n) for a, n in zip(axes, grid.shape)}
    axis = peer_axis(shape)
    if axis not in axes:
        # No replica or shard dimension: every rank is its own singleton group.
        return [(r,) for r in grid.reshape(-1).tolist()]
    return _groups_along(grid, axes.index(axis))


def hosts_by_group(groups: Iterable[Sequence[int]], prefix: str = "host") -> dict[int, str]:
    """A rank -> host map that places each given group on its own machine.

    Used to simulate the common placement in which every TP group lives inside
    one machine.
    """
    host_of: dict[int, str] = {}
    for i, group in enumerate(groups):
        for rank in group:
            if rank in host_of:
                raise ValueError(f"rank {rank} appears in two groups")
            host_of[int(rank)] = f"{prefix}{i}"
    return host_of


@dataclass(frozen=True)
class GroupTiming:
    """One process group's timing verdict from statistical C3 across like groups."""

    dim: str
    """Parallelism dimension of the group, e.g. ``"fsdp"`` or ``"tp"``."""
    ranks: tuple[int, ...]
    slow: bool


@dataclass(frozen=True)
class Localization:
    """Actionable unit named by cross-process-group intersection."""

    scope: str
    """``none``, ``rank``, ``machine``, ``peer_group`` or ``job``."""
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    slow_groups: tuple[tuple[str, tuple[int, ...]], ...]
    reason: str


class LocalizationStreak:
    """How many consecutive rounds named the same slow unit; a verdict is confirmed after a configured number."""

    def __init__(self) -> None:
        self.rounds = 0
        self._last: tuple[Any, ...] | None = None

    def update(self, loc: Localization) -> int:
        """Count ``loc`` (scope ``none`` resets the streak) and return the streak's length."""
        if loc.scope == "none":
            self.rounds, self._last = 0, None
            return 0
        key = (loc.scope, loc.ranks, loc.hosts)
        self.rounds = self.rounds + 1 if key == self._last else 1
        self._last = key
        return self.rounds


def localize_slow_groups(observations: Sequence[GroupTiming], host_of: Mapping[int, str]) -> Localization:
    """Intersect slow groups of different dimensions to name a machine (section 6.1.2).

    * The ranks common to every slow group, minus ranks seen in any healthy
      group, are the suspects; if they sit on one machine, that machine is the
      recovery unit (scope ``machine``).
    * Otherwise, if every slow group lies inside one machine, the problem is
      intra-machine communication on that machine (scope ``machine``).
    * Otherwise slow groups of a single dimension point at inter-machine links:
      the affected groups are reported (scope ``peer_group``).
    * Slow groups across several dimensions with no machine explaining them
      all give a job-level verdict (software issue or cluster contention).
    """
    slow = [o for o in observations if o.slow]
    if not slow:
        return Localization("none", (), (), (), "no slow process group")
    for o in observations:
        missing = [r for r in o.ranks if r not in host_of]
        if missing:
            raise ValueError(f"ranks {missing} of group {o.ranks} have no host in host_of")
    slow_desc = tuple((o.dim, tuple(o.ranks)) for o in slow)
    healthy_ranks = {r for o in observations if not o.slow for r in o.ranks}
    common = set(slow[0].ranks)
    for o in slow[1:]:
        common &= set(o.ranks)
    suspects = sorted(common - healthy_ranks)
    if suspects:
        hosts = sorted({host_of[r] for r in suspects})
        if len(hosts) == 1:
            dims = sorted({o.dim for o in slow})
            return Localization(
                "machine", tuple(suspects), tuple(hosts), slow_desc,
                f"slow {'+'.join(dims)} groups intersect at rank(s) {suspects} on {hosts[0]}",
            )
    slow_hosts = [{host_of[r] for r in o.ranks} for o in slow]
    if all(len(h) == 1 for h in slow_hosts) and len(set.union(*slow_hosts)) == 1:
        host = next(iter(slow_hosts[0]))
        ranks = tuple(sorted({r for o in slow for r in o.ranks}))
        return Localization("machine", ranks, (host,), slow_desc, f"intra-machine communication slow on {host}")
    dims = {o.dim for o in slow}
    ranks = tuple(sorted({r for o in slow for r in o.ranks}))
    hosts = tuple(sorted(set.union(*slow_hosts)))
    if len(dims) == 1:
        return Localization(
            "peer_group", ranks, hosts, slow_desc,
            f"{len(slow)} slow {next(iter(dims))} group(s) with healthy intersecting groups: inter-machine path",
        )
    return Localization(
        "job", ranks, hosts, slow_desc,
        f"{len(slow)} slow groups over {sorted(dims)} with no common machine: job-level slowdown",
    )
