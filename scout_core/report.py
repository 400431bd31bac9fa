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
import math
import operator
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "SCHEMA_VERSION",
    "list_of",
    "Incident",
    "IncidentKind",
    "IncidentScope",
    "JsonlSink",
    "LoggingSink",
    "RecordError",
    "Reporter",
    "Sink",
    "format_table",
    "group_repeats",
    "hosts_to_exclude",
    "parse_incident",
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
    SHUTDOWN = "shutdown"
    """The job ended (closed, interrupted, stopped) while a hang verdict stood, with no progress seen after it: the
    stall is not known to have ended."""
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
        try:
            self.ranks = [operator.index(r) for r in self.ranks]  # ints of any kind (numpy's too), never 1.5
        except TypeError:
            raise ValueError(f"ranks must be a list of rank numbers, got {self.ranks!r}") from None
        if any(r < 0 for r in self.ranks):
            raise ValueError(f"ranks must be a list of rank numbers (0 or more), got {self.ranks!r}")

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


STALL_KINDS = ("hang", "data_stall", "checkpoint_stall")
"""Verdicts on ranks that stopped progressing (the observers'): their ``step`` counts the steps those ranks finished."""
_COUNTS_FINISHED = (*STALL_KINDS, "resolved", "shutdown")


def step_being_run(incident: Incident) -> int | None:
    """The step a message names: the step being run. A stall's record holds the steps its ranks had finished (the
    stall is in the next one); a replay check's holds the step it checked."""
    if incident.step is None:
        return None
    return incident.step + 1 if incident.kind.value in _COUNTS_FINISHED else incident.step


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
            step_being_run(incident), surfaces_text(incident.surface), incident.reason,
        )


def surfaces_text(surface: str, keep: int = 2) -> str:
    """A ``;``-joined surface list as a log line shows it: the first ``keep`` and how many more (a replay check
    that differs names every recorded surface of the layer; the record keeps them all)."""
    names = surface.split(";")
    if len(names) <= keep + 1:
        return surface
    return f"{';'.join(names[:keep])} (+{len(names) - keep} more)"


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


class RecordError(ValueError):
    """A line of an incident file that is not a valid record; the message names the file and line."""


_REQUIRED = ("kind", "scope", "ranks")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def list_of(kind: type) -> Callable[[Any], bool]:
    """A check that a value read from a file is a list of ``kind`` (never of booleans posing as ints)."""
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)


_FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "ranks": (list_of(int), "a list of rank numbers"),
    "hosts": (list_of(str), "a list of machine names"),
    "devices": (list_of(str), "a list of device names"),
    "step": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "a step number or null"),
    "surface": (lambda v: isinstance(v, str), "a string"),
    "evidence": (lambda v: isinstance(v, dict), "an object"),
    "time_to_verdict_s": (lambda v: v is None or (_is_number(v) and v >= 0), "seconds or null"),
    "reason": (lambda v: isinstance(v, str), "a string"),
    "run_id": (lambda v: isinstance(v, str), "a string"),
    "reporter_rank": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "a rank or null"),
    "time_unix": (lambda v: _is_number(v) and 0 <= v < 1e11, "a Unix time"),
    "version": (lambda v: isinstance(v, str), "a string"),
    "schema": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a schema number"),
}
"""What each field of a record read back must be: a record is data from a file, and a wrong type would reach the
table, the HTML page or the hosts list (a string of hosts read as a list drains one host per letter)."""


def parse_incident(line: str, where: str = "record") -> Incident:
    """One JSON-lines record, or :class:`RecordError` saying what is wrong with it (``where``: file and line)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise RecordError(f"{where}: nested too deeply to be a record") from None
    if not isinstance(data, dict):
        raise RecordError(f"{where}: a record is a JSON object, got {type(data).__name__}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise RecordError(f"{where}: missing field(s) {', '.join(missing)}")
    for key, (ok, what) in _FIELD_TYPES.items():
        if key in data and not ok(data[key]):
            raise RecordError(f"{where}: {key} must be {what}, got {json.dumps(data[key])[:80]}")
    try:
        return Incident.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"{where}: {exc}") from None


def read_incidents(path: str | os.PathLike[str], *,
                   on_truncated: Callable[[str], None] | None = None,
                   on_bad: Callable[[str], None] | None = None) -> Iterator[Incident]:
    """Parse a JSON-lines incident file.

    A final line without its newline that does not parse is a writer killed mid-record (whole-line writes
    make this rare): it is skipped, and ``on_truncated`` hears about it with its line number. Any other bad
    line raises :class:`RecordError` naming the file and line, or, with ``on_bad``, is skipped and named to
    it (a torn append in a file several machines write must not hide the records around it)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            yield parse_incident(line, where)
        except RecordError as exc:
            if i == len(lines) - 1:  # no newline after it: the last write did not finish
                if on_truncated is not None:
                    on_truncated(f"{where}: a truncated last record was skipped ({exc})")
                continue
            if on_bad is None:
                raise
            on_bad(str(exc))


def ranks_text(ranks: Sequence[int]) -> str:
    """'0-15' for a contiguous run of three or more, '3,14' otherwise."""
    rs = sorted(ranks)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


