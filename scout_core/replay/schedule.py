"""When replay is due: each recipe's cadence, the rotation over layers and source peers, pause, arming captures.

What is due follows from the configuration and the step count alone, so every rank of the job (every peer group,
every pipeline stage) agrees on it without a word.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scout_core.config import ReplayConfig
from scout_core.replay.capture import LayerCapture
from scout_core.replay.health import RecipeHealth
from scout_core.replay.vetting import rotation

__all__ = ["DueCheck", "Schedule"]


@dataclass(frozen=True)
class DueCheck:
    """What one boundary runs (the same on every rank)."""

    recipes: tuple[str, ...]
    """The recipes due (``embedding``, ``output``, ``hidden``, ``optimizer``), as ``BoundaryResult.recipes``."""
    layers: list[tuple[str, int]]
    """(recipe, layer index) of each due layer recipe held here: the embedding, the head, the sampled layer."""
    optimizer: bool
    """The optimizer recipe is due."""
    check: int
    """This check's number: its place in the rotation over layers and source peers."""

    @property
    def timed(self) -> bool:
        """Timing evidence comes from the hidden-layer recipe only."""
        return any(r == "hidden" for r, _ in self.layers)


class Schedule:
    """Cadences, rotation and pause of one engine; arms the captures of the step to come."""

    def __init__(self, config: ReplayConfig, captures: Sequence[LayerCapture], *, n_hidden: int,
                 extra: Mapping[str, int], n_peers: int, health: RecipeHealth) -> None:
        self.cfg = config
        self.captures = captures
        self.n_hidden = n_hidden
        self.extra = extra  # boundary recipe -> its layer index (after the repeated layers)
        self.n_peers = n_peers
        self.health = health
        self.step = 0
        self.checks = 0
        self.paused = False  # scout ctl pause: nothing is due until resume
        self.opt_due = False  # the optimizer recipe is due at the coming boundary (set by the step pre-hook)

    def cadence(self, recipe: str) -> int:
        """The recipe's configured cadence, 0 once it was switched off after repeated failures."""
        return 0 if recipe in self.health.disabled else getattr(self.cfg.cadence, recipe)

    def due(self, step: int, recipe: str) -> bool:
        cadence = self.cadence(recipe)
        return self.cfg.enabled and not self.paused and cadence > 0 and step % cadence == 0

    def layer_index(self) -> int:
        """The repeated layer the next hidden check samples."""
        return rotation(self.checks, self.n_hidden, self.n_peers)[0]

    def source(self, check: int) -> int:
        """The position among the peers of check ``check``'s source (rotating, so one faulty source cannot poison
        every check)."""
        return rotation(check, self.n_hidden, self.n_peers)[1]

    def arm(self, step: int) -> None:
        """Arm the captures of the layers due at ``step``."""
        if self.due(step, "hidden"):
            self.captures[self.layer_index()].arm()
        for recipe, idx in self.extra.items():
            if self.due(step, recipe):
                self.captures[idx].arm()

    def rearm(self) -> None:
        """Drop whatever was captured and arm the next step's captures as now due."""
        for capture in self.captures:
            capture.take()
        self.arm(self.step + 1)

    def continue_at(self, step: int, checks: int | None = None) -> None:
        """Go on after ``step`` (and ``checks`` checks): nothing captured for another step is replayed."""
        for capture in self.captures:
            capture.take()
        self.step = int(step)
        if checks is not None:
            self.checks = int(checks)
        self.arm(self.step + 1)

    def due_next(self) -> tuple[str, ...]:
        """Recipes due at the next boundary (the same on every peer)."""
        step = self.step + 1
        due = tuple(r for r in self.extra if self.due(step, r))
        due += ("hidden",) if self.due(step, "hidden") else ()
        return due + (("optimizer",) if self.opt_due else ())

    def take(self, step: int) -> DueCheck:
        """What is due at ``step``; a hidden check moves the rotation on (every peer together, whatever happens
        to the check)."""
        recipes = [r for r in ("embedding", "output") if self.due(step, r)]
        layers = [(r, self.extra[r]) for r in recipes if r in self.extra]
        if self.due(step, "hidden"):
            recipes.append("hidden")
            layers.append(("hidden", self.layer_index()))
            self.checks += 1
        opt_due = self.due(step, "optimizer")
        self.opt_due = False
        check = self.checks - (1 if any(r == "hidden" for r, _ in layers) else 0)
        return DueCheck(tuple(recipes) + (("optimizer",) if opt_due else ()), layers, opt_due, check)
