"""Which ranks are evidence: ranks set aside (nondeterministic, another environment), vetting and misconfiguration.

What it finds holds for the whole run (and travels in snapshots, :meth:`Trust.state`): a rank once found not to be
evidence has every later disagreement it takes part in set aside, never SDC.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from scout_core.consensus import C3Result
from scout_core.replay.result import BoundaryResult
from scout_core.replay.vetting import (
    ENVIRONMENT_SURFACE,
    REPRODUCIBLE_SURFACE,
    SELF_CHECK_SURFACE,
    SOURCE_SURFACE,
    environment_fingerprint,
    optimizer_misconfigured,
    set_aside,
    split_vetting,
    vet_due,
)

__all__ = ["UNTRUSTED_REASONS", "Trust", "newly_untrusted"]

UNTRUSTED_REASONS = ("nondeterministic", "environment")
"""The ways a rank is found not to be evidence, in the order their records are written."""


def newly_untrusted(untrusted: Mapping[int, str], reported: set[tuple[int, str]],
                    reasons: Iterable[str] = UNTRUSTED_REASONS) -> list[tuple[str, tuple[int, ...]]]:
    """Per reason (in order), the ranks ``untrusted`` sets aside for it that no record named yet, ascending;
    they count as ``reported`` from now on (one record per rank and reason for the whole run)."""
    out = []
    for reason in reasons:
        new = tuple(sorted(r for r, why in untrusted.items() if why == reason and (r, reason) not in reported))
        if new:
            reported.update((r, reason) for r in new)
            out.append((reason, new))
    return out


class Trust:
    """The ranks one engine's checks found not to be evidence, and its vetting state (identical on every peer)."""

    def __init__(self) -> None:
        self.untrusted: dict[int, str] = {}
        """Ranks found not to be evidence (nondeterministic, or another environment), for the whole run."""
        self.reported: set[tuple[int, str]] = set()
        """(rank, reason) pairs a record has named already."""
        self.vet_always = False
        """A rank was found nondeterministic: from now on every check replays twice."""
        self.self_check_off = False
        """Most peers failed the optimizer self-check once: it is no evidence for anyone, ever after."""
        self.misconfigured_reported = False
        self._env: str | None = None

    def vet_due(self, check: int, every: int, layers: int) -> bool:
        """Whether check number ``check`` replays its first variant twice (``replay.vetting.vet_due``)."""
        return vet_due(check, every, self.vet_always, layers)

    def environment(self, device: torch.device) -> str:
        """This rank's environment fingerprint (taken once)."""
        if self._env is None:
            self._env = environment_fingerprint(device)
        return self._env

    def vetting_surfaces(self, *, vet: bool, reproducible: bool | None, device: torch.device
                         ) -> list[tuple[str, Any]]:
        """The vetting surfaces every peer sends with its evidence (None where a replay failed)."""
        vetted = [(REPRODUCIBLE_SURFACE, reproducible)] if vet else []
        return vetted + [(ENVIRONMENT_SURFACE, self.environment(device))]

    def sort_out(self, result: BoundaryResult, surfaces: Sequence[C3Result]) -> bool:
        """Keep the exchange's results in ``result`` without the vetting surfaces, record the ranks they find not
        to be evidence and set aside what those ranks take part in. True when a rank was nondeterministic."""
        result.surfaces, found = split_vetting(surfaces)
        result.untrusted = found
        self.set_aside(result)
        return any(reason == "nondeterministic" for reason in found.values())

    def set_aside(self, result: BoundaryResult) -> None:
        """Every disagreement a rank that is not evidence takes part in (found now or at any earlier check:
        intermittent nondeterminism may happen to agree with itself today) is set aside, never SDC."""
        self.untrusted.update({r: why for r, why in result.untrusted.items() if r not in self.untrusted})
        if self.untrusted:
            result.surfaces, result.unreliable = set_aside(result.surfaces, self.untrusted)

    def self_check(self, result: BoundaryResult) -> None:
        """An optimizer self-check a strict majority of peers fails is a misconfiguration, not agreement, and not
        SDC on the minority that passed: from then on it is dropped from every check's results, with the peers'
        replay of the source's slice (the same replay, which then does not model the live update either)."""
        misconfigured = optimizer_misconfigured(result.surfaces)
        if misconfigured is not None:
            self.self_check_off = True
            result.misconfigured = misconfigured
        if self.self_check_off:
            result.surfaces = [r for r in result.surfaces if r.surface not in (SELF_CHECK_SURFACE, SOURCE_SURFACE)]

    def unreported(self, result: BoundaryResult) -> tuple[list[tuple[str, tuple[int, ...]]], C3Result | None]:
        """What this check found that no record said yet: set-aside ranks per reason, and the misconfiguration
        (once per run). Both count as reported from now on."""
        new = newly_untrusted(result.untrusted, self.reported)
        misconfigured = None
        if result.misconfigured is not None and not self.misconfigured_reported:
            self.misconfigured_reported = True
            misconfigured = result.misconfigured
        return new, misconfigured

    def state(self) -> dict[str, Any]:
        """What a snapshot keeps of it (weights-only safe)."""
        return {"vet_always": self.vet_always, "self_check_off": self.self_check_off,
                "untrusted": {str(r): why for r, why in self.untrusted.items()}}

    def load(self, saved: Mapping[str, Any]) -> None:
        """Continue from a snapshot's :meth:`state` (its set-aside ranks count as reported)."""
        self.vet_always = bool(saved.get("vet_always", False))
        self.self_check_off = bool(saved.get("self_check_off", False))
        self.untrusted = {int(r): str(why) for r, why in saved.get("untrusted", {}).items()}
        self.reported = {(r, why) for r, why in self.untrusted.items()}
