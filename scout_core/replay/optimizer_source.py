"""Where no peer holds the same optimizer state (pure FSDP): every peer replays the source's slice.

The optimizer recipe compares each rank's replayed and live slice with its peers' where the peers hold equal state
(DDP, the replicas of an HSDP shard). Under pure FSDP each rank owns its shard's update alone, and its only
evidence was its self-check (its live update against its own replay of it): a defective kernel that errs on every
call agrees with itself there, and was never named. So at each check the check's source (the rank that rotates
over the peers) also sends its slice's inputs, the weight, the gradient and the optimizer state from before the
step, and every peer replays that one update with its own kernel. The signed results are compared across the peers
by exact C3 on the surface ``optimizer.source_replayed``: a rank whose kernel errs computes another update from
the same inputs and is the minority, source or not.

Only plain data crosses (:mod:`scout_core.wire`): tensors of at most :data:`MAX_ELEMS` elements, their dtypes,
numbers, and the hyperparameters that are plain values (a peer takes the rest from its own parameter group).
Every peer joins the one broadcast whatever happened on it before. A slice the source cannot send as such data
(a state tensor that is not per-element and larger than :data:`MAX_ELEMS`, as 8-bit optimizers keep) is not sent:
every peer then has no evidence on this surface, and the optimizer recipe goes on with its other surfaces. A
replay that fails is a diagnosis failure, which skips the check on every peer together.
"""

from __future__ import annotations

from typing import Any

import torch

from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.vetting import SOURCE_SURFACE
from scout_core.signature import sign_many
from scout_core.wire import WireError, broadcast_data

__all__ = ["MAX_ELEMS", "SOURCE_SURFACE", "source_inputs", "source_slice_surface"]

MAX_ELEMS = 1 << 14
"""The most elements of the source's slice the peers replay (its first 16K): enough for a kernel that errs wherever
it computes, and the broadcast stays small. A defect confined to the slice's other elements is not seen on this
surface (the self-check still covers the whole slice, against the rank's own kernel)."""

_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value))


def source_inputs(pending: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the source sends: its slice's first :data:`MAX_ELEMS` elements (weight, gradient, per-element state)
    and its whole small state tensors (a step count), on the host; None when it has no slice this step."""
    if pending is None:
        return None
    n = min(pending["value"].numel(), MAX_ELEMS)
    full = pending["value"].numel()

    def host(t: torch.Tensor) -> torch.Tensor:
        return (t.reshape(-1)[:n] if t.numel() == full else t).detach().cpu().contiguous()

    tensors = {k: v for k, v in pending["state"].items() if isinstance(v, torch.Tensor)}
    if any(v.numel() != full and v.numel() > MAX_ELEMS for v in tensors.values()):
        return None  # whole-parameter state too large to send (an 8-bit optimizer's block scales): no evidence
    state = {k: host(v) for k, v in tensors.items()}
    scalars = {k: v for k, v in pending["state"].items() if not isinstance(v, torch.Tensor) and _plain(v)}
    hyper = {k: v for k, v in pending["hyper"].items() if _plain(v)}
    return {"value": host(pending["value"]), "grad": host(pending["grad"]), "state": state, "scalars": scalars,
            "hyper": hyper, "group": pending["group"]}


def _checked(got: Any) -> dict[str, Any]:
    """The received inputs, or ValueError: the same on every peer, since every peer decoded the same bytes (only
    a source that is not SCOUT's code sends what fails here)."""
    if not isinstance(got, dict) or not {"value", "grad", "state", "scalars", "hyper", "group"} <= set(got):
        raise ValueError("the source's optimizer slice is not the expected mapping")
    tensors = [got["value"], got["grad"], *got["state"].values()] if isinstance(got["state"], dict) else []
    if len(tensors) < 2 or not all(isinstance(t, torch.Tensor) and t.numel() <= MAX_ELEMS for t in tensors):
        raise ValueError("the source's optimizer slice holds no tensors, or tensors too large")
    if got["value"].shape != got["grad"].shape or not isinstance(got["group"], int):
        raise ValueError("the source's optimizer slice is malformed")
    if not all(isinstance(k, str) for k in [*got["state"], *got["scalars"], *got["hyper"]]):
        raise ValueError("the source's optimizer slice names its state with non-strings")
    return got


def _replay(slice_: OptimizerSlice, got: Any) -> Any:
    """This rank's kernel on the source's inputs, signed; None when the source had no slice."""
    if got is None:
        return None
    got = _checked(got)
    groups = slice_.optimizer.param_groups
    first = next((p for g in groups for p in g["params"]), None)
    device = first.device if first is not None else torch.device("cpu")
    own = groups[got["group"]] if 0 <= got["group"] < len(groups) else groups[0]
    hyper = {k: v for k, v in own.items() if k != "params"} | got["hyper"]
    state = {k: v.to(device) for k, v in got["state"].items()} | got["scalars"]
    out = slice_.replay_update(got["value"].to(device), got["grad"].to(device), state, hyper)
    signed = sign_many([out])[0]
    return (signed.signature, signed.nonfinite)


def source_slice_surface(slice_: OptimizerSlice, pending: dict[str, Any] | None, guard: DiagnosisGuard, *,
                         rank: int, src: int, host_group: Any) -> list[tuple[str, Any]]:
    """Every peer's replay of the source's slice, for the exchange. Every peer joins the broadcast."""
    mine = guard.run("optimizer slice for the peers", lambda: source_inputs(pending)) if rank == src \
        else None
    try:
        got = broadcast_data(mine, src, host_group, what="optimizer slice")
    except WireError as exc:  # raised on every peer together: nothing crossed; the source's failure skips the check
        if rank == src:
            guard.fail(exc, "optimizer slice for the peers")
        return [(SOURCE_SURFACE, None)]
    return [(SOURCE_SURFACE, guard.run("optimizer replay of the source's slice", lambda: _replay(slice_, got)))]
