"""Diagnosis never breaks training: local failures become a skip agreed by every rank.

Replay interleaves local work (capturing, cloning, replaying a layer, signing)
with collectives, some of them across peer groups (HSDP timing, FSDP unshards,
the cross-group intersection). If one rank's local work raised and that rank
simply returned, the others would wait forever in the next collective. So every
piece of local work runs through :meth:`DiagnosisGuard.run`, which catches the
failure and skips every later piece of the same check on this rank, and before
the next collective all ranks agree on one flag (:meth:`DiagnosisGuard.agree`,
a MIN all-reduce of one int on SCOUT's own gloo group spanning the job): if any
rank failed, every rank skips the rest of that check together. The rank that
failed writes one ``diagnosis_error`` record with its traceback (a failure every
rank met alike, as members of one exchange that sent different surfaces: the
group's first rank alone); training continues. Out-of-memory errors are failures
like any other; only the formatted traceback is kept, so the failed work's
tensors are freed at once.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter

__all__ = ["DiagnosisGuard", "Failure"]

_log = logging.getLogger("scout")
T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    """What is kept of an exception inside SCOUT: text only (no frames, so no tensors stay alive)."""

    where: str
    kind: str
    message: str
    traceback: str
    writer: int | None = None
    """A failure every rank met alike (an exchange whose members sent different surfaces): the one rank that
    records it. None: the rank that failed records its own."""

    @classmethod
    def of(cls, exc: BaseException, where: str) -> Failure:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        writer = getattr(exc, "writer", None)
        return cls(where, type(exc).__name__, str(exc), tb, writer if isinstance(writer, int) else None)


class DiagnosisGuard:
    """Failure isolation for one check: local work through :meth:`run`, agreement through :meth:`agree`."""

    def __init__(self, control_group: Any, *, rank: int, reporter: Reporter | None,
                 hosts: dict[int, str] | None = None) -> None:
        self.group = control_group
        self.rank = rank
        self.reporter = reporter
        self.hosts = dict(hosts or {})
        self.failure: Failure | None = None
        self.errors = 0  # diagnosis_error records written by this rank

    @property
    def ok(self) -> bool:
        return self.failure is None

    def reset(self) -> None:
        self.failure = None

    def fail(self, exc: BaseException, where: str) -> None:
        """Record a failure that happened elsewhere (e.g. in a hook before the boundary)."""
        if self.failure is None:
            self.failure = Failure.of(exc, where)

    def run(self, where: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, unless an earlier piece of this check failed; a failure is kept, not raised."""
        if self.failure is not None:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any failure of diagnosis must not reach training
            self.failure = Failure.of(exc, where)
            del exc
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            return None

    def attempt(self, where: str, fn: Callable[[], T]) -> T | None:
        """``fn()`` even after an earlier failure (it holds a collective every rank must join, e.g. an
        FSDP unshard); a failure is kept (the first one wins), not raised."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any failure of diagnosis must not reach training
            if self.failure is None:
                self.failure = Failure.of(exc, where)
            del exc
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            return None

    def agree(self, step: int | None, surface: str = "replay") -> bool:
        """True when every rank's local work succeeded so far. Every rank calls it, in the same order."""
        return self.agree_and_ask(step, skip=False, surface=surface)[0] == "ok"

    def agree_and_ask(self, step: int | None, *, skip: bool, ask: bool = False,
                      surface: str = "replay") -> tuple[str, bool]:
        """Like :meth:`agree`, also combining a local reason to skip (``"ok"``, ``"skip"`` or ``"error"``), and
        whether to run an optional part that every rank runs or none does (replay's timed scratch all-reduce):
        granted where every rank is ok and some rank ``ask``-ed. Every rank reads the same answer, whatever each
        one's own reasons to ask, so a part with a collective never leaves a rank waiting in it alone.

        One MIN all-reduce of one int on SCOUT's gloo group spanning the job (0 error, 1 skip, 2 ok and asked,
        3 ok). The rank that failed writes the record, once per check.
        """
        code = 0 if self.failure is not None else (1 if skip else (2 if ask else 3))
        flag = torch.tensor([code], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        worst = int(flag.item())
        if worst == 0 and self.failure is not None and self.failure.kind != "reported":
            if self.failure.writer in (None, self.rank):
                self.report(step, surface, self.failure)
            self.failure = Failure(self.failure.where, "reported", "", "")
        return ("error", "skip", "ok", "ok")[worst], worst == 2

    def report(self, step: int | None, surface: str, failure: Failure | BaseException, where: str = "") -> None:
        """One ``diagnosis_error`` record from the rank that failed (its traceback is only here)."""
        if isinstance(failure, BaseException):
            failure = Failure.of(failure, where)
        self.errors += 1
        _log.warning("rank %d: SCOUT %s failed at step %s (%s: %s); every rank skips this check",
                     self.rank, failure.where, step, failure.kind, failure.message)
        if self.reporter is None:
            return
        self.reporter.emit(Incident(
            kind=IncidentKind.DIAGNOSIS_ERROR, scope=IncidentScope.RANK, ranks=[self.rank],
            hosts=[self.hosts.get(self.rank, "?")], step=step, surface=f"{surface}:{failure.where}",
            reason=f"SCOUT's own {failure.where} raised {failure.kind}: {failure.message}; the check was skipped "
                   "on every rank and training continued",
            evidence={"exception": failure.kind, "message": failure.message, "traceback": failure.traceback},
        ))
