"""Saved replay calls: the newest replayed call of each recipe, kept in every snapshot for the emergency sweep.

A saved call is a host copy (never a view of a training tensor) in a form ``torch.load(weights_only=True)``
accepts: tensors, the argument structure encoded as a tensor, plain lists and dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from scout_core.replay.shipping import ShippedCall
from scout_core.replay.spec_codec import spec_from_tensor, spec_to_tensor

__all__ = ["call_from_dict", "call_to_dict", "to_device"]


def call_to_dict(call: ShippedCall, idx: int) -> dict[str, Any]:
    """A host copy (never a view of a training tensor) of a replayed call, weights-only loadable."""
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    return {"layer": idx, "tensors": [host(t) for t in call.tensors],
            "on_host": [t.device.type == "cpu" for t in call.tensors], "spec": spec_to_tensor(call.spec),
            "mask": list(call.requires_grad), "grads": {str(i): host(g) for i, g in call.grad_outputs.items()},
            "rng": dict(call.rng)}


def call_from_dict(d: Mapping[str, Any]) -> tuple[ShippedCall, int]:
    call = ShippedCall(list(d["tensors"]), spec_from_tensor(d["spec"]), list(d["mask"]),
                       {int(i): g for i, g in d["grads"].items()}, dict(d["rng"]))
    call.on_host = list(d.get("on_host", [False] * len(call.tensors)))
    return call, int(d["layer"])


def to_device(call: ShippedCall, device: torch.device) -> ShippedCall:
    """Saved calls are kept on the host; replay needs them where the layer lives (CPU leaves stay)."""
    def move(t: torch.Tensor, on_host: bool = False) -> torch.Tensor:
        return t if on_host else t.to(device)

    on_host = call.on_host or [False] * len(call.tensors)
    return ShippedCall([move(t, h) for t, h in zip(call.tensors, on_host, strict=True)], call.spec,
                       call.requires_grad, {i: move(g) for i, g in call.grad_outputs.items()}, call.rng)
