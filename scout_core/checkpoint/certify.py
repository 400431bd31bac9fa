"""Checkpoint certification and retrieval (paper section 8, Algorithm 3). Pure logic.

Three trust states name checkpoint generations (a generation is the step it
was captured at):

* ``latest``: the newest in-memory snapshot;
* ``candidate``: a persisted snapshot awaiting complete validation;
* ``verified``: a snapshot whose numerical trust is backed by replay evidence.

At every replay boundary the job-wide evidence (combined by one collective,
see :mod:`scout_core.checkpoint.coordinator`) drives :meth:`Certifier.on_boundary`:

* SDC or inconclusive evidence anywhere: the candidate is rejected and recovery
  must run (:func:`decide_retrieval`); nothing is captured.
* Missing evidence: the capture is skipped, and the recipe cycle starts over
  (``q = 0``): the skipped check's recipe was not replayed.
* Healthy, or a straggler only (slowness is not numerical divergence): the
  current state is captured as ``latest`` and ``q`` (accepted recipes in the
  cycle) grows. When ``q`` reaches ``K`` the prior candidate is promoted to
  verified and ``latest`` is persisted as the new candidate: a candidate is
  promoted only after two consecutive accepted cycles (2K checks), because a
  fault can corrupt state after its triggering recipe already ran.

Static-shape (dense) models use ``K = 1`` with ``static=True``: every capture
after an accepted check is certified by that check and becomes verified at once.

Evidence and durability are kept apart: ``candidate`` and ``verified`` follow replay
evidence alone (the framework's checkpoint labels read them), while a generation some
rank could not write to SCOUT's durable store (or relabel verified) is marked
``unstored`` (:meth:`Certifier.not_durable`): it is never what a restart is offered
(:attr:`Certifier.retrievable`), and ``durable`` names the newest verified generation
every rank confirmed holding.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Action", "BoundaryEvidence", "Certifier", "FailureKind", "RetrievalDecision", "decide_retrieval"]


@dataclass(frozen=True)
class BoundaryEvidence:
    """Job-wide evidence at one replay boundary (already combined across ranks)."""

    sdc: bool = False
    inconclusive: bool = False
    missing: bool = False
    straggler: bool = False
    busy: bool = False
    """Some rank is still persisting the previous snapshot: this boundary captures nothing (training
    never waits for a checkpoint write), though SDC evidence still triggers recovery."""
    lost_candidate: bool = False
    """Some rank could not write the candidate to the durable store: it is never promoted."""
    lost_verified: bool = False
    """Some rank could not write (static shapes) or relabel the newest verified generation."""


class Action(enum.StrEnum):
    CAPTURE = "capture"  # take an in-memory snapshot as latest
    CAPTURE_AND_PERSIST = "capture_and_persist"  # ... and persist it as the new candidate
    SKIP = "skip"  # evidence missing: keep everything as it is
    RECOVER = "recover"  # SDC or inconclusive evidence: run retrieval


@dataclass
class Certifier:
    """The certification state machine; one per job, identical on every rank."""

    recipes_per_cycle: int = 1
    static: bool = False
    latest: int | None = None
    candidate: int | None = None
    verified: int | None = None
    q: int = 0
    durable: int | None = None
    """The newest verified generation every rank confirmed holding in the durable store (written and labelled
    verified everywhere); what a restart is sure to find, so it is never pruned."""
    unstored: set[int] = field(default_factory=set)
    """The candidate or verified generation some rank could not write or relabel in SCOUT's durable store."""
    history: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.recipes_per_cycle < 1:
            raise ValueError(f"recipes_per_cycle must be >= 1, got {self.recipes_per_cycle}")
        if self.static and self.recipes_per_cycle != 1:
            raise ValueError("static-shape certification has exactly one recipe set per check (K = 1)")

    @property
    def at_cycle_boundary(self) -> bool:
        """Whether the next accepted check closes a cycle (ranks must agree on this)."""
        return self.q + 1 == self.recipes_per_cycle

    def skip_uncertified(self, evidence: BoundaryEvidence) -> Action:
        """A boundary whose checks cannot vouch for the state (no layer was replayed) and found no SDC: nothing
        is captured or promoted, and a check that did not run leaves a hole in the recipe cycle."""
        if evidence.missing:
            self.q = 0
        return Action.SKIP

    @property
    def retrievable(self) -> int | None:
        """The verified generation SCOUT's durable store offers a restart: ``verified``, unless some rank could not
        make it durable (then the newest one every rank confirmed)."""
        return self.durable if self.verified in self.unstored and self.verified != self.durable else self.verified

    def not_durable(self, step: int, generation: int, why: str) -> None:
        """Some rank could not make ``generation`` (the candidate or verified one) durable: SCOUT's store never
        offers it. The evidence stands (a candidate is still promoted, labels still read ``verified``)."""
        if generation not in (self.candidate, self.verified) or generation in self.unstored:
            return
        self.unstored = {g for g in self.unstored if g in (self.candidate, self.verified)} | {generation}
        role = "candidate" if generation == self.candidate else "verified"
        self.history.append((step, f"{role} {generation} is not durable on every rank ({why}): a restart is "
                                   f"offered verified {self.retrievable}"))

    def confirm(self, step: int, generation: int) -> None:
        """Every rank holds ``generation`` in the durable store, labelled verified."""
        if self.verified == generation and generation not in self.unstored:
            self.durable = generation
            self.history.append((step, f"verified {generation} is durable on every rank"))

    def on_boundary(self, step: int, evidence: BoundaryEvidence) -> Action:
        if evidence.sdc or evidence.inconclusive:
            if self.candidate is not None:
                self.history.append((step, f"candidate {self.candidate} rejected"))
            self.candidate = None  # may already hold corruption the finished checks did not see
            self.q = 0
            self.history.append((step, "recover"))
            return Action.RECOVER
        if evidence.missing:
            # A cycle is K consecutive accepted checks: any K consecutive checks of a rotation cover every
            # recipe, K that skip one need not (the check's recipe was not replayed). Start over.
            self.q = 0
            self.history.append((step, "skip: evidence missing (the recipe cycle starts over)"))
            return Action.SKIP
        if evidence.busy:
            self.history.append((step, "skip: the previous snapshot is still being persisted"))
            return Action.SKIP
        self.latest = step
        if self.static:
            self.verified = step
            self.history.append((step, "captured and verified (static shapes)"))
            return Action.CAPTURE_AND_PERSIST
        self.q += 1
        if self.q < self.recipes_per_cycle:
            self.history.append((step, f"captured ({self.q}/{self.recipes_per_cycle} recipes accepted)"))
            return Action.CAPTURE
        self.q = 0
        if self.candidate is not None:
            self.verified = self.candidate
            self.history.append((step, f"candidate {self.candidate} promoted to verified"))
        self.candidate = step
        self.history.append((step, f"captured and persisted as candidate {step}"))
        return Action.CAPTURE_AND_PERSIST


