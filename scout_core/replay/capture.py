"""Capture of a sampled layer's call through public hooks (paper section 9, "Structured replay").

On a due step the capture keeps, for ONE call of the sampled layer (the first
micro-batch): the call split by :func:`~scout_core.replay.calls.flatten_call`
into detached views of its tensor leaves plus a plain spec (``None`` and
non-tensor arguments, keywords, nested containers, dataclasses), each tensor's
``requires_grad``, and the gradient that arrives at every output tensor during
backward. Views are held only until the optimizer boundary, where replay
consumes them; nothing is cloned on steps that are not due, and the hooks
return immediately when disarmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from scout_core.replay.calls import flatten_call, tensor_leaves

__all__ = ["Captured", "LayerCapture"]


@dataclass
class Captured:
    tensors: list[torch.Tensor]
    """The call's tensor leaves, detached, in :func:`flatten_call` order."""
    spec: Any
    """Plain structure of ``(args, kwargs)`` with slots for the tensors."""
    requires_grad: list[bool]
    """Per tensor: whether the training call had it requiring grad."""
    grad_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Output tensor leaf index -> the gradient that reached it in the training backward."""


class LayerCapture:
    """Forward pre / post hooks on one layer, armed per step by the replay engine."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.armed = False
        self.suspended = False  # while replay itself calls the layer
        self.captured: Captured | None = None
        self._hooked = False  # output gradient hooks placed for the captured call (first micro-batch only)
        self._handles = [
            layer.register_forward_pre_hook(self._pre, with_kwargs=True),
            layer.register_forward_hook(self._post, with_kwargs=True),
        ]

    def arm(self) -> None:
        self.armed, self.captured, self._hooked = True, None, False

    def take(self) -> Captured | None:
        """Hand over what was captured and disarm."""
        captured, self.captured, self.armed = self.captured, None, False
        return captured

    def _pre(self, _m: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self.armed or self.suspended or self.captured is not None:
            return
        try:
            tensors, spec = flatten_call((tuple(args), dict(kwargs)))
        except Exception:  # noqa: BLE001 - diagnosis never breaks training: this step's call is not captured,
            return  # and the check finds no call (skipped like a layer that did not run)
        self.captured = Captured(tensors=[t.detach() for t in tensors], spec=spec,
                                 requires_grad=[bool(t.requires_grad) for t in tensors])

    def _post(self, _m: torch.nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
        captured = self.captured
        if not self.armed or self.suspended or captured is None or self._hooked:
            return
        self._hooked = True
        for i, out in enumerate(tensor_leaves(output)):
            if out.requires_grad:
                out.register_hook(_keeper(captured, i))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _keeper(captured: Captured, index: int) -> Any:
    def keep(grad: torch.Tensor) -> None:
        captured.grad_outputs.setdefault(index, grad.detach())

    return keep
