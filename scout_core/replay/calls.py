"""Module calls as data: flatten any ``(args, kwargs)`` or output into tensors plus a plain spec.

Model code from popular libraries calls its blocks with ``None`` placeholders,
keyword-only tensors, tuples of tensors passed as keywords (rotary
``(cos, sin)``), nested containers, and returns tuples, dicts or dataclasses
(``ModelOutput``-like) of which only some leaves are tensors. Replay has to
ship such a call from a source rank to its peers and rebuild it exactly, so a
call is split into

* ``tensors``: the tensor leaves in a fixed depth-first order, and
* ``spec``: a nested structure of plain Python values with :class:`Slot`
  markers where tensors were. Because tensor positions are explicit markers, a
  ``None`` argument can never be confused with a tensor. A spec travels, and is
  saved, as plain data (:mod:`scout_core.replay.spec_codec`), never as a pickle.

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
import inspect
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
    if isinstance(value, types.FunctionType) and not _by_name(value) and _rebuildable(value):
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
    code = value.__code__
    return (_FN, value.__module__, _code_name(code), _flatten(value.__defaults__, out),
            _flatten(value.__kwdefaults__, out), cells, code.co_firstlineno)


_SHIPPABLE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
_MAX_CLOSURE_ITEMS = 256


def _rebuildable(fn: types.FunctionType) -> bool:
    """Ship ``fn`` by its closure only if a receiver finds exactly its code (not another function of the same
    qualified name: two branches or two lambdas of one function) and its closure holds only data a call
    carries anyway (tensors, numbers, strings, further such functions, small containers of them). Anything
    else (a module, a big or cyclic structure) is left to pickle: the check that carries it is skipped with
    a record, and the training step that captured it is never slowed or broken."""
    try:
        if _local_code(fn.__module__, _code_name(fn.__code__), fn.__code__.co_firstlineno) is not fn.__code__:
            return False
    except ValueError:
        return False
    budget = [_MAX_CLOSURE_ITEMS]

    def ok(value: Any, depth: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or depth > 6:
            return False
        if isinstance(value, _SHIPPABLE_LEAVES) or _shipped_by_attributes(value):
            return True
        if isinstance(value, types.FunctionType):
            return _by_name(value) or all(ok(_cell(c), depth + 1) for c in value.__closure__ or ())
        if isinstance(value, (tuple, list)):
            return all(ok(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and ok(v, depth + 1) for k, v in value.items())
        return False

    return all(ok(_cell(c), 1) for c in fn.__closure__ or ())


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not yet assigned
        return None


def _code_name(code: types.CodeType) -> str:
    """The qualified name of the code itself (``functools.wraps`` renames the function, never its code)."""
    return getattr(code, "co_qualname", code.co_name)


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
        return tuple.__new__(spec[1], [rebuild(s, tensors, leaf) for s in spec[2]])  # no user __new__ runs
    if tag == _MAP:
        kind, items = spec[1], [(k, rebuild(s, tensors, leaf)) for k, s in spec[2]]
        return dict(items) if kind is dict else _make_map(kind, items)
    if tag in (_DC, _OBJ):
        obj = object.__new__(spec[1])
        for name, s in spec[2]:
            object.__setattr__(obj, name, rebuild(s, tensors, leaf))  # frozen dataclasses too
        return obj
    if tag == _FN:
        _, module, qualname, defaults, kwdefaults, cells, line = spec
        code = _local_code(module, qualname, line)
        closure = tuple(types.CellType() if c[0] == _EMPTY_CELL else types.CellType(rebuild(c, tensors, leaf))
                        for c in cells)
        fn = types.FunctionType(code, sys.modules[module].__dict__, code.co_name, rebuild(defaults, tensors, leaf),
                                closure or None)
        fn.__kwdefaults__ = rebuild(kwdefaults, tensors, leaf)
        fn.__qualname__ = qualname
        return fn
    raise ValueError(f"not a call spec: {spec!r}")


_CODES: dict[tuple[str, str, int], types.CodeType] = {}


def _local_code(module: str, qualname: str, line: int) -> types.CodeType:
    """The code object of function ``qualname`` (``f.<locals>.g``) starting at ``line`` in ``module``, found
    in the code of its enclosing function in this process (the module must already be imported): the same
    code object every time, so a compiled caller's guards keep matching. Two candidates (two lambdas on one
    line) are refused: the receiver could not tell which one the source ran."""
    key = (module, qualname, line)
    if key not in _CODES:
        if module not in sys.modules:
            raise ValueError(f"call spec names function {module}.{qualname}, whose module is not imported")
        mod = sys.modules[module]
        top: Any = mod
        # Looked up in the module's and its classes' own namespaces: never a module's __getattr__ (which may
        # import), never through a module it imported (torch's "os").
        for part in qualname.split(".<locals>.")[0].split("."):
            top = vars(top).get(part) if isinstance(top, (types.ModuleType, type)) and part.isidentifier() else None
            top = getattr(top, "__func__", top)  # staticmethod, classmethod
        top = inspect.unwrap(top) if isinstance(top, types.FunctionType) else None
        here = getattr(mod, "__file__", None)
        stack = [top.__code__] if top is not None and here and top.__code__.co_filename == here else []
        found = []
        while stack:
            code = stack.pop()
            is_function = code.co_flags & inspect.CO_NEWLOCALS and code.co_flags & inspect.CO_OPTIMIZED
            if _code_name(code) == qualname and code.co_firstlineno == line and is_function:  # not a class body
                found.append(code)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        if len(found) != 1:
            raise ValueError(f"call spec names function {module}.{qualname} (line {line}), which this process "
                             f"cannot find exactly once ({len(found)} candidates)")
        _CODES[key] = found[0]
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
