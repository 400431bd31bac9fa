"""Execution paths of a tiled (grouped) GEMM, and a reference kernel that counts them (paper section 6.2).

A tiled GEMM ``[m, k] @ [k, n]`` computes its output in ``bm x bn`` tiles, each accumulating over ``k`` in steps
of ``bk``. Which code runs depends on where a tile sits: an *interior* tile is full; a *row-tail* tile is cut
by the last rows (``m % bm``), a *column-tail* tile by the last columns (``n % bn``), a *corner* tile by both;
inside every tile the K loop runs full steps and, when ``k % bk``, one *K-tail* step. A fault in the hardware
or code of one path (a masked store in row-tail tiles, say) shows only on shapes that execute that path, which
is why replay must cover the paths, not just some shape.

:func:`path_counts` is the analytic count for one GEMM; :class:`ReferenceGroupedGemm` really computes a grouped
GEMM tile by tile on any device, counts the paths it ran, and can corrupt one path role (for fault cells);
:func:`select_tile` is the kernel's heuristic choice of tile by shape, as vendor libraries choose kernels, so
shapes fall into several kernel fingerprints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PATH_ROLES", "ReferenceGroupedGemm", "TileConfig", "path_counts", "select_tile"]

PATH_ROLES = ("interior", "row_tail", "col_tail", "corner", "k_step", "k_tail")
"""Output-tile roles by position, then the K-loop's full and tail steps summed over all tiles."""


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    """One kernel's tile shape."""

    bm: int = 16
    """Rows of an output tile."""
    bn: int = 32
    """Columns of an output tile."""
    bk: int = 32
    """Depth of one K-loop step."""

    def __post_init__(self) -> None:
        if min(self.bm, self.bn, self.bk) < 1:
            raise ValueError(f"tile sizes must be >= 1, got {self}")

    @property
    def name(self) -> str:
        return f"tile{self.bm}x{self.bn}x{self.bk}"


def select_tile(m: int, n: int, k: int, *, small: TileConfig | None = None, large: TileConfig | None = None,
                switch_rows: int = 64) -> TileConfig:
    """The tile the reference kernel uses for a ``[m, k] @ [k, n]`` problem: narrow row tiles for few rows
    (little work to spread), wide ones beyond ``switch_rows``, as a vendor heuristic picks a kernel per shape."""
    small = small or TileConfig(bm=16, bn=32, bk=32)
    large = large or TileConfig(bm=64, bn=32, bk=32)
    return small if m <= switch_rows else large


def path_counts(m: int, n: int, k: int, tile: TileConfig) -> dict[str, int]:
    """How often each path runs for one ``[m, k] @ [k, n]`` GEMM (0 rows: nothing runs)."""
    if min(m, n, k) < 0:
        raise ValueError(f"negative GEMM size m={m} n={n} k={k}")
    full_r, tail_r = divmod(m, tile.bm)
    full_c, tail_c = divmod(n, tile.bn)
    row_tiles, col_tiles = full_r + (tail_r > 0), full_c + (tail_c > 0)
    tiles = row_tiles * col_tiles
    return {
        "interior": full_r * full_c,
        "row_tail": (tail_r > 0) * full_c,
        "col_tail": full_r * (tail_c > 0),
        "corner": (tail_r > 0) * (tail_c > 0),
        "k_step": tiles * (k // tile.bk),
        "k_tail": tiles * (k % tile.bk > 0),
    }


def _role(r_rows: int, c_cols: int, tile: TileConfig) -> str:
    row_cut, col_cut = r_rows < tile.bm, c_cols < tile.bn
    return "corner" if row_cut and col_cut else "row_tail" if row_cut else "col_tail" if col_cut else "interior"


class ReferenceGroupedGemm:
    """A grouped GEMM computed tile by tile: ``outs[e] = xs[e] @ ws[e]`` for each expert ``e``.

    ``counts`` accumulates the paths every call ran. ``fault``, when set, is called with (role, tile output)
    for each finished output tile and may change the tile in place: a defect of one path role (used by the
    shape-dependent fault cell). Numerically it is a correct GEMM (fp32 accumulation in K-steps), slower than
    ``torch.matmul``: it is the model of a kernel, for the catalog and for cells, not for production speed.
    """

    def __init__(self, *, tile: TileConfig | None = None,
                 fault: Callable[[str, torch.Tensor], None] | None = None) -> None:
        self.tile = tile
        self.fault = fault
        self.counts: dict[str, int] = dict.fromkeys(PATH_ROLES, 0)

    def __call__(self, xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(xs) != len(ws):
            raise ValueError(f"{len(xs)} inputs for {len(ws)} weights")
        return [self.gemm(x, w) for x, w in zip(xs, ws, strict=True)]

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        k2, n = w.shape
        if k != k2:
            raise ValueError(f"inner sizes differ: {tuple(x.shape)} @ {tuple(w.shape)}")
        tile = self.tile or select_tile(m, n, k)
        for role, c in path_counts(m, n, k, tile).items():
            self.counts[role] += c
        rows = []
        for r0 in range(0, m, tile.bm):
            cols = []
            for c0 in range(0, n, tile.bn):
                xt = x[r0:r0 + tile.bm]
                acc = None
                for k0 in range(0, k, tile.bk):  # K-loop: full steps, then the tail step
                    part = xt[:, k0:k0 + tile.bk] @ w[k0:k0 + tile.bk, c0:c0 + tile.bn]
                    acc = part if acc is None else acc + part
                if acc is None:  # k == 0
                    acc = x.new_zeros(xt.shape[0], min(tile.bn, n - c0))
                if self.fault is not None:
                    acc = acc.clone()
                    self.fault(_role(acc.shape[0], acc.shape[1], tile), acc)
                cols.append(acc)
            rows.append(torch.cat(cols, dim=1))
        return torch.cat(rows, dim=0) if rows else x.new_zeros(0, n)
