"""A model state that is not finite is never certified, and says so (a hole replay cannot see by itself).

Replay compares replicas: a corruption that reaches every replica alike is invisible to it. The commonest such
case is a defect whose output is an inf or NaN on one rank: the loss, then the averaged gradients, then every
replica's weights become NaN within a step, and from then on every replay agrees (on NaN). Certification would
then verify a NaN state, and a job without SCOUT's checkpoints would hear nothing. So at each check's boundary
(certifying or not) each rank checks that its parameters, buffers and, where SCOUT certifies, optimizer state
are finite (one pass over them, one host sync per device); a state that is not finite anywhere is evidence like
an inconclusive check: the candidate is rejected, nothing is captured, and an ``inconclusive`` record of scope
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
    cast = t.dtype.itemsize == 1
    test = (lambda c: ~torch.isnan(c)) if nan_only else torch.isfinite
    if t.numel() <= _CHUNK or not t.is_contiguous():
        return test(t.float() if cast else t).all()
    return torch.stack([test(c.float() if cast else c).all() for c in t.view(-1).split(_CHUNK)]).all()


def _floating(tensors: Iterable[object]) -> Iterable[torch.Tensor]:
    for x in tensors:
        if isinstance(x, torch.Tensor):
            t = local_tensor(x.detach())
            if t.is_floating_point() and t.numel() > 0 and t.device.type != "meta":
                yield t


def state_is_finite(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer] = (), *,
                    skipped: list[str] | None = None) -> bool:
    """Whether every floating tensor this rank holds of the model's state is finite: parameters, each optimizer's
    state (an inf in AdamW's ``exp_avg_sq`` freezes its parameter's element while the parameter stays finite,
    and every replica agrees on it), and buffers free of NaN (a buffer may hold -inf on purpose: an attention
    mask). One host sync per device the state lives on.

    A parameter that cannot be tested raises. An optimizer-state tensor or buffer that cannot (a tensor
    subclass without an ``isfinite`` kernel) is left out and named in ``skipped``: one odd tensor must not stop
    every capture for the rest of the run."""
    modules = list(modules)
    # nn.Module's own methods, unbound: a wrapper may shadow them (Megatron's DDP keeps a list named ``buffers``).
    flags = [_finite(t) for m in modules for t in _floating(torch.nn.Module.parameters(m))]
    others = [(t, True, "buffer") for m in modules for t in _floating(torch.nn.Module.buffers(m))]
    for o in optimizers:
        try:  # a framework's optimizer wrapper may not hold a torch optimizer's ``state`` mapping
            others += [(t, False, f"optimizer state {k!r}") for st in o.state.values() if isinstance(st, dict)
                       for k, x in st.items() for t in _floating([x])]
        except Exception as exc:  # noqa: BLE001 - left out and said so, the rest is still checked
            if skipped is not None:
                skipped.append(f"the state of {type(o).__name__} ({type(exc).__name__}: {exc})")
    for t, nan_only, what in others:
        try:
            flags.append(_finite(t, nan_only=nan_only))
        except Exception as exc:  # noqa: BLE001 - left out and said so, the rest is still checked
            if skipped is not None:
                skipped.append(f"{what} {tuple(t.shape)} {t.dtype} ({type(exc).__name__}: {exc})")
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return all(bool(torch.stack(fs).all()) for fs in by_device.values())


def nonfinite_ranks(mine: bool, group: object) -> list[int]:
    """Every rank's answer (the rare path, after the evidence said some rank's state is not finite)."""
    flag = torch.tensor([int(mine)], dtype=torch.int32)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, flag, group=group)
    return [r for r, f in enumerate(flags) if int(f.item())]


def nonfinite_incident(step: int, ranks: list[int], *, certifying: bool = True) -> Incident:
    """The record of a state that is not finite; ``certifying``: SCOUT's certification runs (what is restored)."""
    after = ("no snapshot after the verified generation is trusted" if certifying else
             "SCOUT's checkpoints are off (checkpoint.enabled), so nothing verified is kept to restore")
    return Incident(
        kind=IncidentKind.INCONCLUSIVE, scope=IncidentScope.JOB, ranks=ranks, hosts=[], step=step,
        surface=NONFINITE_SURFACE,
        reason=(f"the model's state (parameters, buffers or optimizer state) is not finite (NaN or inf) on ranks "
                f"{ranks}: training diverged, or a corruption reached every replica through the averaged gradients "
                f"before any replay could compare it, and replay cannot name its cause; {after}"),
        evidence={"reason": "nonfinite_state"})
