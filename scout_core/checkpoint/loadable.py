"""Whether a restart can load the caller's state: checked at the first capture, not found out at the restart.

Snapshots are loaded with ``torch.load(weights_only=True)``, which refuses what is not tensors, plain Python
values and their containers (a numpy scalar or array, a ``slice``, an arbitrary object). The first capture of
each set of caller-state keys on a rank serializes that state and loads it back the same way; when that fails,
:meth:`CallerStateCheck.check` says which object (the ``state`` key) and which key path inside it holds which
type, and the snapshot is not kept. A set of keys that passed once is trusted from then on.
"""

from __future__ import annotations

import io
import logging
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["CallerStateCheck", "refused"]

_log = logging.getLogger("scout")

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple)
MAX_NAMED = 8
"""At most this many refused values are named in one message."""


def _loads(value: Any) -> bool:
    """``value`` survives ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal (an unpicklable value, a global the loader does not allow)
        return False
    return True


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def refused(value: Any, *, limit: int = MAX_NAMED) -> list[tuple[str, str]]:
    """(key path, type) of the values inside ``value`` that ``torch.load(weights_only=True)`` refuses, in order,
    at most ``limit``. Containers are walked; a value of any other type counts by its type (one try each)."""
    verdicts: dict[type, bool] = {}
    found: list[tuple[str, str]] = []

    def ok(leaf: Any) -> bool:
        kind = type(leaf)
        if kind in _PLAIN or kind is torch.Tensor or kind is torch.nn.Parameter:
            return True
        if kind not in verdicts:
            verdicts[kind] = _loads(leaf)
        return verdicts[kind]

    def walk(node: Any, path: str) -> None:
        if len(found) >= limit:
            return
        if type(node) not in _CONTAINERS:
            if not ok(node):
                found.append((path, _type_name(node)))
            return
        if isinstance(node, dict):
            for key, child in node.items():
                here = f"{path}[{key!r}]"
                if not ok(key):
                    found.append((f"{here} (the key)", _type_name(key)))
                walk(child, here)
        else:
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")

    walk(value, "")
    return found


class CallerStateCheck:
    """One rank's check of the caller's state at the first capture of each set of ``state`` keys."""

    def __init__(self) -> None:
        self.passed: set[frozenset[str]] = set()
        self.reported: set[str] = set()

    def check(self, state: dict[str, Any]) -> str | None:
        """None when a restart can load ``state`` (``{state key: that object's state}``), else why not."""
        keys = frozenset(map(str, state))
        if keys in self.passed:
            return None
        if _loads(state):
            self.passed.add(keys)
            return None
        named = [f"state[{name!r}] at {path or '(the whole state)'}: {kind}"
                 for name, value in state.items() for path, kind in refused(value)][:MAX_NAMED]
        where = "; ".join(named) or "the state as a whole cannot be saved and loaded back"
        return ("the caller's state cannot be restored: torch.load(weights_only=True) refuses it "
                f"({where}); snapshots holding it are not kept. Make state_dict() return tensors and plain Python "
                "values (torch.from_numpy or .tolist() for an array, int() or float() for a numpy scalar, a tuple "
                "for a slice), or allow the type with torch.serialization.add_safe_globals")

    def first_report(self, problem: str) -> bool:
        """Whether ``problem`` is new (reported once; later captures with it are dropped quietly)."""
        if problem in self.reported:
            _log.debug("SCOUT: %s", problem)
            return False
        self.reported.add(problem)
        return True

