"""Tensor signatures: bit-flip sensitivity, cross-process equality, binding of shape/dtype."""

from __future__ import annotations

import random

import pytest
import torch

from scout_core import signature as sigmod
from scout_core.signature import FOLD_WORDS, fold, sign_many, signature, signed
from scout_core.testing.inject import _flip_bit
from scout_core.testing.launcher import RankContext, launch

PINNED_ARANGE_1000 = 918835545963788145
PINNED_ARANGE_70000 = 568334426691217200

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int8, torch.uint8,
          torch.int64, torch.bool]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))


def _random_tensor(rng: random.Random, dtype: torch.dtype, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.rand(numel, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (numel,), generator=gen, dtype=dtype)


def test_single_bit_flips_always_change_signature():
    rng = random.Random(2026)
    # Sizes straddle the fold geometry: tiny, byte lengths not a multiple of 8,
    # exactly FOLD_WORDS words, one row plus a tail, several rows plus a tail.
    sizes = [1, 3, 7, 13, 511, FOLD_WORDS, 4097, 8 * FOLD_WORDS + 5, 70_001]
    flips = 0
    for dtype in DTYPES:
        for numel in sizes:
            base = _random_tensor(rng, dtype, numel)
            ref = signature(base)
            width = 1 if dtype == torch.bool else base.element_size() * 8
            for _ in range(12):
                t = base.clone()
                _flip_bit(t, rng.randrange(numel), rng.randrange(width))
                assert signature(t) != ref, (dtype, numel)
                flips += 1
    assert flips >= 1000


def test_every_bit_of_one_word_and_of_a_tail_byte():
    t = torch.zeros(8 * FOLD_WORDS + 3, dtype=torch.uint8)
    ref = signature(t)
    sigs = set()
    for index in (0, 4095, t.numel() - 1):  # body start, body end, tail
        for bit in range(8):
            c = t.clone()
            _flip_bit(c, index, bit)
            sigs.add(signature(c))
    assert ref not in sigs and len(sigs) == 24


def test_shape_and_dtype_are_bound():
    t = torch.arange(24, dtype=torch.float32)
    assert signature(t) != signature(t.reshape(4, 6))
    assert signature(t.reshape(4, 6)) != signature(t.reshape(6, 4))
    assert signature(t) != signature(t.view(torch.int32))  # same bytes, other dtype


def test_signed_zero_and_nan_payloads_distinguished():
    assert signature(torch.tensor([0.0])) != signature(torch.tensor([-0.0]))
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(a).all() and torch.isnan(b).all()
    assert signature(a) != signature(b)


def test_views_sign_their_logical_content():
    base = torch.randn(9, 7)
    assert signature(base.t()) == signature(base.t().contiguous())
    sliced = torch.randn(1001)[1:]  # misaligned storage offset
    assert signature(sliced) == signature(sliced.clone())
    x = torch.randn(6)
    assert signature(x[::2]) == signature(x[::2].contiguous())


def test_empty_and_scalar_tensors():
    assert signature(torch.empty(0)) != signature(torch.empty(0, 3))
    assert signature(torch.tensor(1.0)) != signature(torch.tensor([1.0]))


def test_nonfinite_count_travels_beside_signature():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    assert signed(t).nonfinite == 3
    assert signed(torch.randn(100)).nonfinite == 0
    # Finite values whose sum overflows trip the gate but count exactly.
    assert signed(torch.full((4,), 3e38)).nonfinite == 0
    assert signed(torch.full((100,), 60000.0, dtype=torch.float16)).nonfinite == 0
    assert signed(torch.tensor([1, 2, 3])).nonfinite == 0
    if hasattr(torch, "float8_e5m2"):
        assert signed(torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)).nonfinite == 1


def test_fold_width_is_bounded():
    assert fold(torch.randn(10_000)).shape == (FOLD_WORDS,)
    assert fold(torch.randn(3)).shape == (FOLD_WORDS,)


def test_many_tensors_cost_one_transfer(monkeypatch):
    calls = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        calls.append(self.shape)
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    tensors = [torch.randn(100 + i) for i in range(10)] + [torch.arange(7)]
    out = sign_many(tensors)
    assert len(out) == 11 and len(calls) == 1
    assert [s.signature for s in out] == [signature(t) for t in tensors]


def test_rejects_non_tensors():
    with pytest.raises(TypeError):
        sign_many([torch.ones(1), [1, 2]])  # type: ignore[list-item]


def _sign_in_rank(ctx: RankContext) -> list[int]:
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(777, generator=gen), torch.randn(33, 3, generator=gen).bfloat16(), torch.arange(10)]
    return [s.signature for s in sign_many(tensors)]


def test_equal_tensors_in_different_processes_sign_equal():
    result = launch(_sign_in_rank, 3, timeout_s=60)
    assert result.ok, result.failures()
    assert result.values()[0] == result.values()[1] == result.values()[2] == _sign_in_rank(None)  # type: ignore[arg-type]


def test_finalize_is_stable_across_versions():
    # Pin the wire format: a change here breaks cross-version peers in a rolling upgrade.
    assert signature(torch.zeros(4, dtype=torch.float32)) == sigmod._finalize(
        b"scout-sig-v2|torch.float32|4|16|", bytes(8 * FOLD_WORDS))
    # ... and the weights and multipliers of the fold (no torch random stream involved)
    assert signature(torch.arange(1000, dtype=torch.float32)) == PINNED_ARANGE_1000
    assert signature(torch.arange(70_000, dtype=torch.int64)) == PINNED_ARANGE_70000


def test_the_int8_gemm_and_the_float_path_fold_alike(monkeypatch):
    """Peers on different paths (a device without the int8 GEMM, very few rows on CUDA) must sign alike."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=gen) for n in (1, 7, 1000, 4097, 70_001, 300_000)]
    tensors.append(torch.full((5000,), -128, dtype=torch.int8))  # the largest |byte| everywhere
    with_gemm = [fold(t) for t in tensors]
    monkeypatch.setitem(sigmod._int_mm_ok, torch.device("cpu"), False)
    assert all(torch.equal(a, fold(t)) for a, t in zip(with_gemm, tensors))


def test_tensors_over_one_chunk_see_a_flip_in_every_chunk():
    t = torch.zeros(64 * 2**20 + 13, dtype=torch.uint8)
    ref = signature(t)
    for pos in (0, 64 * 2**20 - 1, 64 * 2**20, t.numel() - 1):  # first chunk, its end, the second chunk, tail
        c = t.clone()
        c[pos] ^= 4
        assert signature(c) != ref, pos
