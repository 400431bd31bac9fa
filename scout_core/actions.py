"""What happens on a verdict (``actions.*``): log, or stop for a restart; hosts to exclude.

Verdicts are taken by peer groups, but acting on one is a job-wide matter: a
trainer that exits alone leaves its peers blocked. So at every checked
boundary the runtime combines the verdict flags job-wide (one collective it
already pays for certification), gathers the named ranks and machines only
when there is something to act on, and then every trainer does the same thing:

* ``log``: nothing more; training goes on.
* ``stop``: once the incident record and the retrieval decision are durable
  (written and fsync'ed), every trainer raises :class:`ScoutStop`, a
  ``SystemExit`` with ``actions.exit_code``, so a launcher (``torchrun
  --max-restarts``, a scheduler requeue) restarts the job; the restarted job
  calls ``handle.resume()`` and loads the chosen checkpoint.

Hangs are judged by the out-of-band observers while the trainers are blocked;
with ``stop`` each observer terminates its own trainer (SIGTERM) after the
record is written.

The hosts file (``actions.exclude_hosts_path``) is one JSON object::

    {"hosts": ["node7"], "ranks": [9], "verdicts": [{"kind": "sdc", "scope": "rank", "step": 40, ...}]}

merged across verdicts of one job and written atomically, so a launcher can
read it at any time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from scout_core.report import STALL_KINDS, Incident, IncidentKind, IncidentScope, drains_machine, list_of

if TYPE_CHECKING:  # the observer imports this module, without torch or the config's parser
    from scout_core.config import ScoutConfig

__all__ = ["LAUNCHER_ERROR_FILE_ENV", "ExclusionsError", "ScoutStop", "actionable", "exclude_hosts_path",
           "hang_action", "record_exclusions", "stop_message", "verdict_summary", "write_launcher_error"]

LAUNCHER_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Where torchelastic (``torchrun``) reads a failed worker's root cause: its "Root Cause" summary prints the message
of the earliest error file instead of the exit code or signal of whichever rank it happened to see first."""

_PLAIN_KINDS = {"sdc": "silent data corruption", "straggler": "a straggler", "hang": "a hang",
                "data_stall": "an input stall", "checkpoint_stall": "a checkpoint stall",
                "inconclusive": "an inconclusive check"}

_ACTIONABLE_KINDS = {IncidentKind.SDC, IncidentKind.STRAGGLER, IncidentKind.HANG, IncidentKind.DATA_STALL,
                     IncidentKind.CHECKPOINT_STALL}


class ScoutStop(SystemExit):
    """Raised on every trainer when ``actions.on_verdict`` is ``stop`` (its ``code`` is the exit status)."""


def exclude_hosts_path(cfg: ScoutConfig) -> str | None:
    """Where the hosts file goes: as configured, else beside the checkpoints (when enabled) or the incident
    records; None when the job keeps neither (the verdict is still logged)."""
    if cfg.actions.exclude_hosts_path:
        return cfg.actions.exclude_hosts_path
    if cfg.checkpoint.enabled:
        return os.path.join(cfg.checkpoint.directory, "exclude_hosts.json")
    if cfg.report.jsonl_path:
        return os.path.join(os.path.dirname(os.path.abspath(cfg.report.jsonl_path)), "exclude_hosts.json")
    return None


def actionable(incidents: Iterable[Incident]) -> list[Incident]:
    """Verdicts about the job (not SCOUT's own errors or observer health)."""
    return [i for i in incidents if i.kind in _ACTIONABLE_KINDS]


