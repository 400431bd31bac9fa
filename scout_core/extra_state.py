"""Module state outside parameters and buffers: what a module keeps through ``get_extra_state``.

torch lets a module carry state that is neither a parameter nor a buffer through ``get_extra_state`` /
``set_extra_state`` (``state_dict()`` stores it under ``<prefix>._extra_state``). Transformer Engine keeps its
FP8 scaling state there (the amax history and the scales of every FP8 tensor): it changes in every forward under
FP8, it decides how the next step's GEMMs round, and a bitwise resume needs it as much as the weights. SCOUT
therefore

* keeps it in snapshots and puts it back on restore (:mod:`scout_core.checkpoint.snapshot`);
* puts it back after a replay's forwards (the replay must not advance it, as it must not advance a BatchNorm's
  statistics) and compares it among the peers with the parameter state (:mod:`scout_core.replay.layer`).

Values are kept storable with ``torch.load(weights_only=True)``: a tensor as a host copy, a ``BytesIO`` or
``bytes`` (older Transformer Engine serializes so) as its bytes in a uint8 tensor with a tag saying which;
anything else is deep-copied as it is (a plain container of tensors stores; other objects make the snapshot's
persistence fail with a record, never training).
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import torch
from torch import nn

from scout_core.checkpoint.vetted_state import vet_serialized

__all__ = ["capture_extra_states", "extra_state_modules", "extra_state_tensors", "restore_extra_states"]

_KIND = "__scout_extra_kind__"


def extra_state_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules under ``root`` (itself included) whose class defines its own ``get_extra_state``, by name."""
    return [(name, m) for name, m in root.named_modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state]


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8) if not data else \
        torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _storable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, io.BytesIO):
        return {_KIND: "bytesio", "data": _byte_tensor(value.getvalue())}
    if isinstance(value, (bytes, bytearray)):
        return {_KIND: "bytes", "data": _byte_tensor(bytes(value))}
    return copy.deepcopy(value)


def _original(value: Any) -> Any:
    if isinstance(value, dict) and value.get(_KIND) == "bytesio":
        return io.BytesIO(value["data"].numpy().tobytes())
    if isinstance(value, dict) and value.get(_KIND) == "bytes":
        return value["data"].numpy().tobytes()
    return value


def capture_extra_states(root: nn.Module) -> dict[str, Any]:
    """Host copies of the extra state of every module under ``root`` that has one, by module name."""
    return {name: _storable(m.get_extra_state()) for name, m in extra_state_modules(root)}


def restore_extra_states(root: nn.Module, saved: dict[str, Any], *, from_outside: bool = True) -> None:
    """Put back what :func:`capture_extra_states` took (the modules must be the same). ``from_outside``: the
    states were read back from a snapshot (a slot, the durable store, a peer's replica), so serialized ones are
    vetted before the module unpickles them; False for this process's own capture of a moment ago (replay puts
    a layer's live state back after its forwards, and must never fail to)."""
    live = dict(extra_state_modules(root))
    if set(live) != set(saved):
        raise ValueError(f"extra state differs from the model's modules: {sorted(set(live) ^ set(saved))[:5]}")
    for name, value in saved.items():
        # A fresh object each time: set_extra_state may keep what it is given, and the saved copy must stay intact.
        original = _original(_storable(value) if isinstance(value, torch.Tensor) else value)
        raw = _raw_bytes(original) if from_outside else None
        if raw is not None:  # the module may unpickle it (Transformer Engine does, from a tensor of any shape)
            vet_serialized(raw, f"saved extra state of module {name or '(root)'}")
        live[name].set_extra_state(original)


def _raw_bytes(value: Any) -> bytes | None:
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, torch.Tensor):  # any dtype and shape: its bytes are what a module would unpickle
        t = value.detach().cpu().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() and t.dtype != torch.bool \
            else t.numpy().tobytes()
    return None


def extra_state_tensors(saved: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors that sign the captured extra states for comparison among peers, in module order.

    Serialized state is decoded first: a pickle of a tensor holds its storage's address, so the same FP8 state
    pickles to different bytes in every process (Transformer Engine >= 2 hands out ``pickle.dumps`` of a dict of
    tensors as a uint8 tensor; older versions a ``torch.save`` in a ``BytesIO``). What is signed is the decoded
    content: its tensors, and its numbers, strings and flags in key order; other objects (a recipe's dataclass)
    are left out, since nothing guarantees their bytes are the same on two ranks."""
    out: list[torch.Tensor] = []
    for _name, value in sorted(saved.items()):
        out += _content(_decoded(value))
    return out


def _decoded(value: Any) -> Any:
    """Serialized extra state as the object it serializes (tensors on the host); anything else as it is.

    ``torch.save`` output (a zip archive, ``PK``; or the legacy format, a pickle that begins with a magic number)
    is read by ``torch.load`` onto the host: its archive records each storage's device, which differs between
    data-parallel peers on different GPUs. A plain pickle (Transformer Engine >= 2) by ``pickle.loads``. The bytes
    are this rank's own live module's state, just handed out: nothing foreign is loaded. What decodes to nothing
    with a tensor in it is signed as the raw bytes."""
    data = value["data"] if isinstance(value, dict) and _KIND in value else value
    if not (isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1 and data.numel() > 1):
        return data
    raw = data.numpy().tobytes()
    loads: list[Any] = []
    if raw[:2] == b"PK" or raw[:1] == b"\x80":
        loads.append(lambda b: torch.load(io.BytesIO(b), map_location="cpu", weights_only=False))
    if raw[:1] == b"\x80":
        loads.append(pickle.loads)
    for load in loads:
        try:
            decoded = load(raw)
        except Exception:  # noqa: BLE001 - not this format
            continue
        if _content_tensors(decoded):
            return decoded
    return data


def _content_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_content_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_content_tensors(v) for v in value)
    return False


def _content(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=repr) for t in [_primitive(k), *_content(value[k])] if t is not None]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _content(v)]
    t = _primitive(value)
    return [t] if t is not None else []


def _primitive(value: Any) -> torch.Tensor | None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return _byte_tensor(repr(value).encode())
    return None
