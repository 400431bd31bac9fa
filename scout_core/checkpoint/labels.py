"""Which of the framework's own checkpoints this run labels, and the certification behind their labels.

The labels themselves are :class:`~scout_core.checkpoint.durable.FrameworkCheckpoints`; this is the run's side:
when labelling starts, the certifier where SCOUT's own snapshots do not certify, and the verdicts of this run that
labels made after them must still honour.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scout_core.checkpoint.certify import Action, Certifier, FailureKind
from scout_core.checkpoint.durable import FrameworkCheckpoints

__all__ = ["FrameworkLabels"]

_log = logging.getLogger("scout")


class FrameworkLabels:
    """The run's labels of the framework's checkpoints: none until the plugin names their folder."""

    def __init__(self, *, writer: bool, replay_on: bool, new_certifier: Callable[[], Certifier] | None) -> None:
        """``writer``: this rank writes the labels file. ``replay_on``: replay runs, so evidence can vouch for a
        checkpoint. ``new_certifier`` makes the certifier for these labels alone; None where SCOUT's own
        snapshots certify (their coordinator's certifier is the job's)."""
        self.writer = writer
        self.replay_on = replay_on
        self.new_certifier = new_certifier
        self.framework_checkpoints: FrameworkCheckpoints | None = None
        self.certifier: Certifier | None = None  # certifies the framework's checkpoints alone
        # Every recovery verdict of this run, for labels made after it (their folder is known only at the first
        # save, or the run saves to another folder than it loaded from): newer than this step is rejected, and
        # the failure the job stops for.
        self._rejected_above: int | None = None
        self._stopped_for: FailureKind | None = None

    def label(self, folder: str) -> FrameworkCheckpoints | None:
        """Label the framework's checkpoints in ``folder`` (see
        :meth:`ScoutHandle.label_framework_checkpoints <scout_core.handle.ScoutHandle.label_framework_checkpoints>`);
        None when replay is off: nothing could ever verify a checkpoint, and labels would only hold restarts
        back."""
        if not self.replay_on:
            _log.warning("SCOUT: replay is off, so nothing certifies the framework's checkpoints in %s: they are "
                         "not labelled and a restart loads what the framework chooses", folder)
            return None
        self.certify()
        labels = FrameworkCheckpoints(folder, writer=self.writer)
        if self._rejected_above is not None:  # a verdict of this run came before these labels
            labels.reject_above(self._rejected_above, stopped_for=self._stopped_for)
        self.framework_checkpoints = labels
        return labels

    def certify(self) -> None:
        """Start certifying for the framework's checkpoints now, where their folder is known only at the first
        save: a verdict before that save must still reject what the job saves after it, and nothing may be
        verified on evidence that began after the corruption spread. Nothing where SCOUT's own snapshots
        certify, or replay is off."""
        if self.replay_on and self.new_certifier is not None and self.certifier is None:
            self.certifier = self.new_certifier()

    def on_boundary(self, step: int, action: Action | None, cert: Certifier, *, failure: FailureKind | None,
                    stopping: bool, on_error: Callable[[Exception], None]) -> None:
        """A certified boundary: relabel, and remember a recovery verdict for labels made later."""
        if self.framework_checkpoints is not None:
            try:
                self.framework_checkpoints.on_boundary(step, action, cert, failure=failure, stopping=stopping)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                on_error(exc)
        if action is Action.RECOVER:  # remembered for labels made later
            verified = -1 if cert.verified is None else cert.verified
            before = self._rejected_above
            self._rejected_above = verified if before is None else min(before, verified)
            if failure is not None and stopping:
                self._stopped_for = failure
