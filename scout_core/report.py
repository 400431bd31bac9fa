"""Incident records and their sinks.

Every verdict SCOUT reaches becomes one :class:`Incident`. The same record
drives the JSON-lines file that recovery tooling tails, the log, and the
recovery policy. The schema is documented in ``docs/incident-schema.md``.

The JSON-lines sink appends each record as ONE ``write(2)`` on a descriptor
opened with ``O_APPEND``, so concurrent writers (several ranks on one host, an
observer and its trainer) never interleave partial lines, and a reader never
sees half a record.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "SCHEMA_VERSION",
    "Incident",
    "IncidentKind",
    "IncidentScope",
    "JsonlSink",
    "LoggingSink",
    "Reporter",
    "Sink",
    "format_table",
    "read_incidents",
]

SCHEMA_VERSION = 1

_log = logging.getLogger("scout")


class IncidentKind(enum.StrEnum):
    SDC = "sdc"
    STRAGGLER = "straggler"
    HANG = "hang"
    DATA_STALL = "data_stall"
    CHECKPOINT_STALL = "checkpoint_stall"
    OBSERVER_FAILURE = "observer_failure"
    DIAGNOSIS_ERROR = "diagnosis_error"
    """SCOUT's own work failed on this rank; the check was skipped on every peer (not a verdict on the job)."""
    RESOLVED = "resolved"
    """Progress resumed after a hang verdict: the stall it named ended by itself."""
    INCONCLUSIVE = "inconclusive"
    """A check could not decide, for a reason in ``evidence.reason`` (``nondeterministic``: a rank's replay,
    run twice, signed differently); never acted on, and the boundary is not certified."""


class IncidentScope(enum.StrEnum):
    RANK = "rank"
    PEER_GROUP = "peer_group"
    MACHINE = "machine"
    JOB = "job"


def _package_version() -> str:
    from scout_core import __version__

    return __version__


@dataclass(kw_only=True)
class Incident:
    """One localization verdict."""

    kind: IncidentKind
    scope: IncidentScope
    ranks: list[int]
    """Global ranks named (the culprits for scope rank; the members otherwise)."""
    hosts: list[str] = field(default_factory=list)
    """Machines of ``ranks`` (the machine to act on for scope machine)."""
    devices: list[str] = field(default_factory=list)
    """Device ids of ``ranks``, e.g. ``cuda:3`` or ``cpu``."""
    step: int | None = None
    """Optimizer step at which the evidence was taken."""
    surface: str = ""
    """What was compared: layer / recipe / collective / surface name."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """C3 status, bitmap, gathered evidence and peer ranks, plus kind-specific facts."""
    time_to_verdict_s: float | None = None
    """Seconds from the triggering observation to this verdict."""
    reason: str = ""
    """One sentence for the operator."""
    run_id: str = ""
    reporter_rank: int | None = None
    time_unix: float = field(default_factory=time.time)
    version: str = field(default_factory=_package_version)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.kind = IncidentKind(self.kind)
        self.scope = IncidentScope(self.scope)
        self.ranks = [int(r) for r in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind.value
        d["scope"] = self.scope.value
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), default=repr)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Incident:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown incident fields {sorted(unknown)}")
        return cls(**data)


class Sink(Protocol):
    def emit(self, incident: Incident) -> None: ...


class JsonlSink:
    """Appends one JSON line per incident, atomically, optionally fsync'ed."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = os.fspath(path)
        self.fsync = fsync
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._lock = threading.Lock()

    def emit(self, incident: Incident) -> None:
        line = (incident.to_json() + "\n").encode()
        # Opened per record: an observer process and its trainer can both hold
        # this sink, and a rotated file is picked up on the next record.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            with self._lock:
                written = os.write(fd, line)
                if written != len(line):  # regular files write fully or raise; be loud if not
                    raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
                if self.fsync:
                    os.fsync(fd)
        finally:
            os.close(fd)


class LoggingSink:
    """Sends each incident to the ``scout`` logger as one readable line."""

    def __init__(self, level: int | str = logging.WARNING, logger: logging.Logger | None = None) -> None:
        self.level = logging.getLevelName(level) if isinstance(level, str) else level
        self.logger = logger or _log

    def emit(self, incident: Incident) -> None:
        self.logger.log(
            self.level,
            "SCOUT %s scope=%s ranks=%s hosts=%s step=%s surface=%s: %s",
            incident.kind.value, incident.scope.value, incident.ranks, incident.hosts,
            incident.step, incident.surface, incident.reason,
        )


class Reporter:
    """Stamps run id, reporter rank and version, then fans out to sinks."""

    def __init__(self, sinks: Iterable[Sink] = (), *, run_id: str = "", rank: int | None = None) -> None:
        self.sinks = list(sinks)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.rank = rank
        self.hostname = socket.gethostname()

    def emit(self, incident: Incident) -> Incident:
        if not incident.run_id:
            incident.run_id = self.run_id
        if incident.reporter_rank is None:
            incident.reporter_rank = self.rank
        errors = []
        for sink in self.sinks:
            try:
                sink.emit(incident)
            except Exception as exc:  # one broken sink must not swallow the verdict elsewhere
                errors.append(exc)
                _log.error("SCOUT sink %r failed: %s", sink, exc)
        if errors and len(errors) == len(self.sinks):
            raise RuntimeError(f"every incident sink failed: {errors}")
        return incident


def read_incidents(path: str | os.PathLike[str]) -> Iterator[Incident]:
    """Parse a JSON-lines incident file; a truncated final line is skipped."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a writer killed mid-line; whole-line writes make this rare
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON incident record") from None
        yield Incident.from_dict(data)


def ranks_text(ranks: Sequence[int]) -> str:
    """'0-15' for a contiguous run of three or more, '3,14' otherwise."""
    rs = sorted(ranks)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def format_table(incidents: Sequence[Incident]) -> str:
    """A fixed-width table an operator can read at a glance."""
    headers = ("time", "kind", "scope", "ranks", "hosts", "step", "surface", "verdict_s", "reason")
    rows = []
    for inc in incidents:
        rows.append((
            time.strftime("%H:%M:%S", time.localtime(inc.time_unix)),
            inc.kind.value,
            inc.scope.value,
            ranks_text(inc.ranks) or "-",
            ",".join(dict.fromkeys(inc.hosts)) or "-",  # each machine once, in order
            "-" if inc.step is None else str(inc.step),
            inc.surface or "-",
            "-" if inc.time_to_verdict_s is None else f"{inc.time_to_verdict_s:.3f}",
            inc.reason,
        ))
    if not rows:
        return "no incidents"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
