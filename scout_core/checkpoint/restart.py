"""The running job's restart glue: restore what the retrieval policy chooses, or go on from the framework's own.

:class:`~scout_core.checkpoint.resume.Restarter` decides and loads; this module gives it the rank's parts (how to
restore the model and the caller's state, the state as it is now for a rolled-back sweep, the experts' sweep)
and puts SCOUT's schedule, certification and step count back afterwards.
"""

from __future__ import annotations

from typing import Any

from scout_core.checkpoint.certify import Certifier
from scout_core.checkpoint.resume import Restarter, ResumeResult, drop_newer
from scout_core.checkpoint.snapshot import restore_state
from scout_core.parts import ScoutParts

__all__ = ["Restart"]


def _trust(cert: Certifier, latest: int | None, verified: int | None, *, durable: int | None = None) -> None:
    """The certification state of a restored step (None: the state from before resume() put back): nothing is
    a candidate yet, no check counts toward it.
    ``durable``: the verified generation every rank holds in SCOUT's store (what pruning keeps from)."""
    cert.latest, cert.verified, cert.candidate, cert.durable = latest, verified, None, durable
    cert.verified_after = None  # not known for a restored generation
    cert.unstored = set()


class Restart:
    """The restart path of one rank's SCOUT (every rank calls it alike)."""

    def __init__(self, parts: ScoutParts) -> None:
        self.parts = parts

    def resume(self, failure: str | None = None) -> ResumeResult:
        """Restore the checkpoint the retrieval policy chooses (see :mod:`scout_core.checkpoint.resume`)."""
        p = self.parts
        if p.checkpoint is None:
            return ResumeResult(step=None, reason="checkpoint.enabled is false: nothing to resume")
        a = p.adapter
        restarter = Restarter(
            p.checkpoint, control_group=p.groups.world_control, engine=p.replay,
            restore=lambda snap: restore_state(a.chunks, a.optimizers, snap, set_extra=p.restore_caller_state,
                                               rng_providers=a.rng_providers),
            after_restore=self.after_restore, current=self.state_now,
            extra_sweeps=[p.experts.sweep] if p.experts is not None else [], guard=p.guard)
        with p.own_checkpoint_io("read"):  # loading (and a sweep) can take long: the observer sees why
            return restarter.resume(failure)

    def state_now(self) -> dict[str, Any]:
        """A copy of the state as it is now, in pageable host memory (one state's size, taken once by resume()
        before its first restore, freed when it returns): what a failed restore or a dirty sweep puts back."""
        snapshots = self.parts.snapshots
        assert snapshots is not None
        snapshots.capture(-1, extra_later=True, pinned=False)
        try:
            # The caller's state too: a rolled-back sweep must not leave the scheduler or data position of
            # the rejected state behind.
            snapshots.complete_extra({"caller": self.parts.caller_state()})
            return snapshots.result()
        finally:
            snapshots.release()

    def after_restore(self, snap: dict[str, Any], trust: dict[str, Any]) -> None:
        p = self.parts
        if p.replay is not None:
            p.replay.load_sweep_state(snap["extra"].get("scout", {"step": snap["step"], "checks": 0}))
        if p.experts is not None:
            p.experts.load_state(snap["extra"].get("scout_experts", {}))
        assert p.checkpoint is not None
        _trust(p.checkpoint.certifier, trust["latest"], trust["verified"], durable=trust["verified"])
        p.coverage.reset()
        if p.tracker is not None:  # None: the state from before resume() was put back
            p.tracker.resume_at = trust["latest"]

    def continue_from(self, step: int, *, verified: int | None, abandon_newer: bool = True) -> None:
        """The framework restored its own checkpoint of ``step`` (see
        :meth:`ScoutHandle.continue_from <scout_core.handle.ScoutHandle.continue_from>`)."""
        p = self.parts
        if p.checkpoint is not None and abandon_newer:
            p.checkpoint.flush()
            drop_newer(p.checkpoint, int(step), rank=p.rank)
        if p.replay is not None:
            p.replay.continue_at(step)
        if p.tracker is not None:
            p.tracker.resume_at = int(step)
        cert = p.certifier
        if cert is not None:
            _trust(cert, int(step), verified)
        p.coverage.reset()
