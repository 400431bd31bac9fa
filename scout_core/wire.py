"""Data between ranks and on disk as plain data: JSON with a few tags, never pickle.

``torch.distributed``'s object collectives pickle on the sender and unpickle on the receiver, so any rank (or
anything that can write where a rank reads) can run code in every other. SCOUT exchanges only data: numbers,
strings, ``None``, lists, tuples, dicts (any keys of those kinds), bytes, ``torch.dtype`` and small host tensors
(RNG states). Anything else is refused where it is encoded, on the rank that tried, and every peer hears about
it before a payload moves: the exchange raises :class:`WireError` on every rank together, never hangs one.

The collectives send each rank's payload length (an 8-byte header) and, when it fits a first round of a few
kilobytes, the payload itself in one collective; a longer payload travels in a second round, padded to the
longest, on the group's own device (the host for gloo, the current CUDA device for NCCL).
"""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_WIRE_BYTES", "WireError", "all_gather_bytes", "all_gather_data", "broadcast_bytes", "broadcast_data",
           "decode", "encode"]

MAX_WIRE_BYTES = 64 << 20
"""The largest payload one rank may send or a reader accepts (a check's metadata is kilobytes)."""

_MAX_DEPTH = 64
_MAX_TENSOR_BYTES = 1 << 20  # RNG states are a few kilobytes; a large tensor travels as a tensor, not as data


class WireError(ValueError):
    """A value that is not plain data, or bytes that do not decode to it (named with where they came from)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_json(value: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise WireError(f"value nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum or numpy-like int subclass travels as its number
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$f": repr(float(value))}
    if isinstance(value, list):
        return [_to_json(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"$t": [_to_json(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"$d": [[_to_json(k, depth + 1), _to_json(v, depth + 1)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.dtype):
        return {"$dtype": _dtype_name(value)}
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.nbytes > _MAX_TENSOR_BYTES:
            raise WireError(f"only small host tensors travel as data, not {value.device} {tuple(value.shape)}")
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return {"$tensor": [_dtype_name(value.dtype), list(value.shape),
                            base64.b64encode(flat.numpy().tobytes()).decode()]}
    raise WireError(f"{type(value).__module__}.{type(value).__qualname__} is not plain data")


def encode(value: Any) -> bytes:
    """``value`` as canonical UTF-8 JSON bytes; :class:`WireError` for anything that is not plain data."""
    data = json.dumps(_to_json(value, 0), separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_WIRE_BYTES:
        raise WireError(f"{len(data)} bytes is more than the {MAX_WIRE_BYTES} a payload may hold")
    return data


# Whole-byte dtypes only: sub-byte, bit and quantized ones cannot be rebuilt from bytes by a view.
_DTYPES = {_dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype) and not d.is_complex
           and d.itemsize >= 1 and not re.fullmatch(r"u?int[1-7]|bits.*|q.*", _dtype_name(d))}


def _tagged(obj: dict[str, Any], depth: int, where: str) -> Any:
    if len(obj) != 1:
        raise WireError(f"{where}: an object with keys {sorted(obj)[:4]} is not a known tag")
    (tag, body), = obj.items()
    if tag == "$t" and isinstance(body, list):
        return tuple(_from_json(v, depth + 1, where) for v in body)
    if tag == "$d" and isinstance(body, list):
        out: dict[Any, Any] = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise WireError(f"{where}: a dict entry is not a [key, value] pair")
            key = _from_json(pair[0], depth + 1, where)
            if isinstance(key, (list, dict)):
                raise WireError(f"{where}: a dict key is a {type(key).__name__}")
            out[key] = _from_json(pair[1], depth + 1, where)
        return out
    if tag == "$f" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$b" and isinstance(body, str):
        return _b64(body, where)
    if tag == "$dtype" and isinstance(body, str) and body in _DTYPES:
        return _DTYPES[body]
    if tag == "$tensor" and isinstance(body, list) and len(body) == 3 and isinstance(body[0], str) \
            and body[0] in _DTYPES and isinstance(body[2], str):
        dtype, shape, raw = _DTYPES[body[0]], body[1], _b64(body[2], where)
        if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                for n in shape)):
            raise WireError(f"{where}: a tensor shape {shape!r} is not a list of sizes")
        if math.prod(shape) * torch.empty((), dtype=dtype).element_size() != len(raw):
            raise WireError(f"{where}: a {body[0]} tensor of shape {shape} does not hold {len(raw)} bytes")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
    raise WireError(f"{where}: {tag!r} is not a known tag, or its body is malformed")


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        raise WireError(f"{where}: bytes are not base64 ({e})") from None


def _from_json(value: Any, depth: int, where: str) -> Any:
    if depth > _MAX_DEPTH:
        raise WireError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, list):
        return [_from_json(v, depth + 1, where) for v in value]
    if isinstance(value, dict):
        return _tagged(value, depth, where)
    return value


def decode(data: bytes | bytearray | memoryview, *, where: str = "payload") -> Any:
    """The value :func:`encode` wrote; :class:`WireError` naming ``where`` for anything else."""
    if len(data) > MAX_WIRE_BYTES:
        raise WireError(f"{where}: {len(data)} bytes is more than the {MAX_WIRE_BYTES} a payload may hold")
    try:
        parsed = json.loads(bytes(data).decode("utf-8"))
    except ValueError as e:  # not UTF-8, not JSON, or a number too long to read
        raise WireError(f"{where}: not SCOUT data ({e})") from None
    except RecursionError:
        raise WireError(f"{where}: nested too deeply") from None
    try:
        return _from_json(parsed, 0, where)
    except WireError:
        raise
    except (TypeError, ValueError, RuntimeError, NotImplementedError, OverflowError, RecursionError) as e:
        raise WireError(f"{where}: not SCOUT data ({type(e).__name__}: {e})") from None


# -- collectives -----------------------------------------------------------------------------------

def _device(group: Any) -> torch.device:
    """Where the group's backend takes tensors: torch's own choice for its object collectives (the current
    accelerator for NCCL and its kind, the host for gloo and mixed backends)."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    return torch.device(_get_object_coll_device(group))


