"""Admitted versus selected expert shapes (paper Table 4), with the CPU path model of scout_core.moe.

The paper's A100 kernel admitted 3,457 shapes and kept 16. Here: a 128 x 128 expert projection, one GEMM per
expert, row counts 0..capacity; and grouped execution, 2 to 16 experts per kernel with the same row count
each (docs/moe.md: heterogeneous routing vectors need their own templates). The reference kernel has six path
roles and two tile configurations (chosen by row count), so few shapes survive: per tile configuration, the
largest shape without a row tail and the one with the most full tiles and the widest tail.
"""

from __future__ import annotations

import time
from typing import Any

from scout_core.moe.dominance import compress
from scout_core.moe.paths import PATH_ROLES, path_counts, select_tile

CAPACITY = 4096


def _projection(rows: int, group: int, width: int = 128) -> tuple[str, tuple[int, ...]]:
    tile = select_tile(rows, width, width)
    counts = path_counts(rows, width, width, tile)
    return f"{tile.name}/group{group}", tuple(counts[r] * group for r in PATH_ROLES)


def bench_catalog(capacity: int = CAPACITY) -> dict[str, Any]:
    out: dict[str, Any] = {"capacity": capacity, "paper": {"admitted": 3457, "selected": 16}, "rows": []}
    for group in (1, 2, 4, 8, 16):
        start = time.perf_counter()
        per_fp: dict[str, dict[int, tuple[int, ...]]] = {}
        admitted = 0
        for rows in range(capacity // group + 1):  # the kernel's capacity shared by its experts
            fp, counts = _projection(rows, group)
            per_fp.setdefault(fp, {})[rows] = counts
            admitted += 1
        selected = {fp: compress(shapes) for fp, shapes in per_fp.items()}
        out["rows"].append({"experts_per_kernel": group, "admitted": admitted,
                            "selected": sum(len(v) for v in selected.values()),
                            "fingerprints": len(per_fp), "representatives": {k: list(v) for k, v in selected.items()},
                            "build_s": round(time.perf_counter() - start, 4)})
    return out


def rows(results: dict) -> list[str]:
    cat = results.get("catalog")
    if not cat:
        return []
    lines = []
    for r in cat["rows"]:
        reps = "; ".join(f"{fp}: {v}" for fp, v in r["representatives"].items())
        lines.append(
            f"| shape catalog, 128 x 128 expert projection, {r['experts_per_kernel']} expert(s) per kernel, rows "
            f"0..{cat['capacity'] // r['experts_per_kernel']} each: admitted -> selected (representatives by "
            f"kernel fingerprint) | {r['admitted']} -> {r['selected']} ({reps}) "
            f"| paper Table 4: {cat['paper']['admitted']} -> {cat['paper']['selected']} |")
    return lines
