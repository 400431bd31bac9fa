"""On-device 64-bit tensor signatures (paper section 5.2).

A signature must change under any single bit flip, bind shape and dtype, and
cost little more than one pass over the tensor's bytes on its own device.

How: the tensor's bytes are viewed as 64-bit words and folded with a wrapping
integer sum into at most :data:`FOLD_WORDS` partial sums, one per contiguous
row of a ``(FOLD_WORDS, -1)`` view. A single bit flip changes exactly one word
by ``+-2**k`` and therefore exactly one partial sum by a non-zero amount modulo
``2**64``. The row layout keeps the reduction cache-friendly and allocation
free (a column reduction or XOR-halving would be 2-10x slower). Words that do
not fill a whole row, and a tail shorter than 8 bytes, are folded into a small
zero-padded block; the byte length bound into the final hash keeps padding
unambiguous.

The partial sums of many tensors are stacked and copied to the host in ONE
transfer (:func:`sign_many`), then finalized on the CPU with BLAKE2b over the
partial sums, the dtype and the shape. A count of non-finite elements (NaN or
Inf) travels beside the signature as its own piece of evidence: a finite-sum
gate computed beside the fold rides in the same transfer, and only a tensor
whose gate trips pays for an exact count.
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


FOLD_WORDS = 512
"""Upper bound on the number of 64-bit words the device fold produces."""


@dataclass(frozen=True)
class Signed:
    """Signature of one tensor plus its non-finite element count."""

    signature: int
    nonfinite: int


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


def fold(tensor: torch.Tensor) -> torch.Tensor:
    """Fold a tensor's bytes to ``FOLD_WORDS`` int64 partial sums on its device."""
    data = _as_bytes(tensor)
    nbytes = data.numel()
    n_words = nbytes // 8
    row_len = n_words // FOLD_WORDS
    body_words = row_len * FOLD_WORDS
    acc = torch.zeros(FOLD_WORDS, dtype=torch.int64, device=data.device)
    if row_len:
        body = data[: body_words * 8]
        if body.storage_offset() % 8:
            body = body.clone()  # realign: int64 views need 8-byte aligned offsets
        # Wrapping two's-complement sum per contiguous row.
        torch.sum(body.view(torch.int64).view(FOLD_WORDS, row_len), dim=1, out=acc)
    rest = nbytes - body_words * 8
    if rest:
        tail = torch.zeros(FOLD_WORDS * 8, dtype=torch.uint8, device=data.device)
        tail[:rest] = data[body_words * 8 :]
        acc += tail.view(torch.int64)
    return acc


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
    return f"scout-sig-v1|{tensor.dtype}|{shape}|{nbytes}|".encode()


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