def _encoded(value: Any) -> tuple[bytes, str | None]:
    try:
        return encode(value), None
    except (WireError, TypeError, ValueError, RecursionError) as e:
        return b"", str(e)


def _lengths_or_raise(lengths: list[int], ranks: list[int], what: str, error: str | None) -> None:
    bad = [r for r, n in zip(ranks, lengths, strict=True) if n < 0 or n > MAX_WIRE_BYTES]
    if bad:
        raise WireError(f"{what}: rank(s) {bad} could not send plain data" + (f" (here: {error})" if error else ""))


def _fast_width(world: int) -> int:
    """Payload bytes the first round carries for each of ``world`` ranks: a control exchange's payload (a
    check's signatures, a few hundred bytes) fits, and the round moves at most about 1 MiB to each rank however
    large the group. The same on every rank of the group by construction (no state kept between calls)."""
    return max(256, min(4096, (1 << 20) // max(world, 1)))


_HEADER = 8
_BROADCAST_FAST_WIDTH = 8192
"""Payload bytes the first round of :func:`broadcast_bytes` carries (a check's call metadata, a few kilobytes)."""


def _framed(payload: bytes | None, length: int, width: int, device: torch.device) -> torch.Tensor:
    """``length`` as a signed 8-byte header, then ``payload`` when it fits in ``width`` bytes (zeros otherwise)."""
    body = payload if payload and 0 <= length <= width else b""
    return _padded(length.to_bytes(_HEADER, "little", signed=True) + body, _HEADER + width, device)


def _unframed(rows: bytes, width: int) -> tuple[int, bytes]:
    return int.from_bytes(rows[:_HEADER], "little", signed=True), rows[_HEADER:_HEADER + width]


def all_gather_bytes(payload: bytes | None, group: Any = None, *, what: str = "exchange",
                     error: str | None = None) -> list[bytes]:
    """Every rank's ``payload`` in group rank order. A rank passing ``None`` (it could not encode its value:
    ``error`` says why) makes every rank raise :class:`WireError` together, before any payload moves.

    One all-gather when every payload fits the first round's width (the usual case: a collective's latency,
    not its bytes, is what a check pays, most of all on a loaded host), else a second one of the payloads
    padded to the longest; every rank reads the lengths from the first round, so all take the same path."""
    device, size = _device(group), dist.get_world_size(group)
    width = _fast_width(size)
    mine = -1 if payload is None else len(payload)
    first = _framed(payload, mine, width, device)
    bufs = [torch.empty_like(first) for _ in range(size)]
    dist.all_gather(bufs, first, group=group)
    rows = torch.stack(bufs).cpu().numpy()
    framed = [_unframed(row.tobytes(), width) for row in rows]
    lengths = [n for n, _ in framed]
    _lengths_or_raise(lengths, list(range(size)), what, error)
    if max(lengths) <= width:
        return [body[:n] for n, body in framed]
    buf = _padded(payload or b"", max(lengths), device)
    bufs = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(bufs, buf, group=group)
    return [b[:n].cpu().numpy().tobytes() for b, n in zip(bufs, lengths, strict=True)]


def broadcast_bytes(payload: bytes | None, src: int, group: Any = None, *, what: str = "broadcast",
                    error: str | None = None) -> bytes:
    """``payload`` of global rank ``src`` on every rank (only ``src``'s is read). ``None`` on ``src`` makes
    every rank raise :class:`WireError` together. One broadcast when the payload fits the first round's width,
    else a second one of the whole payload (every rank reads its length from the first)."""
    device = _device(group)
    is_src = dist.get_rank() == src
    width = _BROADCAST_FAST_WIDTH
    mine = (-1 if payload is None else len(payload)) if is_src else 0
    first = _framed(payload if is_src else None, mine, width, device)
    dist.broadcast(first, src=src, group=group)
    n, body = _unframed(first.cpu().numpy().tobytes(), width)
    _lengths_or_raise([n], [src], what, error if is_src else None)
    if n <= width:
        return body[:n]
    buf = _padded((payload or b"") if is_src else b"", n, device)
    dist.broadcast(buf, src=src, group=group)
    return buf[:n].cpu().numpy().tobytes()


def _padded(payload: bytes, width: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros(width, dtype=torch.uint8)
    if payload:
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buf.to(device)


def all_gather_data(value: Any, group: Any = None, *, what: str = "exchange") -> list[Any]:
    """Every rank's ``value`` (plain data), in group rank order, instead of ``all_gather_object``."""
    payload, error = _encoded(value)
    raw = all_gather_bytes(None if error else payload, group, what=what, error=error)
    return [decode(b, where=f"{what} from group rank {r}") for r, b in enumerate(raw)]


def broadcast_data(value: Any, src: int, group: Any = None, *, what: str = "broadcast") -> Any:
    """``value`` of global rank ``src`` (plain data) on every rank, instead of ``broadcast_object_list``.
    Only ``src``'s ``value`` is read."""
    payload, error = _encoded(value) if dist.get_rank() == src else (b"", None)
    return decode(broadcast_bytes(None if error else payload, src, group, what=what, error=error),
                  where=f"{what} from rank {src}")