class FailureKind(enum.StrEnum):
    SDC = "sdc"
    MACHINE_UNREACHABLE = "machine_unreachable"
    STRAGGLER = "straggler"
    OTHER = "other"  # hangs, crashes, anything without numerical evidence either way


@dataclass(frozen=True)
class RetrievalDecision:
    source: str  # "latest" or "verified"
    generation: int | None
    reason: str
    failure: str
    sweep_clean: bool | None = None


def decide_retrieval(certifier: Certifier, failure: FailureKind, *, sweep=None) -> RetrievalDecision:
    """Choose what recovery loads (Algorithm 3, CheckpointRetrieval).

    ``sweep`` runs the complete recipe catalog against the latest state and
    returns True when it found no SDC; it is only called for ``OTHER``
    failures. A decision without any usable generation has ``generation=None``.
    """
    failure = FailureKind(failure)
    latest, verified = certifier.latest, certifier.retrievable

    def pick(source: str, reason: str, sweep_clean: bool | None = None) -> RetrievalDecision:
        gen = latest if source == "latest" else verified
        if gen is None:
            reason += f"; no {source} generation exists yet"
        return RetrievalDecision(source, gen, reason, failure.value, sweep_clean)

    if failure is FailureKind.SDC:
        return pick("verified", "confirmed SDC: the latest state may carry the corruption")
    if failure is FailureKind.MACHINE_UNREACHABLE:
        return pick("verified", "a machine is unreachable: its latest shard cannot be shown clean")
    if failure is FailureKind.STRAGGLER:
        return pick("latest", "straggler: slowness is not numerical divergence")
    if sweep is None:
        return pick("verified", "no emergency sweep available: cannot show the latest state clean")
    clean = bool(sweep())
    if clean:
        return pick("latest", "emergency sweep of every recipe found no SDC", True)
    return pick("verified", "emergency sweep found SDC in the latest state", False)
