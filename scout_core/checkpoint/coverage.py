"""What replay has vouched for on this rank since the candidate's capture: the coverage certification waits for.

Replay samples: one repeated layer per hidden check (a rotation over the layers), the embedding and the output
head, one optimizer slice per check (a rotation over the parameters this rank holds) and, with experts, one
(layer, expert, catalog shape) per expert check. Each sampled thing is a UNIT, named ``(rotation, index)``.
:class:`Coverage` keeps, per rotation, the units this rank must see and those replayed clean since the last
cycle closed. A check's units count only when the job-wide evidence accepted it (no SDC, nothing missing; a busy
boundary's clean units count though it captures nothing); the job's coverage is complete when every rank's is
(one flag of the evidence all-reduce).

Two modes (``checkpoint.certify``):

* ``coverage`` (the default): complete when every unit of every configured rotation was replayed clean.
* ``last_check_only``: the paper's dense rule, complete at any check that replayed a layer (hidden or expert).
  Faster, and it does not promise that units the check did not sample were clean.

A rotation whose recipe replay switched off after repeated failures never completes: certification stops
vouching rather than vouch for less than it says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from scout_core.config import CERTIFY_MODES

__all__ = ["Coverage", "Unit", "required_units"]

Unit = tuple[str, int]
"""(rotation, index): ``("hidden", 2)``, ``("embedding", 0)``, ``("optimizer", id(param))``, ``("expert", 7)``."""

LAYER_ROTATIONS = ("hidden", "expert")
REPLACED = ("optimizer",)


class Coverage:
    """One rank's coverage since the last closed cycle."""

    def __init__(self, mode: str = "coverage") -> None:
        if mode not in CERTIFY_MODES:
            raise ValueError(f"checkpoint.certify must be one of {CERTIFY_MODES}, got {mode!r}")
        self.mode = mode
        self.required: dict[str, frozenset[int]] = {}
        """Per rotation, the units to see."""
        self.seen: dict[str, set[int]] = {}
        self.absent: dict[int, int] = {}
        """Optimizer units required since the reset but not eligible now: boundaries in a row without a gradient."""

    def need(self, required: Mapping[str, frozenset[int]]) -> None:
        """The units each configured rotation has now. A layer or expert rotation required since the last reset
        stays required (a recipe switched to cadence 0 by ``scout ctl``): a candidate is promoted only once it was
        replayed after the capture. The optimizer's units are the parameters its slice rotates over (those with a
        gradient, where its evidence is compared) since the reset: a parameter without a gradient at the boundary
        where coverage would complete (an unrouted expert, a tower this batch skipped) stays required until its
        update is replayed, unless it goes without a gradient for as many boundaries as the slice has units (a
        parameter frozen for good must not hold certification back for the rest of the run). A self-check set
        aside as misconfigured drops the optimizer's rotation."""
        for rotation in [r for r in self.required if r in REPLACED and r not in required]:
            del self.required[rotation]
        for rotation, units in required.items():
            old = self.required.get(rotation)
            if rotation in REPLACED and old is not None:
                units = self._still_required(old, units)
            self.required[rotation] = units if old is None or rotation in REPLACED else old | units

    def _still_required(self, old: frozenset[int], now: frozenset[int]) -> frozenset[int]:
        for unit in now:
            self.absent.pop(unit, None)
        for unit in old - now:
            self.absent[unit] = self.absent.get(unit, 0) + 1
        return now | {u for u in old - now if self.absent[u] <= len(now)}

    def would_complete(self, units: Iterable[Unit]) -> bool:
        """Whether this rank's coverage is complete once ``units`` (this boundary's) count."""
        units = list(units)
        if self.mode == "last_check_only":  # any layer check (any check at all where no layer is replayed)
            layers = [r for r in self.required if r in LAYER_ROTATIONS]
            return any(rotation in LAYER_ROTATIONS or not layers for rotation, _ in units)
        for rotation, want in self.required.items():
            got = self.seen.get(rotation, set()) | {i for r, i in units if r == rotation}
            if not want <= got:
                return False
        return True

    def add(self, units: Iterable[Unit]) -> None:
        """The job accepted the check that replayed ``units``."""
        for rotation, index in units:
            self.seen.setdefault(rotation, set()).add(index)

    def reset(self) -> None:
        """A cycle closed (a new candidate), or recovery ran: nothing is vouched for after this point yet."""
        self.seen.clear()
        self.required.clear()
        self.absent.clear()


def required_units(replay: Any, experts: Any) -> dict[str, frozenset[int]]:
    """The units of every rotation this rank's replay is configured to run (a recipe at cadence 0 is not).

    ``replay`` is the :class:`~scout_core.replay.engine.ReplayEngine` (or None), ``experts`` the expert replay (or
    None). The optimizer's units are the parameters its slice rotates over, from its first slice on, while its
    evidence is compared (not once pure FSDP's surfaces of the rank's own slice, the self-check, were set aside as
    misconfigured)."""
    out: dict[str, frozenset[int]] = {}
    if replay is not None:
        cadence = replay.cfg.cadence
        if cadence.hidden > 0 and replay.n_hidden > 0:
            out["hidden"] = frozenset(range(replay.n_hidden))
        for recipe in replay.schedule.extra:
            if getattr(cadence, recipe) > 0:
                out[recipe] = frozenset({0})
        opt = replay.opt_slice
        if cadence.optimizer > 0 and opt is not None and opt.eligible is not None and not (
                replay.trust.self_check_off and not replay.opt.compare_slices):
            out["optimizer"] = opt.eligible
    if experts is not None and experts.every > 0:
        out["expert"] = frozenset(range(experts.cycle))
    return out
