"""On-device 64-bit tensor signatures (paper section 5.2).

A signature must change under any single bit flip, and almost surely under
any other corruption of the bytes (several flips, flips that cancel in a plain
sum, stuck lanes, swapped elements); it binds shape and dtype, and costs about
one pass over the tensor's bytes on its own device.

How (see docs/signatures.md for what is and is not guaranteed): the bytes,
read as signed 8-bit integers, are cut into rows of at most 128 KiB, and each
row is multiplied by a fixed matrix of odd weights in [-63, 63], one row of 8
weights per byte position: ``rows @ W``, an int8 matrix product with exact
int32 results (``|byte * weight| < 2**13``, 2**17 of them per row, so no sum
can overflow). That is the position mix a plain wrapping sum lacks: two flips
cancel only if their two positions carry the same (or opposite) weights in all
8 columns. The 512 row results of a 64 MiB chunk are combined 8 rows at a time
with odd 64-bit multipliers into 64 x 8 = ``FOLD_WORDS`` int64 words, and
chunks are chained Horner-style (``acc * M + chunk``): every step multiplies a
non-zero change by an odd number, so no single change can vanish modulo 2**64.

The product runs as one int8 GEMM (``torch._int_mm``: VNNI on CPU, IMMA on
GPU), checked once per device against an exact float32 formulation (integer
inputs below 2**11, block sums below 2**24: exact even in TF32), which is used
where the int8 GEMM is missing, wrong or inapplicable (very few rows on CUDA).

The words of many tensors are stacked and copied to the host in ONE transfer
(:func:`sign_many`), then finalized on the CPU with BLAKE2b over the words, the
dtype and the shape. A count of non-finite elements (NaN or Inf) travels beside
the signature as its own piece of evidence: a finite-sum gate computed beside
the fold rides in the same transfer, and only a tensor whose gate trips pays for
an exact count.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FOLD_WORDS", "Signed", "fold", "local_tensor", "sign_many", "signature", "signed"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor (the shard of a DTensor): what this rank signs, copies and restores."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


FOLD_COLUMNS = 8
"""Weights per byte position: a pair of positions is blind to opposite changes only if all 8 agree."""
FOLD_ROWS = 64
FOLD_WORDS = FOLD_ROWS * FOLD_COLUMNS
"""The number of int64 words the device fold produces for any tensor."""
_GEMM_ROWS = 512
"""Rows of one chunk's product, combined 8 at a time into ``FOLD_ROWS``."""
_ROW_BYTES_MAX = 1 << 17
"""|int8 byte x weight| <= 128 x 63 < 2**13: a row of 2**17 bytes sums below 2**30, exact in int32."""
_FLOAT_BLOCK = 2048
"""Bytes per float32 partial product in the fallback: 2048 x 2**13 = 2**24, the last exact float32 integer."""
_WEIGHT_SEED = 0x5C0_7516
_ROW_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                    0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3)
"""Odd 64-bit constants (golden-ratio and xxHash/wyhash primes): row j of each group of 8 is scaled by the j-th."""
_CHUNK_MULTIPLIER = 0xFF51AFD7ED558CCD
"""Odd: chaining chunks Horner-style never maps a non-zero change to zero."""

@dataclass(frozen=True)
class Signed:
    """Signature of one tensor plus its non-finite element count."""

    signature: int
    nonfinite: int


_weights: dict[torch.device, torch.Tensor] = {}
_row_mult: dict[torch.device, torch.Tensor] = {}
_int_mm_ok: dict[torch.device, bool] = {}


def _signed64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _weights_on(device: torch.device) -> torch.Tensor:
    """The fixed (2**17, 8) int8 weight matrix: odd values in [-63, 63], the same on every rank and version.

    From splitmix64 over the positions in plain integer arithmetic, not from torch's random generators, whose
    streams may change between torch versions (peers in a rolling upgrade must sign alike)."""
    w = _weights.get(device)
    if w is None:
        z = (torch.arange(1, _ROW_BYTES_MAX * FOLD_COLUMNS + 1, dtype=torch.int64) + _WEIGHT_SEED) \
            * _signed64(0x9E3779B97F4A7C15)
        z = (z ^ _srl(z, 30)) * _signed64(0xBF58476D1CE4E5B9)
        z = (z ^ _srl(z, 27)) * _signed64(0x94D049BB133111EB)
        z = z ^ _srl(z, 31)
        w = 2 * _srl(z, 58) - 63  # the top 6 bits: odd values in [-63, 63]
        w = _weights[device] = w.to(torch.int8).view(_ROW_BYTES_MAX, FOLD_COLUMNS).to(device)
    return w


