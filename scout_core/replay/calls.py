"""Module calls as data: flatten any ``(args, kwargs)`` or output into tensors plus a plain spec.

Model code from popular libraries calls its blocks with ``None`` placeholders,
keyword-only tensors, tuples of tensors passed as keywords (rotary
``(cos, sin)``), nested containers, and returns tuples, dicts or dataclasses
(``ModelOutput``-like) of which only some leaves are tensors. Replay has to
ship such a call from a source rank to its peers and rebuild it exactly, so a
call is split into

* ``tensors``: the tensor leaves in a fixed depth-first order, and
* ``spec``: a nested structure of plain Python values with :class:`Slot`
  markers where tensors were. The spec pickles (it travels through an object
  broadcast), and because tensor positions are explicit markers, a ``None``
  argument can never be confused with a tensor.

Dataclasses are rebuilt without calling ``__init__`` (``init=False`` fields and
``__post_init__`` side effects stay as they were); named tuples and dict
subclasses (``OrderedDict``) keep their type.

Two more kinds of leaf travel, as FlexAttention calls need them (TorchTitan's
default attention hands every block a ``BlockMask``):

* a ``BlockMask`` (torch's FlexAttention mask: block tensors plus a ``mask_mod``
  function), rebuilt from its attributes without ``__init__``, like a dataclass;
* a function that cannot be pickled by name, such as a ``mask_mod`` closure over
  the batch's document ids: shipped as its module, qualified name and closure
  values (tensors among them travel as tensors), and rebuilt from the code object
  of the module the receiving rank already imported, never from code carried in
  the spec.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Slot", "flatten_call", "rebuild", "tensor_leaves"]


class Slot(NamedTuple):
    """Marks where the ``index``-th tensor leaf goes."""

    index: int


_SEQ = "seq"
_MAP = "map"
_DC = "dataclass"
_NT = "namedtuple"
_VAL = "value"
_OBJ = "object"
_FN = "function"
_EMPTY_CELL = "empty-cell"


def _shipped_by_attributes(value: Any) -> bool:
    """Objects rebuilt from their attributes: torch's FlexAttention ``BlockMask`` (no dataclass, no pickle)."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    return flex is not None and isinstance(value, flex.BlockMask)


def _by_name(fn: types.FunctionType) -> bool:
    """True when pickle can ship ``fn`` by reference (its module has it under its qualified name)."""
    obj: Any = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _flatten(value: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        out.append(value)
        return Slot(len(out) - 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, _flatten(getattr(value, f.name), out)) for f in dataclasses.fields(value)]
        return (_DC, type(value), fields)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (_NT, type(value), [_flatten(v, out) for v in value])
    if isinstance(value, (list, tuple)):
        return (_SEQ, type(value), [_flatten(v, out) for v in value])
    if isinstance(value, dict):
        return (_MAP, type(value), [(k, _flatten(v, out)) for k, v in value.items()])
    if _shipped_by_attributes(value):
        return (_OBJ, type(value), [(k, _flatten(v, out)) for k, v in vars(value).items()])
    if isinstance(value, types.FunctionType) and not _by_name(value):
        shipping = _shipping()
        if id(value) not in shipping:  # a recursive inner function reaches itself through its closure: left to
            shipping.add(id(value))    # pickle, which refuses it (the check is skipped with a record)
            try:
                return _flatten_function(value, out)
            finally:
                shipping.discard(id(value))
    return (_VAL, value)


_LOCAL = threading.local()


def _shipping() -> set[int]:
    """The functions this thread is flattening right now."""
    if not hasattr(_LOCAL, "functions"):
        _LOCAL.functions = set()
    return _LOCAL.functions


def _flatten_function(value: types.FunctionType, out: list[torch.Tensor]) -> Any:
    cells = []
    for cell in value.__closure__ or ():
        try:
            cells.append(_flatten(cell.cell_contents, out))
        except ValueError:  # a cell not yet assigned
            cells.append((_EMPTY_CELL,))
    return (_FN, value.__module__, value.__qualname__, _flatten(value.__defaults__, out),
            _flatten(value.__kwdefaults__, out), cells)


