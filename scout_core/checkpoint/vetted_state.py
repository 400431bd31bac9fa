"""Serialized module state from a snapshot, checked before the module itself unpickles it.

Transformer Engine keeps its FP8 state as ``pickle.dumps`` of a dict in a uint8 tensor (older releases: a
``torch.save`` in a ``BytesIO``), and its ``set_extra_state`` unpickles what it is given. A snapshot is read back
from ``/dev/shm``, the durable store or a peer's replica, so SCOUT must not hand it bytes whose pickle names
anything but data. Before a restore gives the bytes to the module, they are

* a ``torch.save`` archive: loaded once with ``torch.load(weights_only=True)``, which refuses any other global;
* a plain pickle: unpickled once, as a dry run, by an unpickler that knows only tensors (their storages again by
  ``weights_only`` loading), torch dtypes, builtin containers, and dataclasses, enums and named tuples that
  Transformer Engine's already imported modules define (its recipe);

and handed over only if that succeeds: the module's own unpickling then meets the same globals and nothing else.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import sys
from typing import Any

import torch

__all__ = ["UnsafeState", "vet_serialized"]


class UnsafeState(ValueError):
    """Saved module state whose serialized form names something other than data."""


_GLOBALS = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
            ("torch._utils", "_rebuild_parameter"), ("copyreg", "_reconstructor"), ("builtins", "object"),
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
            ("builtins", "bytearray"), ("torch", "Size")}
_PACKAGES = ("transformer_engine",)  # whose dataclasses and enums (an FP8 recipe) may appear by name


def _storage_from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class _DryRun(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes  # a tensor's storage: a torch.save archive, read weights-only
        if (module, name) in _GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        if module.split(".")[0] in _PACKAGES and module in sys.modules:
            obj = vars(sys.modules[module]).get(name)
            # Its recipe: dataclasses, enums, and named tuples (an enum member's value, a precision override),
            # defined in that module itself, not a name it imported.
            data_kind = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
                                                   or issubclass(obj, tuple) and hasattr(obj, "_fields"))
            if data_kind and obj.__module__ == module and obj.__qualname__ == name:
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id outside a torch.save archive")


def vet_serialized(raw: bytes, where: str) -> None:
    """Raise :class:`UnsafeState` naming ``where`` unless ``raw`` (if serialized at all) holds only data."""
    try:
        if raw[:2] == b"PK" or raw[:8] == b"\x80\x02\x8a\x0al\xfc\x9cF\xf9":  # torch.save: zip, or legacy magic
            torch.load(io.BytesIO(raw), weights_only=True)
        elif raw[:1] == b"\x80":  # a pickle (protocol 2 and later)
            _DryRun(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - whatever it is, it is not handed to the module
        raise UnsafeState(f"{where}: its serialized state is refused ({type(e).__name__}: {str(e)[:200]}); "
                          f"SCOUT hands a module only state that holds data") from None
