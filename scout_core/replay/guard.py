"""Diagnosis never breaks training: local failures become a skip agreed by every peer.

Replay interleaves local work (capturing, cloning, replaying a layer, signing)
with collectives over the peer group. If one rank's local work raised and that
rank simply returned, its peers would wait forever in the next collective. So
every stage of local work runs inside :meth:`DiagnosisGuard.stage`, and before
the next collective the peers agree on one flag (:meth:`DiagnosisGuard.agree`,
a MIN all-reduce of one int on SCOUT's own gloo control group): if any peer
failed, every peer skips the rest of that check together. The rank that failed
writes one ``diagnosis_error`` record with its traceback; training continues.
Out-of-memory errors are failures like any other (and release the device cache).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter

__all__ = ["DiagnosisGuard"]

_log = logging.getLogger("scout")


class DiagnosisGuard:
    """Stage-wise failure isolation for one peer group."""

    def __init__(self, control_group: Any, *, rank: int, reporter: Reporter | None,
                 hosts: dict[int, str] | None = None) -> None:
        self.group = control_group
        self.rank = rank
        self.reporter = reporter
        self.hosts = dict(hosts or {})
        self.failed: BaseException | None = None
        self.failed_where = ""
        self.errors = 0  # diagnosis_error records written by this rank

    def reset(self) -> None:
        self.failed, self.failed_where = None, ""

    @contextlib.contextmanager
    def stage(self, where: str) -> Iterator[None]:
        """Run local work; an exception is kept (not raised) until the next :meth:`agree`."""
        if self.failed is not None:  # an earlier stage of this check failed: do nothing more locally
            yield
            return
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - any failure of diagnosis must not reach training
            self.failed, self.failed_where = exc, where
            if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()

    def agree(self, step: int, surface: str = "replay") -> bool:
        """True when every peer's local stages succeeded so far. Call on every peer, in the same order."""
        flag = torch.tensor([0 if self.failed is not None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        ok = bool(flag.item())
        if not ok and self.failed is not None:
            self.report(step, surface, self.failed, self.failed_where)
        return ok

    def report(self, step: int | None, surface: str, exc: BaseException, where: str) -> None:
        """One ``diagnosis_error`` record from the rank that failed (its traceback is only here)."""
        self.errors += 1
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        _log.warning("rank %d: SCOUT %s failed at step %s (%s: %s); every peer skips this check",
                     self.rank, where, step, type(exc).__name__, exc)
        if self.reporter is None:
            return
        self.reporter.emit(Incident(
            kind=IncidentKind.DIAGNOSIS_ERROR, scope=IncidentScope.RANK, ranks=[self.rank],
            hosts=[self.hosts.get(self.rank, "?")], step=step, surface=f"{surface}:{where}",
            reason=f"SCOUT's own {where} raised {type(exc).__name__}: {exc}; the check was skipped on every "
                   "peer and training continued",
            evidence={"exception": type(exc).__name__, "message": str(exc), "traceback": tb},
        ))