def _row_multipliers_on(device: torch.device) -> torch.Tensor:
    m = _row_mult.get(device)
    if m is None:
        m = _row_mult[device] = torch.tensor([_signed64(x) for x in _ROW_MULTIPLIERS], dtype=torch.int64,
                                             device=device).view(1, len(_ROW_MULTIPLIERS), 1)
    return m


def _product_float(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``rows @ w`` exactly, as one batched float32 product over blocks of ``_FLOAT_BLOCK`` bytes, whose sums
    stay below 2**24 (int64 result)."""
    m, n = rows.shape
    blocks = -(-n // _FLOAT_BLOCK)
    pad = blocks * _FLOAT_BLOCK - n
    a = rows.to(torch.float32)
    b = w.to(torch.float32)
    if pad:  # zero bytes add nothing
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    partial = torch.bmm(a.view(m, blocks, _FLOAT_BLOCK).transpose(0, 1), b.view(blocks, _FLOAT_BLOCK, -1))
    return partial.to(torch.int64).sum(dim=0)


def _int_mm_usable(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` exists here and computes the exact product (checked once per device)."""
    ok = _int_mm_ok.get(device)
    if ok is None:
        ok = False
        if hasattr(torch, "_int_mm"):
            gen = torch.Generator().manual_seed(1)
            rows = torch.randint(-128, 128, (32, 4096), generator=gen, dtype=torch.int16).to(torch.int8).to(device)
            w = _weights_on(device)[:4096]
            try:
                ok = bool(torch.equal(torch._int_mm(rows, w).to(torch.int64), _product_float(rows, w)))
            except RuntimeError:
                ok = False
        _int_mm_ok[device] = ok
    return ok


def _product(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``rows @ w`` for int8 ``rows`` (m, L) and weights (L, 8): exact, int64. The int8 GEMM where it applies
    (on CUDA: more than 16 rows, 16-byte aligned operands), else, or if it refuses, the float32 path: both
    give the same integers."""
    cuda_ok = rows.device.type != "cuda" or (rows.shape[0] > 16 and rows.shape[1] % 8 == 0
                                               and rows.data_ptr() % 16 == 0)
    if cuda_ok and _int_mm_usable(rows.device):
        try:
            return torch._int_mm(rows, w).to(torch.int64)
        except RuntimeError:  # a layout this device's int8 GEMM does not take
            pass
    return _product_float(rows, w)


def _fold_chunk(chunk: torch.Tensor, row_bytes: int, w: torch.Tensor) -> torch.Tensor:
    """One chunk of at most ``_GEMM_ROWS`` rows: (FOLD_ROWS, FOLD_COLUMNS) int64."""
    out = torch.zeros(_GEMM_ROWS, FOLD_COLUMNS, dtype=torch.int64, device=chunk.device)
    full = chunk.numel() // row_bytes
    if full:
        out[:full] = _product(chunk[: full * row_bytes].view(full, row_bytes), w)
    rest = chunk.numel() - full * row_bytes
    if rest:  # zero-padded: the byte length in the header keeps padding unambiguous
        tail = torch.zeros(1, row_bytes, dtype=torch.int8, device=chunk.device)
        tail[0, :rest] = chunk[full * row_bytes :]
        out[full] = _product(tail, w)[0]
    grouped = out.view(FOLD_ROWS, _GEMM_ROWS // FOLD_ROWS, FOLD_COLUMNS)
    return (grouped * _row_multipliers_on(chunk.device)).sum(dim=1)


def fold(tensor: torch.Tensor) -> torch.Tensor:
    """Fold a tensor's bytes to ``FOLD_WORDS`` int64 words on its device."""
    data = _as_bytes(tensor).view(torch.int8)
    nbytes = data.numel()
    # Rows of a multiple of 8 bytes, as few chunks as the exactness bound allows (one up to 64 MiB).
    per_row = -(-nbytes // _GEMM_ROWS)
    row_bytes = min(_ROW_BYTES_MAX, max(8, (per_row + 7) // 8 * 8))
    chunk_bytes = _GEMM_ROWS * row_bytes
    w = _weights_on(data.device)[:row_bytes]
    acc = torch.zeros(FOLD_ROWS, FOLD_COLUMNS, dtype=torch.int64, device=data.device)
    for start in range(0, nbytes, chunk_bytes):
        acc = acc * _signed64(_CHUNK_MULTIPLIER) + _fold_chunk(data[start : start + chunk_bytes], row_bytes, w)
    return acc.reshape(-1)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of the tensor's logical bytes (copying only if needed)."""
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def _finite_gate(tensor: torch.Tensor) -> torch.Tensor:
    """One float64 value that is finite iff the tensor is probably all finite.

    The sum of a tensor is NaN or Inf whenever any element is (Inf - Inf gives
    NaN), so a finite sum proves every element finite. A non-finite sum can also
    come from overflow of finite values, so it only triggers the exact count.
    The sum runs about 2x faster than ``isfinite`` plus a count on CPU, and is
    one vectorized pass on GPU. Returned as the bit pattern of a float64 in an
    int64 so it rides in the same transfer as the fold.
    """
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return torch.zeros(1, dtype=torch.int64, device=t.device)
    # Native-dtype sums are fast for 2-byte floats (an fp32 accumulation dtype
    # is ~10x slower on CPU); an fp16 sum overflowing to Inf only costs the
    # exact count. float8 has no sum kernel and is upcast.
    acc_dtype = torch.float32 if t.element_size() == 1 else t.dtype
    return torch.sum(t, dtype=acc_dtype).to(torch.float64).reshape(1).view(torch.int64)


def _count_nonfinite(tensor: torch.Tensor) -> int:
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.element_size() == 1:
        t = t.to(torch.float32)  # float8 formats lack isfinite kernels; the upcast is exact
    return int(torch.count_nonzero(~torch.isfinite(t)))


def _header(tensor: torch.Tensor) -> bytes:
    shape = ",".join(str(s) for s in tensor.shape)
    nbytes = tensor.numel() * tensor.element_size()
    return f"scout-sig-v2|{tensor.dtype}|{shape}|{nbytes}|".encode()


def _finalize(header: bytes, words: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(header + words, digest_size=8).digest(), "little")


def sign_many(tensors: Sequence[torch.Tensor]) -> list[Signed]:
    """Sign many tensors with one device-to-host transfer per device.

    Folds run on each tensor's own device; the folds and non-finite counts are
    concatenated there and copied to the host together. Tensors normally live
    on one device, so signing K surfaces costs one transfer.
    """
    if not tensors:
        return []
    # A DTensor is signed by its rank-local shard: what this rank holds and computes with.
    tensors = [local_tensor(t) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"signature expects tensors, got {type(t).__name__} at position {i}")
        by_device.setdefault(t.device, []).append(i)
    out: list[Signed | None] = [None] * len(tensors)
    for idxs in by_device.values():
        parts = []
        for i in idxs:
            parts.append(fold(tensors[i]))
            parts.append(_finite_gate(tensors[i]))
        host = torch.cat(parts).cpu()  # the single transfer for this device
        # tolist + struct instead of .numpy(): numpy is optional for torch.
        words = host.tolist()
        stride = FOLD_WORDS + 1
        for j, i in enumerate(idxs):
            chunk = words[j * stride : (j + 1) * stride]
            payload = struct.pack(f"<{FOLD_WORDS}q", *chunk[:FOLD_WORDS])
            (gate,) = struct.unpack("<d", struct.pack("<q", chunk[FOLD_WORDS]))
            # Only a tensor whose gate tripped pays the exact count (and a
            # second transfer): healthy surfaces stay at one transfer.
            count = 0 if math.isfinite(gate) else _count_nonfinite(tensors[i])
            out[i] = Signed(_finalize(_header(tensors[i]), payload), count)
    return out  # type: ignore[return-value]


def signed(tensor: torch.Tensor) -> Signed:
    """Signature and non-finite count of one tensor."""
    return sign_many([tensor])[0]


def signature(tensor: torch.Tensor) -> int:
    """64-bit signature of one tensor: bytes, dtype and shape."""
    return signed(tensor).signature
