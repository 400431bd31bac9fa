"""A replayed call's structure as plain data, and back, naming only what the job declared as its model's code.

A call spec (:mod:`scout_core.replay.calls`) holds Python types (a dataclass of arguments, a named tuple, an
``OrderedDict``), leaf values, and functions rebuilt from their closure (FlexAttention's ``mask_mod``). It travels
from a source rank to its peers and is saved in every snapshot for the emergency sweep after a restart, so a
receiver must never let it run code of the sender's choosing. Here a spec becomes JSON-ready data
(:mod:`scout_core.wire`): types and functions are written as ``"module:qualname"`` and resolved on the receiver

* only in modules it imported itself (no import, no module ``__getattr__``: a name is looked up in the
  module's and classes' own ``__dict__``),
* only what that module itself defines (its own namespace, then classes in it: never a module it imported,
  so ``torch:os.system`` names nothing), checked by the object's own ``__module__`` and ``__qualname__``,
* only inside the packages the job declared as its model's code: torch, the packages of the layers replay
  checks (registered when the replay runtime starts), ``replay.call_packages`` and what
  :func:`allow_call_packages` adds (never the standard library),
* only as the kind the spec says: a dataclass must be a dataclass (rebuilt field by field, by its declared
  field names, without ``__init__``), a named tuple a named tuple (``tuple.__new__``), a sequence or mapping one
  of the builtin kinds or a subclass of them from the declared packages, an enum member a member of an enum,
  a BlockMask only its data attributes (never a name its class defines, such as ``as_tuple``),
* a closure only from a function's code its module's file holds, and only of a module registered for closures
  (FlexAttention's masks; TorchTitan's attention masks through its plugin; :func:`allow_call_closures`): any
  other inner function would call whatever the sender put in its cells.

Anything else in a spec (an object of another kind, a function outside those packages) raises
:class:`NotShippable` where it is encoded: the check that carries it is skipped with a record, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import sys
import types
from typing import Any

import torch

from scout_core import wire
from scout_core.replay.calls import _DC, _EMPTY_CELL, _FN, _MAP, _NT, _OBJ, _SEQ, _VAL, Slot, _local_code
from scout_core.wire import WireError

__all__ = ["NotShippable", "allow_call_closures", "allow_call_packages", "allowed_packages", "decode_spec",
           "encode_spec", "spec_from_tensor", "spec_to_tensor"]


class NotShippable(WireError):
    """A spec (or bytes claiming to be one) that names something outside plain data and the declared code."""


_ALLOWED: set[str] = {"torch"}
# A closure is rebuilt with the values, defaults and cells the sender chose: any inner function could become a way
# to call whatever it calls with arguments of the sender's choosing. So closures are rebuilt only from modules
# that declared their inner functions to be mask functions: FlexAttention's (and_masks, or_masks), and what a
# plugin or the user registers (TorchTitan's attention masks).
_CLOSURE_MODULES: set[str] = {"torch.nn.attention.flex_attention"}
_BUILTIN_SEQS: dict[str, type] = {"builtins:list": list, "builtins:tuple": tuple, "torch:Size": torch.Size}
_BUILTIN_MAPS: dict[str, type] = {"builtins:dict": dict, "collections:OrderedDict": collections.OrderedDict}


def allow_call_packages(*packages: str) -> None:
    """Let replayed calls name types and functions of these top-level packages (``"transformers"``,
    ``"megatron"``, your model's package). The replay runtime adds the packages of the layers it checks."""
    for p in packages:
        if not p or "." in p or ":" in p:
            raise ValueError(f"{p!r} is not a top-level package name")
        if p in sys.stdlib_module_names or p == "builtins":
            continue  # the standard library is not model code (os, subprocess, functools)
        _ALLOWED.add(p)


def allow_call_closures(*modules: str) -> None:
    """Let replayed calls carry closures (FlexAttention mask functions) defined inside functions of these modules
    (full module names, ``"torchtitan.models.common.attention"``). Their cells travel from the sender; only
    register modules whose inner functions call nothing but what a mask function calls."""
    for m in modules:
        if not m or ":" in m:
            raise ValueError(f"{m!r} is not a module name")
        _CLOSURE_MODULES.add(m)


def allowed_packages() -> frozenset[str]:
    return frozenset(_ALLOWED)


# -- encoding (on the rank that captured the call) --------------------------------------------------

def _name_of(obj: Any) -> str:
    name = f"{obj.__module__}:{obj.__qualname__}"
    if _resolve(name) is not obj:  # what the receiver would find under that name is something else
        raise NotShippable(f"{name} cannot be named: it is not found under that name, or not in the declared "
                           f"packages ({', '.join(sorted(_ALLOWED))}; scout_core.allow_call_packages adds one)")
    return name


def _leaf(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str, bytes, torch.dtype)) or type(value) in (int, float):
        return value
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, enum.Enum):
        return {"enum": _name_of(type(value)), "member": value.name}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return {"fn": _name_of(value)}
    if isinstance(value, type):
        return {"type": _name_of(value)}
    raise NotShippable(f"a call argument of type {type(value).__module__}.{type(value).__qualname__} is not "
                       f"plain data, a dataclass or named tuple of the model's packages, or a tensor")


