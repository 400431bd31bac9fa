"""What one replay boundary found (:class:`BoundaryResult`), and the names of the replica exchange's own surfaces.

The check fills a result stage by stage; the verdicts, certification and the report read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scout_core.consensus import C3Result, C3Status
from scout_core.report import Incident

__all__ = ["REPLICATED_STATE", "REPLICA_UNTRUSTED", "BoundaryResult", "SurfaceVerdicts"]

REPLICATED_STATE = ".replicated_state"
"""The replica exchange's surface of the sampled layer's copied (not sharded) parameters."""
REPLICA_UNTRUSTED = "replica.untrusted"
"""The replica exchange's list of each member's ranks that are not evidence (nondeterministic, foreign)."""


class SurfaceVerdicts:
    """What a check's compared ``surfaces`` and set-aside ``unreliable`` results say (a dense boundary's, an
    expert check's)."""

    surfaces: list[C3Result]
    unreliable: list[C3Result]

    @property
    def sdc(self) -> bool:
        return any(r.status is C3Status.ATTRIBUTED for r in self.surfaces)

    @property
    def inconclusive(self) -> bool:
        return bool(self.unreliable) or any(r.status is C3Status.INCONCLUSIVE for r in self.surfaces)


@dataclass
class BoundaryResult(SurfaceVerdicts):
    step: int
    surfaces: list[C3Result] = field(default_factory=list)
    timing: C3Result | None = None
    comm_timing: C3Result | None = None
    timing_world: bool = False
    """``timing`` compares every rank of the job (HSDP, where all peer groups replayed the same work), not
    only this peer group: its straggler verdicts are job-wide and recorded once."""
    stragglers: tuple[int, ...] = ()
    noise_floor: float | None = None
    """The compute noise floor in force in a flagged round (``consensus.NoiseFloor``; inf in its warm-up)."""
    persistent: dict[int, float] = field(default_factory=dict)
    """Ranks slower than the same rounds' peers in ``consensus.persist_rounds`` rounds in a row, with their
    average ratio to the peers' median (``persistence.Persistence``)."""
    group_slowdown: bool = False
    """The whole group's communication is slow against its own clean history (no outlier rank)."""
    localization: Any = None
    """HSDP: cross-group intersection of slow shard and replica groups (``topology.Localization``)."""
    incidents_global: list[Incident] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    replica_surfaces: list[C3Result] = field(default_factory=list)
    """The hidden layer's outputs compared across the replica group (tensor-parallel partners), when the
    adapter declares one: they name a rank where its own peer group has no strict majority."""
    source: int | None = None
    recipes: tuple[str, ...] = ()
    """Recipes that were due at this boundary (``embedding``, ``hidden``, ``output``, ``optimizer``)."""
    units: tuple[tuple[str, int], ...] = ()
    """What this check replayed to the end, as certification's units (``scout_core.checkpoint.coverage``)."""
    skipped: str = ""
    """Why due work was skipped on every peer (a diagnosis error, a sampled layer that did not run)."""
    untrusted: dict[int, str] = field(default_factory=dict)
    """Ranks this check found not to be evidence, with the reason (``nondeterministic``: its two runs
    differed; ``environment``: not its peers' majority software and hardware)."""
    unreliable: list[C3Result] = field(default_factory=list)
    """Results set aside because a non-reproducible rank took part in the disagreement."""
    misconfigured: C3Result | None = None
    """The optimizer self-check, when a strict majority of peers failed it (set aside, reported once)."""

    @property
    def checked(self) -> bool:
        """Something was due at this boundary (a certification boundary)."""
        return bool(self.recipes)

    @property
    def missing(self) -> bool:
        """Due work produced no evidence (skipped), so nothing can be certified at this boundary."""
        return self.checked and (bool(self.skipped) or not self.surfaces)
