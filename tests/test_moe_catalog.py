"""The MoE shape catalog: path counts, the reference kernel, dominance compression, the catalog file."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from scout_core.moe.catalog import (
    Catalog,
    CatalogDrift,
    ExpertProblem,
    KernelOpProfiler,
    MoESpec,
    ReferencePathProfiler,
    build_catalog,
    catalog_environment,
)
from scout_core.moe.dominance import compress, dominates
from scout_core.moe.paths import PATH_ROLES, ReferenceGroupedGemm, TileConfig, path_counts

TILE = TileConfig(bm=4, bn=8, bk=8)


def test_path_counts_by_hand():
    # 10 x 20 output in 4 x 8 tiles: rows 4+4+2, columns 8+8+4; K = 12: one full step and a tail.
    assert path_counts(10, 20, 12, TILE) == {"interior": 4, "row_tail": 2, "col_tail": 2, "corner": 1,
                                             "k_step": 9, "k_tail": 9}
    assert path_counts(8, 16, 16, TILE) == {"interior": 4, "row_tail": 0, "col_tail": 0, "corner": 0,
                                            "k_step": 8, "k_tail": 0}
    assert set(path_counts(0, 16, 16, TILE).values()) == {0}
    with pytest.raises(ValueError):
        path_counts(-1, 4, 4, TILE)


@pytest.mark.parametrize("m", [0, 1, 3, 4, 5, 9, 16])
def test_reference_kernel_computes_the_gemm_and_runs_the_counted_paths(m):
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 12, generator=gen), torch.randn(12, 20, generator=gen)
    kernel = ReferenceGroupedGemm(tile=TILE)
    (out,) = kernel([x], [w])
    torch.testing.assert_close(out, x @ w)
    assert kernel.counts == path_counts(m, 20, 12, TILE)


def test_a_row_tail_fault_shows_only_on_shapes_with_a_row_tail():
    def fault(role, tile):
        if role == "row_tail":
            tile[0, 0] += 1.0

    w = torch.randn(12, 16)
    for m in range(0, 13):
        x = torch.randn(m, 12)
        (out,) = ReferenceGroupedGemm(tile=TILE, fault=fault)([x], [w])
        assert torch.equal(out, ReferenceGroupedGemm(tile=TILE)([x], [w])[0]) == (m % TILE.bm == 0)


def test_the_profiler_counts_what_the_kernel_runs():
    prof = ReferencePathProfiler(small=TILE, large=TileConfig(bm=8, bn=8, bk=8), switch_rows=6)
    for m in (0, 3, 6, 7, 13):
        record = prof.profile(ExpertProblem(m, 12, 20, group=2))
        x, up, down = torch.randn(m, 12), torch.randn(12, 20), torch.randn(20, 12)
        tile = TILE if m <= 6 else TileConfig(bm=8, bn=8, bk=8)
        k1, k2 = ReferenceGroupedGemm(tile=tile), ReferenceGroupedGemm(tile=tile)
        k1([x, x], [up, up])
        k2([torch.randn(m, 20)] * 2, [down, down])
        assert record.counts == tuple(k1.counts[r] for r in PATH_ROLES) + tuple(k2.counts[r] for r in PATH_ROLES)
        assert ("tile4x8x8" in record.fingerprint) == (m <= 6)


def test_compress_known_answers():
    assert compress({"a": (2, 0), "b": (1, 1), "c": (0, 2), "d": (1, 0), "e": (2, 0)}) == ["b", "c", "e"]
    assert compress({"a": (1, 1), "b": (2, 2), "c": (3, 3)}) == ["c"]  # a chain: the top covers all
    assert compress({"z": (0, 0), "a": (0, 1)}) == ["a"]  # zero rows run nothing: never replayed
    assert compress({"x": (1, 2), "y": (1, 2)}) == ["y"]  # equal counts: the last (widest tail) stays
    assert compress({}) == []
    assert dominates((2, 2), (2, 1)) and not dominates((2, 0), (1, 1))


def test_compress_is_the_minimum_cover():
    rng = random.Random(0)
    for _ in range(200):
        counts = {i: tuple(rng.randrange(3) for _ in range(3)) for i in range(rng.randrange(1, 7))}
        kept = compress(counts)
        nonzero = [s for s, v in counts.items() if any(v)]
        assert all(any(dominates(counts[k], counts[s]) for k in kept) for s in nonzero)  # covers
        smallest = next(len(c) for n in range(len(nonzero) + 1) for c in itertools.combinations(nonzero, n)
                        if all(any(dominates(counts[k], counts[s]) for k in c) for s in nonzero))
        assert len(kept) == smallest


def test_catalog_representatives_and_round_trip(tmp_path):
    spec = MoESpec(layers=("layers.0.moe", "layers.1.moe"), experts=8, ep_size=4, capacity=128)
    ticks = []
    catalog = build_catalog(spec, progress=lambda done, total: ticks.append((done, total)))
    assert ticks[-1] == (len(ticks), 2 * 4 * 2 * 129)
    assert catalog.admitted == 2 * 4 * 2 * 129
    # Small tiles (16 rows) up to 64 rows, large (64 rows) beyond: per kernel, the largest full shape and the
    # shape with the most full tiles plus the widest row tail.
    assert catalog.representatives("layers.1.moe", 3) == [63, 64, 127, 128]
    path = tmp_path / "catalog.json"
    catalog.save(path)
    again = Catalog.load(path, expect=catalog_environment(spec, ReferencePathProfiler()))
    assert again.entries == json.loads(json.dumps(catalog.entries))


def test_catalog_drift_and_bad_files_are_clear(tmp_path):
    spec = MoESpec()
    path = tmp_path / "catalog.json"
    build_catalog(spec).save(path)
    other = catalog_environment(MoESpec(capacity=64), ReferencePathProfiler())
    with pytest.raises(CatalogDrift, match="model: built"):
        Catalog.load(path, expect=other)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a SCOUT catalog"):
        Catalog.load(bad)
    bad.write_text(json.dumps({"format": "scout-moe-catalog", "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        Catalog.load(bad)
    with pytest.raises(ValueError, match="divide"):
        MoESpec(experts=6, ep_size=4)


def test_scout_catalog_build(tmp_path, capsys):
    from scout_core.cli import main

    out = tmp_path / "c.json"
    assert main(["catalog", "build", "--out", str(out), "--capacity", "32", "--experts", "4"]) == 0
    assert "admitted shapes" in capsys.readouterr().out
    assert Catalog.load(out).admitted == 4 * 33
    assert main(["catalog", "build", "--out", str(out), "--experts", "6"]) == 2
    assert "must divide" in capsys.readouterr().err


@pytest.mark.parametrize("row", range(15))
def test_a_fault_on_any_row_of_a_tail_tile_shows_on_a_representative(row):
    """Keeping the widest tail of equal counts: a defect that needs row ``row`` of a 16-row tile's tail shows on
    the catalog's representatives (31 and 32 rows of 0..32), not only on some training shape."""
    spec = MoESpec(hidden=32, ffn=32, experts=4, ep_size=4, capacity=32)
    reps = build_catalog(spec).representatives("layers.0.moe", 0)

    def fault(role, tile):
        if role == "row_tail" and tile.shape[0] > row:
            tile[row, 0] += 1.0

    w = torch.randn(32, 32)
    shown = [m for m in reps if not torch.equal(ReferenceGroupedGemm(fault=fault).gemm(torch.ones(m, 32), w),
                                                ReferenceGroupedGemm().gemm(torch.ones(m, 32), w))]
    assert shown, f"a fault on tail row {row} hides from representatives {reps}"


