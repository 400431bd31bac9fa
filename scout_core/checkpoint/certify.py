"""Checkpoint certification and retrieval (paper section 8, Algorithm 3). Pure logic.

Three trust states name checkpoint generations (a generation is the step it
was captured at):

* ``latest``: the newest in-memory snapshot;
* ``candidate``: a persisted snapshot awaiting complete validation;
* ``verified``: a snapshot whose numerical trust is backed by replay evidence.

At every replay boundary the job-wide evidence (combined by one collective,
see :mod:`scout_core.checkpoint.coordinator`) drives :meth:`Certifier.on_boundary`:

* SDC or inconclusive evidence anywhere, or a state that is not finite: the candidate is rejected and recovery
  must run (:func:`decide_retrieval`); nothing is captured.
* Missing evidence: the capture is skipped, and the check's units do not count toward coverage.
* A boundary busy persisting the previous snapshot: the capture is skipped (its clean units still count). Where
  its checks complete the coverage the candidate waits for, the candidate is promoted all the same (the evidence
  is whole; only the capture of a new candidate waits for the next boundary that is not busy): where writes
  outlast a check interval (a loaded host, slow storage) promotion would otherwise wait for a boundary that
  happens to be free, and an SDC verdict at that boundary rejects a candidate the finished checks had vouched for.
* Healthy, or a straggler only (slowness is not numerical divergence): the current state is captured as
  ``latest``. When the job-wide evidence says replay's COVERAGE is complete (every unit replay samples was
  replayed clean on every rank since the candidate was captured, see :mod:`~.coverage`), the candidate is
  promoted to verified and ``latest`` is persisted as the new candidate. A candidate is therefore promoted only
  after one whole coverage that began after its capture: a persistent defect that started before the capture,
  in whatever unit, was active when that unit was replayed after it, and rejected the candidate.

``static=True`` is the paper's dense rule and the weaker mode ``checkpoint.certify: last_check_only``: a capture
after any accepted check that replayed a layer is verified at once. It does not promise that units that check
did not sample were clean.

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
    nonfinite: bool = False
    """Some rank's parameters are not finite (see :mod:`~.finite`): a verdict like an inconclusive check."""
    covered: bool = False
    """Every rank's coverage is complete with this boundary's units (combined job-wide as AND): every unit
    replay samples was replayed clean since the candidate's capture (``static``: this check replayed a layer)."""


class Action(enum.StrEnum):
    CAPTURE = "capture"  # take an in-memory snapshot as latest
    CAPTURE_AND_PERSIST = "capture_and_persist"  # ... and persist it as the new candidate
    PROMOTE = "promote"  # busy: capture nothing, but label the candidate verified (the coverage is complete)
    SKIP = "skip"  # evidence missing: keep everything as it is
    RECOVER = "recover"  # SDC or inconclusive evidence: run retrieval


@dataclass
class Certifier:
    """The certification state machine; one per job, identical on every rank."""

    static: bool = False
    latest: int | None = None
    candidate: int | None = None
    verified: int | None = None
    durable: int | None = None
    """The newest verified generation every rank confirmed holding in the durable store (written and labelled
    verified everywhere); what a restart is sure to find, so it is never pruned."""
    unstored: set[int] = field(default_factory=set)
    """The candidate or verified generation some rank could not write or relabel in SCOUT's durable store."""
    verified_after: int | None = None
    """Steps from the capture of ``verified`` to its promotion (the certification latency)."""
    history: list[tuple[int, str]] = field(default_factory=list)

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
        if evidence.sdc or evidence.inconclusive or evidence.nonfinite:
            if self.candidate is not None:
                self.history.append((step, f"candidate {self.candidate} rejected"))
            self.candidate = None  # may already hold corruption the finished checks did not see
            self.history.append((step, "recover"))
            return Action.RECOVER
        if evidence.missing:
            self.history.append((step, "skip: evidence missing (this check's units do not count)"))
            return Action.SKIP
        if evidence.busy:
            if evidence.covered and self.candidate is not None and not self.static:
                self._promote(step)
                self.candidate = None  # the next boundary that is not busy captures the new one (coverage stands)
                self.history.append((step, "no capture: the previous snapshot is still being persisted"))
                return Action.PROMOTE
            self.history.append((step, "skip: the previous snapshot is still being persisted"))
            return Action.SKIP
        if self.static:
            if not evidence.covered:  # no layer was replayed: this boundary cannot vouch for the state
                return Action.SKIP
            self.latest = self.verified = step
            self.verified_after = 0
            self.history.append((step, "captured and verified (last check only)"))
            return Action.CAPTURE_AND_PERSIST
        self.latest = step
        if not evidence.covered:
            self.history.append((step, "captured (coverage not complete yet)"))
            return Action.CAPTURE
        if self.candidate is not None:
            self._promote(step)
        self.candidate = step
        self.history.append((step, f"captured and persisted as candidate {step}"))
        return Action.CAPTURE_AND_PERSIST

    def _promote(self, step: int) -> None:
        self.verified, self.verified_after = self.candidate, step - self.candidate
        self.history.append((step, f"candidate {self.candidate} promoted to verified: {step - self.candidate} "
                                   f"steps from capture to verified"))


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
    returns True when it found no SDC; it is called for ``STRAGGLER`` and
    ``OTHER`` failures, never after SDC or a lost machine (those restore verified
    whatever it would say). A decision without any usable generation has
    ``generation=None``.

    The paper restores latest after a straggler unswept ("slowness is not
    numerical divergence"). We do not: the latest state may carry an SDC that
    no check has reached yet (coverage takes I x max(L, P) steps), and a
    straggler verdict can be false (a loaded machine). Latest is restored only
    when the sweep shows it clean, exactly as after a crash.
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
    why = ("straggler: slowness is not numerical divergence, but the latest state may carry an SDC no check "
           "has reached yet; " if failure is FailureKind.STRAGGLER else "")
    if sweep is None:  # e.g. at the verdict: a restart (Restarter.resume) sweeps and decides again
        return pick("verified", why + ("no emergency sweep has run: verified, unless the restart's sweep shows the "
                                       "latest state clean" if why else
                                       "no emergency sweep available: cannot show the latest state clean"))
    clean = bool(sweep())
    if clean:
        return pick("latest", why + "emergency sweep (every layer, the embedding, the head, every expert) found "
                    "no SDC", True)
    return pick("verified", why + "emergency sweep found SDC in the latest state", False)
