"""A model state that is not finite is never certified, and says so (a hole replay cannot see by itself).

Replay compares replicas: a corruption that reaches every replica alike is invisible to it. The commonest such
case is a defect whose output is an inf or NaN on one rank: the loss, then the averaged gradients, then every
replica's weights become NaN within a step, and from then on every replay agrees (on NaN). Certification would
then verify a NaN state. So at each certification boundary each rank checks that its parameters are finite
(one pass over them, one device sync); a state that is not finite anywhere is evidence like an inconclusive
check: the candidate is rejected, nothing is captured, and a ``inconclusive`` record of scope ``job`` names the
ranks whose state is not finite (every one, usually: it cannot name the cause).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from scout_core.report import Incident, IncidentKind, IncidentScope
from scout_core.signature import local_tensor

__all__ = ["NONFINITE_SURFACE", "nonfinite_incident", "nonfinite_ranks", "state_is_finite"]

NONFINITE_SURFACE = "state.nonfinite"


def state_is_finite(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether every floating parameter this rank holds of ``modules`` is finite."""
    flags = [torch.isfinite(t).all() for m in modules for p in m.parameters()
             if (t := local_tensor(p.detach())).is_floating_point() and t.numel() > 0]
    if not flags:
        return True
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def nonfinite_ranks(mine: bool, group: object) -> list[int]:
    """Every rank's answer (the rare path, after the evidence said some rank's state is not finite)."""
    flag = torch.tensor([int(mine)], dtype=torch.int32)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, flag, group=group)
    return [r for r, f in enumerate(flags) if int(f.item())]


def nonfinite_incident(step: int, ranks: list[int]) -> Incident:
    return Incident(
        kind=IncidentKind.INCONCLUSIVE, scope=IncidentScope.JOB, ranks=ranks, hosts=[], step=step,
        surface=NONFINITE_SURFACE,
        reason=(f"the model's parameters are not finite (NaN or inf) on ranks {ranks}: training diverged, or a "
                "corruption reached every replica through the averaged gradients before any replay could compare "
                "it; no snapshot after the verified generation is trusted"),
        evidence={"reason": "nonfinite_state"})