def encode_spec(spec: Any) -> Any:
    """``spec`` as plain data for :mod:`scout_core.wire`; :class:`NotShippable` names what cannot travel."""
    if isinstance(spec, Slot):
        return {"slot": int(spec.index)}
    tag = spec[0]
    if tag == _VAL:
        return {"val": _leaf(spec[1])}
    if tag in (_SEQ, _NT):
        return {tag: _name_of(spec[1]), "items": [encode_spec(s) for s in spec[2]]}
    if tag == _MAP:
        return {tag: _name_of(spec[1]), "items": [[_leaf(k), encode_spec(s)] for k, s in spec[2]]}
    if tag in (_DC, _OBJ):
        return {tag: _name_of(spec[1]), "fields": [[str(n), encode_spec(s)] for n, s in spec[2]]}
    if tag == _FN:
        _, module, qualname, defaults, kwdefaults, cells, line = spec
        _check_module(module, qualname)
        _check_closure(module, qualname)
        return {tag: f"{module}:{qualname}", "line": int(line), "defaults": encode_spec(defaults),
                "kwdefaults": encode_spec(kwdefaults),
                "cells": [{"empty": True} if c[0] == _EMPTY_CELL else encode_spec(c) for c in cells]}
    raise NotShippable(f"not a call spec: {tag!r}")


# -- decoding (on a peer, or from a snapshot after a restart) ---------------------------------------

def _check_module(module: str, what: str) -> types.ModuleType:
    if module.split(".")[0] not in _ALLOWED:
        raise NotShippable(f"call spec names {module}:{what}, outside the declared packages "
                           f"({', '.join(sorted(_ALLOWED))})")
    mod = sys.modules.get(module)
    if mod is None:
        raise NotShippable(f"call spec names {module}:{what}, whose module this process has not imported")
    return mod


def _check_closure(module: str, qualname: str) -> None:
    if ".<locals>." not in qualname:  # only closures travel by code; a module-level function goes by name
        raise NotShippable(f"call spec rebuilds {module}:{qualname}, which is not a function's inner function")
    if module not in _CLOSURE_MODULES:
        raise NotShippable(f"call spec rebuilds {module}:{qualname}, but {module} is not registered for closures "
                           f"(scout_core.replay.spec_codec.allow_call_closures; FlexAttention's masks are)")


def _resolve(name: Any) -> Any:
    if not isinstance(name, str) or name.count(":") != 1:
        raise NotShippable(f"{name!r} is not a module:qualname reference")
    if name in _BUILTIN_SEQS or name in _BUILTIN_MAPS:
        return _BUILTIN_SEQS.get(name) or _BUILTIN_MAPS[name]
    module, qualname = name.split(":")
    obj: Any = _check_module(module, qualname)
    for i, part in enumerate(qualname.split(".")):
        if not part.isidentifier() or part.startswith("__"):
            raise NotShippable(f"{name} is not a plain qualified name")
        # The module's own namespace, then classes only: never into a module it imported (torch's "os").
        found = vars(obj).get(part) if (i == 0 or isinstance(obj, type)) else None
        if found is None:
            raise NotShippable(f"{name} is not defined in {module}")
        obj = found
    if getattr(obj, "__module__", None) != module or getattr(obj, "__qualname__", None) != qualname:
        raise NotShippable(f"{name} is another name for {getattr(obj, '__module__', '?')}."
                           f"{getattr(obj, '__qualname__', '?')}, not something {module} defines")
    return obj


