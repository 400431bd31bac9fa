"""A vendor-style expert kernel for the shape-dependent MoE cell, written without SCOUT's path model.

Vendor GEMM libraries pick a kernel by shape: a matrix-vector kernel for a handful of rows, a tiled GEMM above
that. :class:`SwitchingExpertKernel` does the same on CPU: up to ``gemv_rows`` rows it computes row by row with
``torch.mv``, above that with one ``torch.mm``. A defect in one of the two shows only on the shapes that run it.
The shape catalog learns the switch by profiling this code (:class:`scout_core.moe.catalog.KernelOpProfiler`);
SCOUT's own tile model (:mod:`scout_core.moe.paths`) knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["SwitchingExpertKernel", "expert"]


class SwitchingExpertKernel:
    """``gemm(x, w)`` for an expert's projections; ``fault``, when set, may change the matrix-vector path's
    output in place (a defective GEMV kernel)."""

    def __init__(self, *, gemv_rows: int = 4, fault: Callable[[torch.Tensor], None] | None = None) -> None:
        self.gemv_rows, self.fault = gemv_rows, fault

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.gemv_rows:
            return torch.mm(x, w)
        if x.shape[0] == 0:
            return x.new_zeros(0, w.shape[1])
        out = torch.stack([torch.mv(w.t(), row) for row in x])
        if self.fault is not None:
            out = out.clone()
            self.fault(out)
        return out

    def expert(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One expert MLP as the model computes it (what the catalog profiles)."""
        return self.gemm(F.silu(self.gemm(x, up)), down)


def expert(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The kernel's expert MLP, healthy: what ``scout catalog build --profiler ops --kernel
    integrations_tests.moe_kernel:expert`` profiles."""
    return SwitchingExpertKernel().expert(x, up, down)
