"""A source rank's captured call, shipped to its peers: what it announces, the buffers they receive it in, and
the broadcast of its tensors (any call structure: :mod:`~scout_core.replay.calls`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scout_core.replay.capture import Captured
from scout_core.replay.rng import RngProvider, capture_rng

__all__ = ["ShippedCall", "broadcast_call", "call_meta", "receive_buffers"]


@dataclass
class ShippedCall:
    """The source's call as every peer holds it after the broadcast."""

    tensors: list[torch.Tensor]
    spec: Any
    requires_grad: list[bool]
    grad_outputs: dict[int, torch.Tensor]
    rng: dict[str, torch.Tensor]
    on_host: list[bool] | None = None
    """Per tensor, whether it lives on the host (set for saved calls; a live call's tensors say it themselves)."""


def call_meta(captured: Captured, providers: Mapping[str, RngProvider]) -> dict[str, Any]:
    """What the source announces before the tensors: structure, shapes, dtypes, devices (host or the
    layer's), RNG (small, picklable)."""
    return {
        "spec": captured.spec,
        "tensors": [(tuple(t.shape), t.dtype, t.device.type) for t in captured.tensors],
        "mask": list(captured.requires_grad),
        "grads": {i: (tuple(g.shape), g.dtype, g.device.type) for i, g in sorted(captured.grad_outputs.items())},
        "rng": dict(capture_rng(providers)),
    }


def receive_buffers(meta: dict[str, Any], captured: Captured | None, device: torch.device,
                    is_source: bool) -> ShippedCall:
    """The source's own (contiguous) tensors on the source; empty buffers of the announced shapes elsewhere."""
    if is_source:
        assert captured is not None
        tensors = [t.contiguous() for t in captured.tensors]
        grads = {i: captured.grad_outputs[i].contiguous() for i in meta["grads"]}
    else:
        tensors = [torch.empty(shape, dtype=dtype, device=_receive_device(kind, device))
                   for shape, dtype, kind in meta["tensors"]]
        grads = {i: torch.empty(shape, dtype=dtype, device=_receive_device(kind, device))
                 for i, (shape, dtype, kind) in meta["grads"].items()}
    return ShippedCall(tensors, meta["spec"], meta["mask"], grads, meta["rng"])


def _receive_device(device_type: str, layer_device: torch.device) -> torch.device:
    """Where a peer receives a tensor the source holds on ``device_type``: the host, or this rank's
    accelerator of that type. Not simply the layer's parameter device: CPU-offloaded FSDP keeps parameters
    on the host while the layer computes on the accelerator, and the device decides which group (gloo or
    the device group) broadcasts the tensor, which must be the same on every peer."""
    if device_type == "cpu":
        return torch.device("cpu")
    if layer_device.type == device_type:
        return layer_device
    return torch.device(device_type, getattr(torch, device_type).current_device())


_COALESCED_BYTES = 1 << 20
"""Small tensors of one device and dtype travel in one broadcast up to this many bytes in all (a check on a busy
host pays each collective's latency); a larger one travels alone, with no transient copy of an activation."""


def broadcast_call(call: ShippedCall, src: int, group: Any, host_group: Any) -> None:
    """Device tensors on the peers' device group, host tensors (a CPU ``max_seqlen``, positions) on gloo. Every
    peer holds the same tensors in the same order (the broadcast metadata), so every peer forms the same
    buckets."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in each open bucket
    for t in [*call.tensors, *call.grad_outputs.values()]:
        on = host_group if t.device.type == "cpu" else group
        key = (t.device, t.dtype)
        if t.nbytes > _COALESCED_BYTES:
            dist.broadcast(t, src=src, group=on)
            continue
        if filled.get(key, 0) + t.nbytes > _COALESCED_BYTES:
            _broadcast_together(buckets.pop(key), src, on)
            filled[key] = 0
        buckets.setdefault(key, []).append(t)
        filled[key] = filled.get(key, 0) + t.nbytes
    for (device, _), bucket in buckets.items():
        _broadcast_together(bucket, src, host_group if device.type == "cpu" else group)


def _broadcast_together(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    if len(tensors) == 1:
        dist.broadcast(tensors[0], src=src, group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    if dist.get_rank() != src:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