def _kind(name: Any, tag: str) -> type:
    if name in _BUILTIN_SEQS and tag == _SEQ:
        return _BUILTIN_SEQS[name]
    if name in _BUILTIN_MAPS and tag == _MAP:
        return _BUILTIN_MAPS[name]
    cls = _resolve(name)
    ok = isinstance(cls, type) and {
        _SEQ: lambda: issubclass(cls, (list, tuple)) and not hasattr(cls, "_fields"),
        _NT: lambda: issubclass(cls, tuple) and hasattr(cls, "_fields"),
        _MAP: lambda: issubclass(cls, dict),
        _DC: lambda: dataclasses.is_dataclass(cls),
        _OBJ: lambda: cls is getattr(sys.modules.get("torch.nn.attention.flex_attention"), "BlockMask", None),
    }[tag]()
    if not ok:
        raise NotShippable(f"call spec names {name} as a {tag}, which it is not")
    return cls


def _value(data: Any) -> Any:
    if data is None or isinstance(data, (bool, int, float, str, bytes, torch.dtype)):
        return data
    if isinstance(data, dict) and len(data) in (1, 2):
        if set(data) == {"device"} and isinstance(data["device"], str):
            try:
                return torch.device(data["device"])
            except RuntimeError as e:
                raise NotShippable(f"{data['device']!r} is not a device") from e
        if set(data) == {"enum", "member"}:
            cls = _resolve(data["enum"])
            if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(data["member"], str) \
                    and data["member"] in cls.__members__:
                return cls.__members__[data["member"]]
        if set(data) == {"fn"}:
            fn = _resolve(data["fn"])
            if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
                return fn
        if set(data) == {"type"}:
            cls = _resolve(data["type"])
            if isinstance(cls, type):
                return cls
    raise NotShippable(f"{str(data)[:80]} is not a call spec value")


def decode_spec(data: Any) -> Any:
    """The spec :func:`encode_spec` wrote, ready for :func:`~scout_core.replay.calls.rebuild`, or
    :class:`NotShippable`. Nothing is constructed here, only looked up. Rebuilding later runs no constructor of
    a dataclass, named tuple or BlockMask; a list, tuple or dict subclass of the model's packages is built by
    its own constructor, as the source built it."""
    if not isinstance(data, dict):
        raise NotShippable(f"call spec node {str(data)[:80]} is not an object")
    if set(data) == {"slot"} and type(data["slot"]) is int and data["slot"] >= 0:
        return Slot(data["slot"])
    if set(data) == {"val"}:
        return (_VAL, _value(data["val"]))
    tag = next((t for t in (_SEQ, _NT, _MAP, _DC, _OBJ, _FN) if t in data), None)
    items = data.get("items", data.get("fields"))
    if tag in (_SEQ, _NT) and set(data) == {tag, "items"} and isinstance(items, list):
        return (tag, _kind(data[tag], tag), [decode_spec(s) for s in items])
    if tag == _MAP and set(data) == {tag, "items"} and isinstance(items, list) and all(
            isinstance(p, list) and len(p) == 2 for p in items):
        return (tag, _kind(data[tag], tag), [(_value(k), decode_spec(s)) for k, s in items])
    if tag in (_DC, _OBJ) and set(data) == {tag, "fields"} and isinstance(items, list) and all(
            isinstance(p, list) and len(p) == 2 for p in items):
        cls = _kind(data[tag], tag)
        names = {f.name for f in dataclasses.fields(cls)} if tag == _DC else None
        fields = []
        for name, s in items:
            # A BlockMask's data attributes only: a name of the class (a method such as as_tuple, which flex
            # attention calls) would be shadowed by whatever the sender put there.
            plain = isinstance(name, str) and name.isidentifier() and not name.startswith("__")
            if not plain or (names is not None and name not in names) or (names is None and hasattr(cls, name)):
                raise NotShippable(f"{data[tag]} has no field {name!r}")
            fields.append((name, decode_spec(s)))
        return (tag, cls, fields)
    if tag == _FN and set(data) == {_FN, "line", "defaults", "kwdefaults", "cells"} and type(data["line"]) is int \
            and isinstance(data["cells"], list) and isinstance(data[_FN], str) and data[_FN].count(":") == 1:
        module, qualname = data[_FN].split(":")
        _check_module(module, qualname)
        _check_closure(module, qualname)
        try:
            _local_code(module, qualname, data["line"])  # the receiver's own code, found exactly once
        except ValueError as e:
            raise NotShippable(str(e)) from None
        cells = [(_EMPTY_CELL,) if c == {"empty": True} else decode_spec(c) for c in data["cells"]]
        return (_FN, module, qualname, decode_spec(data["defaults"]), decode_spec(data["kwdefaults"]), cells,
                data["line"])
    raise NotShippable(f"call spec node with keys {sorted(data)[:6]} is malformed")