def flatten_call(value: Any) -> tuple[list[torch.Tensor], Any]:
    """``(tensors, spec)`` of any nested value; :func:`rebuild` inverts it."""
    tensors: list[torch.Tensor] = []
    spec = _flatten(value, tensors)
    return tensors, spec


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (tuples, lists, dicts, dataclasses, named tuples), depth first."""
    return flatten_call(value)[0]


def rebuild(spec: Any, tensors: list[Any], leaf: Callable[[Any], Any] | None = None) -> Any:
    """Put ``tensors`` (or ``leaf(tensor)`` of each) back into the structure ``spec`` describes."""
    if isinstance(spec, Slot):
        t = tensors[spec.index]
        return leaf(t) if leaf is not None else t
    tag = spec[0]
    if tag == _VAL:
        return spec[1]
    if tag == _SEQ:
        kind, items = spec[1], [rebuild(s, tensors, leaf) for s in spec[2]]
        return kind(items) if kind in (list, tuple) else _make_seq(kind, items)
    if tag == _NT:
        return spec[1](*[rebuild(s, tensors, leaf) for s in spec[2]])
    if tag == _MAP:
        kind, items = spec[1], [(k, rebuild(s, tensors, leaf)) for k, s in spec[2]]
        return dict(items) if kind is dict else _make_map(kind, items)
    if tag in (_DC, _OBJ):
        obj = object.__new__(spec[1])
        for name, s in spec[2]:
            object.__setattr__(obj, name, rebuild(s, tensors, leaf))  # frozen dataclasses too
        return obj
    if tag == _FN:
        _, module, qualname, defaults, kwdefaults, cells = spec
        code = _local_code(module, qualname)
        closure = tuple(types.CellType() if c[0] == _EMPTY_CELL else types.CellType(rebuild(c, tensors, leaf))
                        for c in cells)
        fn = types.FunctionType(code, sys.modules[module].__dict__, code.co_name, rebuild(defaults, tensors, leaf),
                                closure or None)
        fn.__kwdefaults__ = rebuild(kwdefaults, tensors, leaf)
        fn.__qualname__ = qualname
        return fn
    raise ValueError(f"not a call spec: {spec!r}")


_CODES: dict[tuple[str, str], types.CodeType] = {}


def _local_code(module: str, qualname: str) -> types.CodeType:
    """The code object of function ``qualname`` (``f.<locals>.g``) in ``module``, found in the code of its
    enclosing function in this process (the module must already be imported): the same code object every time,
    so a compiled caller's guards keep matching."""
    key = (module, qualname)
    if key not in _CODES:
        if module not in sys.modules:
            raise ValueError(f"call spec names function {module}.{qualname}, whose module is not imported")
        top: Any = sys.modules[module]
        for part in qualname.split(".<locals>.")[0].split("."):
            top = getattr(top, part, None)
        top = getattr(top, "__func__", top)
        stack = [top.__code__] if hasattr(top, "__code__") else []
        while stack:
            code = stack.pop()
            if getattr(code, "co_qualname", code.co_name) == qualname:
                _CODES[key] = code
                break
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        else:
            raise ValueError(f"call spec names function {module}.{qualname}, which this process cannot find")
    return _CODES[key]


def _make_seq(kind: type, items: list[Any]) -> Any:
    try:
        return kind(items)
    except TypeError:  # a sequence type whose constructor takes something else: fall back to its base
        return tuple(items) if issubclass(kind, tuple) else list(items)


def _make_map(kind: type, items: list[tuple[Any, Any]]) -> Any:
    try:
        obj = kind()
        obj.update(items)
        return obj
    except TypeError:
        return dict(items)


# -- persistence (the emergency sweep replays the newest calls after a restart) -------------------

class _SpecUnpickler(__import__("pickle").Unpickler):
    """Resolves only classes of modules this process already imported: a spec names model classes,
    never code to import."""

    def find_class(self, module: str, name: str) -> Any:
        import sys

        if module not in sys.modules:
            raise __import__("pickle").UnpicklingError(f"call spec names {module}.{name}, which is not imported")
        return super().find_class(module, name)


def spec_to_tensor(spec: Any) -> torch.Tensor:
    """A spec as bytes in a uint8 tensor (storable with ``weights_only`` loading)."""
    import pickle

    return torch.frombuffer(bytearray(pickle.dumps(spec)), dtype=torch.uint8)


def spec_from_tensor(data: torch.Tensor) -> Any:
    import io

    return _SpecUnpickler(io.BytesIO(data.numpy().tobytes())).load()
