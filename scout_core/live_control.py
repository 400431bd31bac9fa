"""Applies ``scout ctl`` commands at a step boundary through a table: each part registers the live keys it reads.

:mod:`scout_core.control` carries the commands (rank 0's folder, one broadcast to every rank); here every rank
applies them alike: the same command and configuration give the same outcome and the same answer on every rank.
The assembly (:func:`scout_core.assembly.register_live_keys`) fills the table on behalf of the parts it built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from scout_core.config import ScoutConfig
from scout_core.control import ControlError, RunControl, check_live, resolve

__all__ = ["LiveControl"]

_log = logging.getLogger("scout")

Apply = Callable[[str, Any], None]
"""Called with the key and its typed value, after the configuration holds the new value."""


class LiveControl:
    """Who applies each live key, in the order registered, and why a key is refused where its part is off."""

    def __init__(self, config: ScoutConfig, *, pinned: Mapping[str, str], rank: int = 0) -> None:
        """``pinned``: keys the framework adapter fixed when SCOUT attached, and why."""
        self.config = config
        self.pinned = pinned
        self.rank = rank
        self._owners: list[tuple[tuple[str, ...], Apply | None, str]] = []  # (key prefixes, apply, refusal)
        self._pause: Callable[[bool], None] | None = None
        self._no_pause = "nothing in this job can pause"

    def owns(self, prefixes: tuple[str, ...], apply: Apply) -> None:
        """A part reads the keys starting with ``prefixes``: ``apply`` follows each change of one."""
        self._owners.append((prefixes, apply, ""))

    def refuses(self, prefixes: tuple[str, ...], reason: str) -> None:
        """The keys starting with ``prefixes`` cannot change: the part that reads them is off, for ``reason``."""
        self._owners.append((prefixes, None, reason))

    def pauses(self, apply: Callable[[bool], None] | None, *, refusal: str = "") -> None:
        """``apply(paused)`` carries out pause and resume; None: they are refused for ``refusal``."""
        self._pause = apply
        self._no_pause = refusal or self._no_pause

    def steer(self, control: RunControl, step: int) -> None:
        """Every rank applies rank 0's pending commands at this same step (``scout_core.control``)."""
        for command in control.exchange():
            status, reason = self.apply(command)
            control.answer(command, step, status, reason)
            if status == "applied":
                _log.warning("rank %d: SCOUT control at step %d: %s %s%s", self.rank, step, command.get("op"),
                             command.get("key", ""), f"={command.get('value')}" if command.get("key") else "")

    def apply(self, command: dict[str, Any]) -> tuple[str, str]:
        """Apply one command alike on every rank: ``("applied", "")`` or ``("refused", why)``."""
        op = command.get("op")
        if command.get("bad"):
            return "refused", str(command["bad"])
        if op in ("pause", "resume"):
            if self._pause is None:
                return "refused", self._no_pause
            self._pause(op == "pause")
            return "applied", ""
        if op != "set":
            return "refused", f"unknown command {op!r}"
        key = str(command.get("key", ""))
        try:
            value = check_live(key, str(command.get("value", "")), self.config)
        except ControlError as exc:
            return "refused", str(exc)
        if key in self.pinned:
            return "refused", f"{key} was fixed when SCOUT attached to this job: {self.pinned[key]}"
        refusal = next((why for prefixes, apply, why in self._owners if apply is None and key.startswith(prefixes)),
                       None)
        if refusal is not None:
            return "refused", refusal
        section, _, leaf = key.rpartition(".")
        setattr(resolve(self.config, section), leaf, value)
        for prefixes, apply, _ in self._owners:
            if apply is not None and key.startswith(prefixes):
                apply(key, value)
        return "applied", ""