# -- saved in a snapshot --------------------------------------------------------------------------------

_FORMAT = "SCOUT-SPEC/1"


def spec_to_tensor(spec: Any) -> torch.Tensor:
    """``spec`` as UTF-8 JSON in a uint8 tensor (a snapshot loads with ``weights_only=True``)."""
    data = wire.encode({"format": _FORMAT, "spec": encode_spec(spec)})
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def spec_from_tensor(data: Any, *, where: str = "saved call") -> Any:
    """The spec :func:`spec_to_tensor` saved, or :class:`NotShippable` (a :class:`~scout_core.wire.WireError`)
    naming ``where``. A spec an older release pickled is refused, never unpickled."""
    if not (isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1):
        raise NotShippable(f"{where}: the call structure is not a byte tensor")
    raw = data.numpy().tobytes()
    if raw[:1] == b"\x80":
        raise NotShippable(f"{where} was saved as a pickle by an older SCOUT release; pickles are never read, so "
                           f"this call cannot be replayed (the snapshot itself still restores)")
    doc = wire.decode(raw, where=where)
    if not (isinstance(doc, dict) and set(doc) == {"format", "spec"} and doc["format"] == _FORMAT):
        raise NotShippable(f"{where}: not a {_FORMAT} call structure")
    return decode_spec(doc["spec"])


# -- a check's call metadata, broadcast by the source before the tensors ------------------------------

def encode_metadata(metas: dict[int, dict[str, Any] | None]) -> bytes:
    """The source's :func:`~scout_core.replay.shipping.call_meta` per sampled layer, as wire bytes."""
    return wire.encode({idx: None if m is None else {**m, "spec": encode_spec(m["spec"])}
                        for idx, m in metas.items()})


MAX_CALL_BYTES = 64 << 30
"""The most a replayed call's tensors may announce (64 GiB): a shape corrupted on its way (a flipped bit in a
dimension) is refused by every peer alike, from the same bytes, before any of them allocates a buffer."""


def _layout(value: Any, where: str) -> tuple[tuple[int, ...], torch.dtype, str]:
    ok = (isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], tuple)
          and all(type(n) is int and n >= 0 for n in value[0]) and isinstance(value[1], torch.dtype)
          and value[2] in ("cpu", "cuda", "xpu", "mps", "hpu", "meta"))
    if not ok:
        raise NotShippable(f"{where}: {str(value)[:80]} is not a tensor's (shape, dtype, device)")
    return value


def decode_metadata(raw: bytes, src: int) -> dict[int, dict[str, Any] | None]:
    """What :func:`encode_metadata` wrote on rank ``src``, checked field by field."""
    where = f"call metadata from rank {src}"
    doc = wire.decode(raw, where=where)
    if not isinstance(doc, dict):
        raise NotShippable(f"{where}: not a mapping of layers")
    out: dict[int, dict[str, Any] | None] = {}
    for idx, m in doc.items():
        if type(idx) is not int:
            raise NotShippable(f"{where}: layer {idx!r} is not an index")
        if m is None:
            out[idx] = None
            continue
        if not (isinstance(m, dict) and set(m) == {"spec", "tensors", "mask", "grads", "rng"}
                and isinstance(m["tensors"], list) and isinstance(m["mask"], list)
                and all(type(b) is bool for b in m["mask"]) and isinstance(m["grads"], dict)
                and all(type(i) is int for i in m["grads"]) and isinstance(m["rng"], dict)
                and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in m["rng"].items())):
            raise NotShippable(f"{where}: layer {idx}'s metadata is malformed")
        tensors = [_layout(t, where) for t in m["tensors"]]
        grads = {i: _layout(g, where) for i, g in m["grads"].items()}
        announced = sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in [*tensors, *grads.values()])
        if announced > MAX_CALL_BYTES:
            raise NotShippable(f"{where}: layer {idx}'s call announces {announced} bytes of tensors, more than "
                               f"{MAX_CALL_BYTES} (a corrupted shape?)")
        out[idx] = {"spec": decode_spec(m["spec"]), "tensors": tensors, "mask": m["mask"], "grads": grads,
                    "rng": m["rng"]}
    return out
