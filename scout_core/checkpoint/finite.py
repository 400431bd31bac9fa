"""A model state that is not finite is never certified, and says so (a hole replay cannot see by itself).

Replay compares replicas: a corruption that reaches every replica alike is invisible to it. The commonest such
case is a defect whose output is an inf or NaN on one rank: the loss, then the averaged gradients, then every
replica's weights become NaN within a step, and from then on every replay agrees (on NaN). Certification would
then verify a NaN state. So at each certification boundary each rank checks that its parameters, buffers and
optimizer state are finite (one pass over them, one device sync); a state that is not finite anywhere is evidence
like an inconclusive check: the candidate is rejected, nothing is captured, and an ``inconclusive`` record of scope
``job`` names the ranks whose state is not finite (every one, usually: it cannot name the cause).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from scout_core.report import Incident, IncidentKind, IncidentScope
from scout_core.signature import local_tensor

__all__ = ["NONFINITE_SURFACE", "nonfinite_incident", "nonfinite_ranks", "state_is_finite"]

NONFINITE_SURFACE = "state.nonfinite"


_CHUNK = 1 << 24
"""Elements tested at a time: the boolean temporary of one pass stays small (16 MiB) however large the tensor."""


def _finite(t: torch.Tensor, *, nan_only: bool = False) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device (no host sync): every element of ``t`` finite (``nan_only``: not NaN).
    Float8 types are tested in float32 (``isfinite`` has no float8 kernel; e4m3fn has no inf but has NaN, which
    survives the cast)."""
    flat = t.reshape(-1)
    cast = t.dtype.itemsize == 1
    test = (lambda c: ~torch.isnan(c)) if nan_only else torch.isfinite
    parts = [test(c.float() if cast else c).all() for c in flat.split(_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).all()


def _floating(tensors: Iterable[object]) -> Iterable[torch.Tensor]:
    for x in tensors:
        if isinstance(x, torch.Tensor):
            t = local_tensor(x.detach())
            if t.is_floating_point() and t.numel() > 0 and t.device.type != "meta":
                yield t


def state_is_finite(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer] = ()) -> bool:
    """Whether every floating tensor this rank holds of the model's state is finite: parameters, each optimizer's
    state (an inf in AdamW's ``exp_avg_sq`` freezes its parameter's element while the parameter stays finite,
    and every replica agrees on it), and buffers free of NaN (a buffer may hold -inf on purpose: an attention
    mask). One device sync for all of them."""
    modules = list(modules)
    flags = [_finite(t) for m in modules for t in _floating(m.parameters())]
    flags += [_finite(t, nan_only=True) for m in modules for t in _floating(m.buffers())]
    flags += [_finite(t) for o in optimizers for st in o.state.values() for t in _floating(st.values())]
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
        reason=(f"the model's state (parameters, buffers or optimizer state) is not finite (NaN or inf) on ranks "
                f"{ranks}: training diverged, or a corruption reached every replica through the averaged gradients "
                "before any replay could compare it; no snapshot after the verified generation is trusted"),
        evidence={"reason": "nonfinite_state"})