def record_exclusions(path: str, verdicts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Merge rank- and machine-scoped verdicts into the hosts file; fsync'ed, atomic. Returns its content.

    ``hosts`` / ``ranks``: what the job's restart leaves out (every rank- or machine-scoped verdict: a hung or
    stalled machine is not where to restart at once). ``drain``: the machines a scheduler should take out of
    service, the same as ``scout hosts-to-exclude`` prints (:func:`~scout_core.report.drains_machine`).
    Group- and job-scoped verdicts name no culprit machine, so they exclude nothing
    (they are still listed under ``verdicts`` for the operator).
    """
    from scout_core.durable_files import atomic_write

    current = _read_exclusions(path)
    if "drain" not in current:  # a file from before the list existed: its verdicts name the machines too
        current["drain"] = sorted({h for v in current["verdicts"] if drains_machine(v["kind"], v["scope"])
                                   for h in _named_hosts(v)})
    seen = {_key(v) for v in current["verdicts"]}
    for v in verdicts:
        if _key(v) in seen:
            continue
        seen.add(_key(v))
        current["verdicts"].append(v)
        if v["scope"] in (IncidentScope.RANK.value, IncidentScope.MACHINE.value):
            current["hosts"] = sorted(set(current["hosts"]) | _named_hosts(v))
            current["ranks"] = sorted(set(current["ranks"]) | set(v["ranks"]))
            if drains_machine(v["kind"], v["scope"]):
                current["drain"] = sorted(set(current["drain"]) | _named_hosts(v))
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    atomic_write(path, json.dumps(current, indent=1, sort_keys=True).encode())
    return current


class ExclusionsError(ValueError):
    """The hosts-to-exclude file holds something SCOUT did not write: it is left as it is, and not merged into."""


def _read_exclusions(path: str) -> dict[str, Any]:
    """The file's content, checked field by field; an empty or missing file is a fresh one. Anything else that is
    not the file's shape raises :class:`ExclusionsError` naming it: a scheduler drains what it lists, so SCOUT
    neither guesses at a foreign file nor overwrites it."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raw = b""
    except OSError as exc:
        raise ExclusionsError(f"{path}: cannot read the hosts-to-exclude file ({exc})") from None
    if not raw.strip():
        return {"hosts": [], "ranks": [], "verdicts": []}
    try:
        current = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ExclusionsError(f"{path}: not a hosts-to-exclude file (not JSON: {exc})") from None

    problem = ""
    if not isinstance(current, dict):
        problem = f"a JSON object was expected, not {type(current).__name__}"
    elif not all(list_of(str)(current.get(k, [])) for k in ("hosts", "drain")) \
            or not list_of(int)(current.get("ranks", [])) or not list_of(dict)(current.get("verdicts", [])):
        problem = "hosts, drain, ranks and verdicts must be lists of host names, ranks and verdicts"
    else:
        for v in current.get("verdicts", []):
            if not (isinstance(v.get("kind"), str) and isinstance(v.get("scope"), str) and list_of(int)(v.get("ranks"))
                    and list_of(str)(v.get("hosts")) and isinstance(v.get("surface", ""), str)
                    and (v.get("step") is None or (isinstance(v["step"], int) and not isinstance(v["step"], bool)))):
                problem = f"a verdict without kind, scope, ranks, hosts, step and surface: {json.dumps(v)[:80]}"
                break
    if problem:
        raise ExclusionsError(f"{path}: not a hosts-to-exclude file ({problem}); it is left as it is")
    for k in ("hosts", "ranks", "verdicts"):
        current.setdefault(k, [])
    return current


def _named_hosts(v: dict[str, Any]) -> set[str]:
    """The machines a verdict summary names (not an unknown one)."""
    return {h for h in v["hosts"] if h and h != "?"}


def _key(v: dict[str, Any]) -> tuple[Any, ...]:
    return (v["kind"], v["scope"], tuple(v["ranks"]), v.get("step"), v.get("surface", ""))


def verdict_summary(inc: Incident) -> dict[str, Any]:
    return {"kind": inc.kind.value, "scope": inc.scope.value, "ranks": list(inc.ranks), "hosts": list(inc.hosts),
            "step": inc.step, "surface": inc.surface[:200], "reason": inc.reason}


def hang_action(path: str | None, user_callback: Callable[[Incident], None] | None) -> Callable[[Incident], None]:
    """The observer-side action for hang verdicts (runs in the observer process, once per verdict): the user's
    callback, then the hosts file at ``path`` (:func:`exclude_hosts_path`). Stopping the trainer is the
    observer's own step after it (``ObserverSpec.stop_on_verdict``)."""

    def act(inc: Incident) -> None:
        if user_callback is not None:
            user_callback(inc)
        if inc.kind in _ACTIONABLE_KINDS and path is not None:
            record_exclusions(path, [verdict_summary(inc)])  # every observer may write: merged, deduplicated

    return act


def stop_message(summaries: Iterable[dict[str, Any]], *, how: str, records: str | None) -> str:
    """One paragraph for the launcher's summary: what SCOUT found, where, and how it ended the trainer."""
    found = []
    for v in summaries:
        ranks = ", ".join(map(str, v.get("ranks") or [])) or "none"
        hosts = sorted({h for h in v.get("hosts") or [] if h and h != "?"})
        where = f"rank{'s' if len(v.get('ranks') or []) > 1 else ''} {ranks}" + (
            f" (machine {', '.join(hosts)})" if hosts else "")
        step = v.get("step")
        # A stall's record counts the steps its ranks finished; the stall is in the next one (the step being run).
        at = "" if step is None else f" in step {step + 1}" if v.get("kind") in STALL_KINDS else f" at step {step}"
        kind = _PLAIN_KINDS.get(v.get("kind"), v.get("kind"))
        found.append(f"{kind} on {where}{at}: {v.get('reason') or ''}".strip().rstrip(":"))
    text = f"SCOUT stopped this job ({how}) on its verdict: " + "; ".join(found or ["(no summary)"])
    where = f"; the incident records are in {records} (`scout report {records}`)" if records else ""
    return text + where + ". Other ranks that ended at the same time were stopped by SCOUT, not failing."


def write_launcher_error(message: str, path: str | None = None) -> bool:
    """Write ``message`` as torchelastic's error file for this process (``$TORCHELASTIC_ERROR_FILE``), in the
    format of its own ``@record`` handler; False where no launcher asked for one or the write failed (never
    raises: the stop goes on either way)."""
    path = path if path is not None else os.environ.get(LAUNCHER_ERROR_FILE_ENV)
    if not path:
        return False
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.scout-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        return False
    return True
