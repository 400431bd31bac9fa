"""The job's life-cycle records: what SCOUT was asked to do at ``enable()``, and what it did by ``close()``.

Incident records exist only where something was found, so a clean run left no file at all, and ``scout report``
could not tell it from a wrong path or a run SCOUT never watched. Beside the incident file (``incidents.jsonl``:
``incidents.run.jsonl``) rank 0 appends a ``start`` record when SCOUT is on (versions, a digest of the
configuration, the peer groups, which checks are on) and an ``end`` record when it closes (steps, checks run, checks
every peer agreed on, how the run ended). Plain JSON lines, fsync'ed; read with :func:`read_run_log`, which skips
what it cannot parse (the file is written by the job, read by anyone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from typing import Any

__all__ = ["CheckCounts", "RunLog", "check_outcome", "read_json_objects", "read_run_log", "run_log_path",
           "run_summary"]


def run_log_path(jsonl_path: str) -> str:
    """The life-cycle file beside an incident file: ``x/incidents.jsonl`` -> ``x/incidents.run.jsonl``."""
    root, ext = os.path.splitext(jsonl_path)
    return f"{root}.run{ext or '.jsonl'}"


def check_outcome(result: Any, expert: Any = None) -> str | None:
    """What one boundary's replay came to: ``skipped`` (SCOUT's own failure set it aside on every peer),
    ``agreed`` (every peer agreed and there was evidence to agree on), ``found`` (a verdict or an open question),
    or None where no check ran. ``expert``: the expert replay of the same step, if any."""
    if result is None:
        return None
    expert = expert if expert is not None and expert.step == result.step else None
    if result.skipped or (expert is not None and expert.skipped and not result.checked):
        return "skipped"
    if not (result.checked or expert is not None):
        return None
    found = (result.incidents or result.incidents_global or result.sdc or result.inconclusive
             or (expert is not None and (expert.incidents or expert.sdc or expert.inconclusive or expert.skipped)))
    return "found" if found or result.missing else "agreed"


@dataclasses.dataclass
class CheckCounts:
    """Boundaries and checks this rank took part in (every rank takes part in every check)."""

    steps: int = 0
    checks: int = 0
    agreed: int = 0
    skipped: int = 0
    _counted: Any = None

    def count(self, step: int, result: Any, expert: Any = None) -> None:
        self.steps = max(self.steps, step)
        if result is None or result is self._counted:  # a boundary without replay leaves the last result
            return
        self._counted = result
        outcome = check_outcome(result, expert)
        if outcome == "skipped":
            self.skipped += 1
        elif outcome is not None:
            self.checks += 1
            self.agreed += outcome == "agreed"


class RunLog:
    """Rank 0's writer of the two records; every method is a no-op on other ranks and never raises."""

    def __init__(self, jsonl_path: str | None, *, rank: int, run_id: str, fsync: bool = True) -> None:
        self.path = run_log_path(jsonl_path) if jsonl_path and rank == 0 else None
        self.run_id = run_id
        self.fsync = fsync
        self.counts = CheckCounts()
        self._t0 = time.time()
        self.error: str | None = None

    def start(self, *, config: Any, world_size: int, peer_groups: list[list[int]], parts_on: dict[str, bool],
              recipes: list[str], framework: str = "") -> None:
        import torch

        from scout_core import __version__

        settings = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
        self._write({
            "record": "start", "world_size": world_size, "framework": framework,
            "versions": {"scout": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "config_sha256": hashlib.sha256(settings.encode()).hexdigest()[:16],
            "peer_groups": {"count": len(peer_groups), "size": max(map(len, peer_groups), default=0),
                            "first": peer_groups[0] if peer_groups else []},
            "parts": parts_on, "recipes": recipes,
        })

    def end(self, how: str) -> None:
        c = self.counts
        self._write({"record": "end", "ended": how, "steps": c.steps, "checks": c.checks, "agreed": c.agreed,
                     "skipped": c.skipped, "seconds": round(time.time() - self._t0, 1)})

    def ended_by_stop(self, how: str, step: int) -> None:
        """The end record of a job whose trainers SCOUT's observers stop (rank 0's observer writes it: those
        trainers end by a signal, without close()); it knows the step, not the trainers' counts."""
        self._write({"record": "end", "ended": how, "steps": step, "checks": None, "agreed": None, "skipped": None,
                     "seconds": None})

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({**record, "run_id": self.run_id, "time": round(time.time(), 3)}) + "\n"
        try:
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:  # a record SCOUT cannot write never touches training
            self.error = f"{type(exc).__name__}: {exc}"


def read_json_objects(path: str) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file that is a JSON object, oldest first (a torn last line, or a line that is
    anything else, is passed over; no file: none)."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    continue
                if isinstance(record, dict):
                    out.append(record)
    except FileNotFoundError:
        return []
    return out


def read_run_log(path: str) -> list[dict[str, Any]]:
    """The records of a life-cycle file, in order; lines that are not its records are skipped."""
    return [r for r in read_json_objects(path) if r.get("record") in ("start", "end")]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def run_summary(records: list[dict[str, Any]], incidents: int) -> str:
    """One plain line per launch of the job: how far it got and what SCOUT checked."""
    lines = []
    for r in records:
        if r.get("record") == "start":
            lines.append(f"run {r.get('run_id', '?')}: SCOUT started on {_int(r.get('world_size'))} ranks"
                         f" (scout {(r.get('versions') or {}).get('scout', '?')})")
        elif r.get("record") == "end" and r.get("checks") is None:
            lines.append(f"run {r.get('run_id', '?')}: ended ({r.get('ended', '?')}) in step "
                         f"{_int(r.get('steps')) + 1}")
        elif r.get("record") == "end":
            checks, agreed = _int(r.get("checks")), _int(r.get("agreed"))
            skipped = f", {_int(r.get('skipped'))} skipped by a SCOUT failure" if _int(r.get("skipped")) else ""
            lines.append(f"run {r.get('run_id', '?')}: ended ({r.get('ended', '?')}) after {_int(r.get('steps'))} "
                         f"steps, {checks} replay checks ({agreed} agreed by every peer{skipped})")
    if records and records[-1].get("record") == "start":
        lines.append("the last launch has no end record: it is still running, or its trainers ended without closing "
                     "SCOUT (a signal: SCOUT's own stop on a hang sends one, so does a launcher)")
    if records and not incidents:
        lines.append("no incidents recorded")
    return "\n".join(lines)
