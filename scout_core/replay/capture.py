"""Capture of a sampled layer's call through public hooks (paper section 9, "Structured replay").

On a due step the capture keeps, for ONE call of the sampled layer (the first
micro-batch): the flattened ``(args, kwargs)`` pytree with detached views of
its tensor leaves, the input ``requires_grad`` mask, and the gradient that
arrives at the layer output during backward. Views are held only until the
optimizer boundary, where replay consumes them; nothing is cloned on steps
that are not due, and the hooks return immediately when disarmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Captured", "LayerCapture"]


@dataclass
class Captured:
    leaves: list[Any]
    """Flattened ``(args, kwargs)``: detached tensors and plain values."""
    spec: Any
    """The pytree spec to rebuild ``(args, kwargs)``."""
    requires_grad: list[bool]
    """Per leaf: whether the training call had it requiring grad."""
    grad_output: torch.Tensor | None = None
    output_index: list[int] = field(default_factory=list)


def first_tensor(value: Any) -> torch.Tensor | None:
    leaves, _ = tree_flatten(value)
    return next((v for v in leaves if isinstance(v, torch.Tensor)), None)


class LayerCapture:
    """Forward pre / post hooks on one layer, armed per step by the replay engine."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.armed = False
        self.suspended = False  # while replay itself calls the layer
        self.captured: Captured | None = None
        self._handles = [
            layer.register_forward_pre_hook(self._pre, with_kwargs=True),
            layer.register_forward_hook(self._post, with_kwargs=True),
        ]

    def arm(self) -> None:
        self.armed, self.captured = True, None

    def take(self) -> Captured | None:
        """Hand over what was captured and disarm."""
        captured, self.captured, self.armed = self.captured, None, False
        return captured

    def _pre(self, _m: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self.armed or self.suspended or self.captured is not None:
            return
        leaves, spec = tree_flatten((args, kwargs))
        self.captured = Captured(
            leaves=[v.detach() if isinstance(v, torch.Tensor) else v for v in leaves],
            spec=spec,
            requires_grad=[bool(isinstance(v, torch.Tensor) and v.requires_grad) for v in leaves],
        )

    def _post(self, _m: torch.nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
        if not self.armed or self.suspended or self.captured is None or self.captured.grad_output is not None:
            return
        out = first_tensor(output)
        if out is None or not out.requires_grad:
            return
        captured = self.captured

        def keep(grad: torch.Tensor) -> None:
            if captured.grad_output is None:
                captured.grad_output = grad.detach()

        out.register_hook(keep)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