def test_the_catalog_is_checked_against_the_live_model():
    """Built for another width, local expert count, EP size or fewer EP positions: refused with the reason."""
    catalog = build_catalog(MoESpec(hidden=32, ffn=32, experts=8, ep_size=4, capacity=16))
    cpu = torch.device("cpu")
    catalog.check_runtime(["layers.0.moe"], cpu, position=3, hidden=32, local_experts=2, ep_size=4)
    with pytest.raises(CatalogDrift, match="hidden: built 32, now 64"):
        catalog.check_runtime(["layers.0.moe"], cpu, hidden=64)
    with pytest.raises(CatalogDrift, match="local experts: built 2, now 1"):
        catalog.check_runtime(["layers.0.moe"], cpu, local_experts=1)
    with pytest.raises(CatalogDrift, match="ep_size: built 4, now 8"):
        catalog.check_runtime(["layers.0.moe"], cpu, ep_size=8)
    with pytest.raises(KeyError, match="EP position 5"):
        catalog.check_runtime(["layers.0.moe"], cpu, position=5)
    with pytest.raises(ValueError, match="no entries for MoE layer"):
        catalog.check_runtime(["layers.1.moe"], cpu)


_SWITCHING_KERNEL = '''
import torch
import torch.nn.functional as F


def gemm(x, w):  # a matrix-vector path for few rows, as vendor libraries switch kernels by shape
    if 0 < x.shape[0] <= 3:
        return torch.stack([torch.mv(w.t(), row) for row in x])
    return x @ w


def expert(x, up, down):
    return gemm(F.silu(gemm(x, up)), down)
'''


def test_the_op_profiler_finds_a_kernel_switch_it_has_no_model_of(tmp_path, monkeypatch, capsys):
    """KernelOpProfiler learns the paths from the operators the user's own expert code runs, forward and
    backward: the matrix-vector path (1-3 rows) is represented (by 3 rows at least), the GEMM's by the capacity, and
    0 rows never."""
    from scout_core.cli import main

    (tmp_path / "user_kernel.py").write_text(_SWITCHING_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_kernel

    spec = MoESpec(layers=("layers.0.moe",), hidden=16, ffn=16, experts=4, ep_size=2, capacity=12)
    catalog = build_catalog(spec, KernelOpProfiler(user_kernel.expert, kernel_name="user_kernel:expert"))
    reps = catalog.representatives("layers.0.moe", 0)
    assert 3 in reps and reps[-1] == 12 and set(reps) <= {1, 2, 3, 12}
    assert catalog.environment["profiler"] == "ops" and catalog.environment["tiles"]["kernel"] == "user_kernel:expert"
    out = tmp_path / "ops.json"
    assert main(["catalog", "build", "--out", str(out), "--profiler", "ops", "--kernel", "user_kernel:expert",
                 "--dtype", "float32", "--hidden", "16", "--ffn", "16", "--experts", "4", "--ep-size", "2",
                 "--capacity", "12"]) == 0
    assert Catalog.load(out).representatives("layers.0.moe", 1) == reps
    assert main(["catalog", "build", "--out", str(out), "--profiler", "ops", "--kernel", "user_kernel"]) == 2
    assert main(["catalog", "build", "--out", str(out), "--kernel", "user_kernel:expert"]) == 2
    assert "--kernel" in capsys.readouterr().err
