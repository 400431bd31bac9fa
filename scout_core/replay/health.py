"""Replay's own health: say when nothing is being checked, and switch off a recipe that always fails.

Two situations would otherwise leave an operator believing SCOUT watches the job while it does not:

* every check is skipped because the sampled layer did not run on the source (a model compiled before
  ``enable()`` hides its layer calls from the capture hooks; a layer that runs only on some steps). A skip
  is no incident, so after :data:`SKIPS_BEFORE_RECORD` in a row one record says so;
* one recipe's local work fails at every check (an optimizer whose slice cannot be rebuilt, a block that
  rejects ``autograd.grad`` under reentrant activation checkpointing). Each failure already skips the check
  on every rank with a ``diagnosis_error`` record; after :data:`FAILURES_BEFORE_OFF` in a row the recipe is
  switched off on every rank, with one record, so the other recipes go on.

Both decisions are the same on every rank: skips are agreed job-wide, and the failed stages are gathered
over SCOUT's gloo group before anything is switched off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scout_core.report import Incident, IncidentKind, IncidentScope
from scout_core.wire import all_gather_data

__all__ = ["FAILURES_BEFORE_OFF", "SKIPS_BEFORE_RECORD", "RecipeHealth"]

FAILURES_BEFORE_OFF = 3
"""Checks in a row in which one recipe's local work failed, before that recipe is switched off."""

SKIPS_BEFORE_RECORD = 5
"""Consecutive checks skipped because the sampled layer did not run, before one record says so."""


class RecipeHealth:
    """Skip and failure streaks of one rank's replay engine (identical on every rank)."""

    def __init__(self, *, rank: int, world_control: Any, recipe_of_layer: Mapping[str, str],
                 emit: Callable[[Sequence[Incident]], None]) -> None:
        self.rank = rank
        self.world_control = world_control
        self.recipe_of_layer = dict(recipe_of_layer)  # layer name -> "hidden" / "embedding" / "output"
        self.emit = emit
        self.disabled: set[str] = set()
        """Recipes switched off (the same on every rank)."""
        self._skips = 0
        self._failures: dict[str, int] = {}

    def checked(self) -> None:
        """A check ran to its end."""
        self._skips = 0
        self._failures.clear()

    def skipped(self, step: int, why: str) -> None:
        """Every rank skipped a check because a sampled layer did not run; one record after a streak (rank 0)."""
        self._skips += 1
        if self._skips != SKIPS_BEFORE_RECORD or self.rank != 0:
            return
        self.emit([Incident(
            kind=IncidentKind.DIAGNOSIS_ERROR, scope=IncidentScope.JOB, ranks=[], hosts=[], step=step,
            surface="replay:coverage",
            reason=f"the last {SKIPS_BEFORE_RECORD} replay checks were all skipped ({why}): nothing is being "
                   "checked or certified. A model compiled before scout_core.enable() hides its layer calls "
                   "from SCOUT's hooks: enable SCOUT before torch.compile, or pass layers= explicitly.",
            evidence={"skipped_in_a_row": self._skips})])

    def failed(self, step: int, where: str | None, recipes: Sequence[str]) -> None:
        """Every rank skipped a check after a local failure (``where``: this rank's failed stage, if any)."""
        self._skips = 0
        stages = all_gather_data(where, self.world_control, what="failed stages")  # job-wide; a rare path
        failed = sorted({w for w in stages if w})
        culprits = {r for r in map(self._recipe_of, failed) if r} & set(recipes)
        self._failures = {r: self._failures.get(r, 0) + 1 for r in culprits}
        for recipe in sorted(culprits):
            if self._failures[recipe] < FAILURES_BEFORE_OFF:
                continue
            self.disabled.add(recipe)
            if self.rank == 0:
                self.emit([Incident(
                    kind=IncidentKind.DIAGNOSIS_ERROR, scope=IncidentScope.JOB, ranks=[], hosts=[], step=step,
                    surface=f"replay:{recipe}",
                    reason=f"the {recipe} recipe failed in {FAILURES_BEFORE_OFF} checks in a row "
                           f"({', '.join(failed)}); it is switched off for the rest of the run"
                           + "; the other recipes go on, and NO SNAPSHOT IS VERIFIED from now on (certification "
                             "waits for a coverage that includes this recipe's units)"
                           + " (the diagnosis_error records before this one say why)",
                    evidence={"failed_stages": failed})])

    def _recipe_of(self, where: str) -> str | None:
        """The recipe a failed stage belongs to (None: shared work such as capture or the exchange)."""
        if where.startswith("optimizer"):
            return "optimizer"
        for prefix in ("replay of ", "local shard signature of ", "scratch memory of ", "unshard of ",
                       "reshard of "):
            if where.startswith(prefix):
                return self.recipe_of_layer.get(where[len(prefix):])
        return None
