"""One expert's replay on given rows: its forward and backward (functional gradients, never ``.grad``) under a
seeded RNG, and the output, input gradient and weight gradients signed for exact C3.

Also the seeded rows an expert replays where it saw none (or in the emergency sweep): identical on every rank
without a transfer. :class:`scout_core.moe.replay.ExpertReplay` decides what is replayed, where and when.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from scout_core.replay.rng import RngProvider, seeded_rng_scope
from scout_core.signature import local_tensor, sign_many

__all__ = ["SWEEP_ROWS", "expert_pass", "first_tensor", "seeded_rows", "signed_surfaces"]

SWEEP_ROWS = 64
"""Rows per expert in an emergency sweep without a shape catalog (a 16-row-tile kernel's interior and a
64-row tile's: without a catalog nothing says which shapes matter, see docs/moe.md)."""


def expert_pass(expert: nn.Module, x: torch.Tensor, check: int, rng_providers: Mapping[str, RngProvider], *,
                deterministic: bool) -> tuple[torch.Tensor, Sequence[torch.Tensor | None]]:
    """(output, gradients of the input and of each trainable parameter) of ``expert`` on ``x``, the output
    gradient drawn from a generator seeded by ``check``: the same on every peer without a transfer."""
    # The same seeded RNG on every peer (dropout masks alike), training's RNG streams untouched; autograd
    # on even when a caller runs the boundary under no_grad (also for the parameters, which a view makes
    # here as slices of its weights: under no_grad they would not require grad).
    with seeded_rng_scope(7_919 * check + 101, rng_providers, deterministic=deterministic,
                          device=x.device), torch.enable_grad():
        params = [p for p in expert.parameters() if p.requires_grad]
        xi = x.detach().clone().requires_grad_(x.is_floating_point())
        out = first_tensor(expert(xi))
        gen = torch.Generator().manual_seed(7_919 * check + 17)
        grad_out = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
        grads = torch.autograd.grad([out], [xi, *params], grad_outputs=[grad_out], allow_unused=True) \
            if out.requires_grad else (None,) * (1 + len(params))
    return out, grads


def signed_surfaces(out: torch.Tensor, grads: Sequence[torch.Tensor | None]) -> list[tuple[str, Any]]:
    """(surface, (signature, nonfinite)) of the output, the input gradient and the weight gradients of one
    :func:`expert_pass` (a surface without any tensor is left out)."""
    # Local values of DTensors (an expert-parallel weight's gradient): signing them must not communicate.
    groups = [("output", [local_tensor(out.detach())]),
              ("grad_input", [local_tensor(g) for g in grads[:1] if g is not None]),
              ("grad_param", [local_tensor(g) for g in grads[1:] if g is not None])]
    out_sig = []
    for name, tensors in groups:
        if tensors:
            signed = sign_many([torch.cat([t.reshape(-1) for t in tensors])])[0]
            out_sig.append((name, (signed.signature, signed.nonfinite)))
    return out_sig


def seeded_rows(li: int, ei: int, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows for an expert that has seen none (or for the sweep): identical on every rank, no transfer."""
    gen = torch.Generator().manual_seed(1_000_003 * li + ei)
    return torch.randn(rows, width, generator=gen).to(dtype)


def first_tensor(out: Any) -> torch.Tensor:
    """An expert's output tensor: itself, or the first tensor of a tuple, list, dict or dataclass it returns
    (Megatron's experts return ``(out, bias)``)."""
    if isinstance(out, torch.Tensor):
        return out
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        out = [getattr(out, f.name) for f in dataclasses.fields(out)]
    elif isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    raise TypeError(f"an expert returned {type(out).__name__}, with no tensor to compare")