@dataclass(frozen=True)
class IncidentGroup:
    """Repeated records of one fault: one run's records of the same kind and scope naming the same ranks on the
    same machines."""

    first: Incident
    count: int
    steps: tuple[int, ...]
    surfaces: tuple[str, ...]
    last_time_unix: float


def group_repeats(incidents: Iterable[Incident]) -> list[IncidentGroup]:
    """One group per (run, kind, scope, ranks, machines), in order of first appearance: a faulty rank found again
    at every check is one row, with how often and at which steps."""
    order: dict[tuple[Any, ...], list[Incident]] = {}
    for inc in incidents:  # one fault: one job, the same verdict, the same ranks on the same machines
        key = (inc.run_id, inc.kind, inc.scope, tuple(sorted(inc.ranks)), tuple(sorted(set(inc.hosts))))
        order.setdefault(key, []).append(inc)
    return [IncidentGroup(first=g[0], count=len(g), steps=tuple(sorted({step_being_run(i) for i in g
                                                                        if i.step is not None})),
                          surfaces=tuple(dict.fromkeys(i.surface for i in g if i.surface)),
                          last_time_unix=max(i.time_unix for i in g))
            for g in order.values()]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


def _hosts_text(hosts: Sequence[str], width: int = 16) -> str:
    """As many machines as fit in ``width``, then how many more: 'node0,node1 (+6)'."""
    for shown in range(len(hosts), 0, -1):
        more = f" (+{len(hosts) - shown})" if shown < len(hosts) else ""
        text = ",".join(hosts[:shown]) + more
        if len(text) <= width:
            return text
    return _clip(hosts[0], width - 6) + f" (+{len(hosts) - 1})" if len(hosts) > 1 else _clip(hosts[0], width)


def _steps_text(steps: Sequence[int]) -> str:
    if not steps:
        return "-"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]}"


def format_table(incidents: Sequence[Incident], *, width: int | None = 160, group: bool = True) -> str:
    """A fixed-width table an operator can read at a glance: repeated records of one fault on one rank are one
    row (``n``: how many; ``step``: first..last), long surface lists and reasons are clipped so a row fits
    ``width`` columns (None: never clipped); the JSON records keep every detail."""
    headers = ("time", "kind", "scope", "ranks", "hosts", "n", "step", "surface", "verdict_s", "reason")
    groups = group_repeats(incidents) if group else [
        IncidentGroup(first=i, count=1, steps=() if i.step is None else (step_being_run(i),),
                      surfaces=(i.surface,) if i.surface else (), last_time_unix=i.time_unix) for i in incidents]
    rows = []
    for g in groups:
        inc = g.first
        surface = g.surfaces[0] if g.surfaces else "-"
        if width is not None:  # a check's many surfaces: the first two and how many more (--wide: all of them)
            surface = surfaces_text(surface)
        if len(g.surfaces) > 1:
            surface = f"{_clip(surface, 40)} (+{len(g.surfaces) - 1})"
        hosts = list(dict.fromkeys(inc.hosts))  # each machine once, in order
        rows.append([
            time.strftime("%H:%M:%S", time.localtime(inc.time_unix)),
            inc.kind.value,
            inc.scope.value,
            _clip(ranks_text(inc.ranks), 16) or "-",
            _hosts_text(hosts) or "-",
            str(g.count),
            _steps_text(g.steps),
            surface,
            "-" if inc.time_to_verdict_s is None else f"{inc.time_to_verdict_s:.3f}",
            " ".join(inc.reason.split()),  # one line, whatever the record holds
        ])
    if not rows:
        return "no incidents"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    if width is not None:  # surface and reason share what the other columns leave (each at least 10)
        surface_col = headers.index("surface")
        fixed = sum(w for i, w in enumerate(widths) if i not in (surface_col, len(headers) - 1))
        room = width - fixed - 2 * (len(headers) - 1)
        surface_room = max(min(widths[surface_col], room // 2), 10)
        for r in rows:
            r[surface_col] = _clip(r[surface_col], surface_room)
        widths[surface_col] = max(len("surface"), *(len(r[surface_col]) for r in rows))
        for r in rows:
            r[-1] = _clip(r[-1], max(room - widths[surface_col], 10))
        widths[-1] = max(len(headers[-1]), *(len(r[-1]) for r in rows))
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def drains_machine(kind: str, scope: str) -> bool:
    """Whether a verdict of this kind and scope names machines to drain: silent data corruption on a rank or a
    machine, and a straggler localized to a machine. A group-scoped verdict names no culprit; a hang, a stall
    or a one-rank straggler is for a restart to clear or confirm (that restart leaves its machines out:
    ``actions.exclude_hosts_path``'s ``hosts``)."""
    return ((kind == IncidentKind.SDC.value and scope in (IncidentScope.RANK.value, IncidentScope.MACHINE.value))
            or (kind == IncidentKind.STRAGGLER.value and scope == IncidentScope.MACHINE.value))


def hosts_to_exclude(incidents: Iterable[Incident]) -> list[str]:
    """Machines a scheduler should drain (:func:`drains_machine`), sorted."""
    hosts: dict[str, None] = {}
    for inc in incidents:
        if drains_machine(inc.kind.value, inc.scope.value):
            hosts.update((h, None) for h in inc.hosts if h and h != "?")
    return sorted(hosts)
