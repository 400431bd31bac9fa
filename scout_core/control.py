"""Runtime control of a running job (``scout ctl RUN pause|resume|set KEY=VALUE``): no restart, every rank at the
same step boundary, only the job's owner.

At ``enable()`` rank 0 makes the run's control folder, ``<control.directory>/<run_id>`` (owner-only, 0700), with
a per-run secret in an owner-only file (0600). ``scout ctl`` reads the secret (which only the owner can) and drops
one command file into ``commands/``. Every ``control.every_steps`` steps, at the step boundary, rank 0 reads the
folder and one world broadcast of one number tells every rank whether commands follow; if so they are broadcast
and every rank applies them right there, at the same step. Rank 0 answers each command in ``applied.jsonl``
(applied at step N, or refused and why). A command with a wrong secret, a key that cannot change live or a value
the configuration refuses is refused on every rank alike.

Pause stops the in-situ replay checks (and with them certification and snapshots) until resume; hang
detection, which costs the trainer nothing, keeps running. Live keys are those the running components read at
each check: the replay cadences, the statistical thresholds, what a verdict does, the log level.
"""

from __future__ import annotations

import contextlib
import copy
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scout_core.private_dir import private_dir

__all__ = ["LIVE_KEYS", "ControlError", "RunControl", "check_live", "control_root", "safe_run_id", "send_command",
           "wait_applied"]

LIVE_KEYS = (
    "replay.cadence.embedding", "replay.cadence.hidden", "replay.cadence.output", "replay.cadence.optimizer",
    "replay.cadence.expert", "consensus.kappa", "consensus.min_ratio", "consensus.min_delta_s",
    "consensus.comm_min_ratio", "consensus.comm_min_delta_s", "consensus.mad_floor_fraction",
    "actions.on_verdict", "report.log_level",
)
"""Keys a running job can change: read afresh at every check or verdict. Every other key shapes state built at
``enable()`` (groups, hooks, buffers, files) and needs a restart."""

OPS = ("pause", "resume", "set")
MAX_COMMANDS = 64
"""Commands read at one boundary (more wait for the next)."""
MAX_COMMAND_BYTES = 4096

_log = logging.getLogger("scout")


class ControlError(ValueError):
    """A command that cannot be sent: no such run, not the owner, a key that cannot change live, a bad value."""


_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def safe_run_id(run_id: str) -> str:
    """``run_id`` if it can name a folder under the control root (no separator, no ``..``), else ControlError."""
    if not _RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise ControlError(f"run id {run_id!r} cannot name a control folder: letters, digits, '.', '_' and '-' only")
    return run_id


def control_root(directory: str = "") -> Path:
    """Where runs' control folders live: ``control.directory``, else ``$XDG_RUNTIME_DIR/scout`` (a per-user
    folder on most Linux machines), else ``~/.scout/runs``."""
    if directory:
        return Path(directory)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "scout" if runtime else Path.home() / ".scout" / "runs"


def _run_folder(run: str, directory: str = "") -> Path:
    """``run`` is a run id (under the control root) or the path of a run's control folder."""
    return Path(run) if os.sep in run or run.startswith(".") else control_root(directory) / safe_run_id(run)


def check_live(key: str, value: str, config: Any | None = None) -> Any:
    """The typed value of ``key=value`` if the key can change live and the configuration accepts it (against
    ``config`` when given: a running job's own, with its cross-field rules), else :class:`ControlError`."""
    from scout_core.config import ConfigError, ScoutConfig, load, validate

    if "${" in value:  # an interpolation would resolve differently on each rank (${oc.env:LOCAL_RANK})
        raise ControlError(f"{key}={value}: a live value is a literal, not an interpolation")
    if key not in LIVE_KEYS:
        raise ControlError(f"{key} cannot change in a running job (it shapes what enable() built); live keys: "
                           f"{', '.join(LIVE_KEYS)}")
    try:
        typed = load(None, [f"{key}={value}"])
    except ConfigError as exc:
        raise ControlError(str(exc)) from None
    section, _, leaf = key.rpartition(".")
    new = resolve(typed, section)
    value_typed = getattr(new, leaf)
    if config is not None:
        trial = copy.deepcopy(config)
        setattr(resolve(trial, section), leaf, value_typed)
        try:
            validate(trial)
        except ConfigError as exc:
            raise ControlError(f"{key}={value}: {exc}") from None
    assert isinstance(typed, ScoutConfig)
    return value_typed


def resolve(obj: Any, dotted: str) -> Any:
    """The section ``dotted`` (``replay.cadence``) of a configuration object."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def send_command(run: str, op: str, key: str = "", value: str = "", *, directory: str = "") -> dict[str, Any]:
    """Drop one command into the run's folder (atomically); returns it. Raises :class:`ControlError`."""
    if op not in OPS:
        raise ControlError(f"unknown command {op!r}; allowed: {', '.join(OPS)}")
    folder = _run_folder(run, directory)
    if not folder.is_dir():
        raise ControlError(f"no running job {run!r} (no control folder {folder})")
    try:
        secret = (folder / "secret").read_text().strip()
    except PermissionError:
        raise ControlError(f"{folder}/secret is not readable: only the job's owner can steer it") from None
    except FileNotFoundError:
        raise ControlError(f"{folder} holds no secret: not a running SCOUT job") from None
    if op == "set":
        check_live(key, value)
    command = {"id": uuid.uuid4().hex[:12], "op": op, "key": key, "value": value, "secret": secret,
               "time_unix": time.time()}
    commands = folder / "commands"
    tmp = commands / f".{command['id']}.tmp"
    tmp.write_text(json.dumps(command))
    os.replace(tmp, commands / f"{time.time_ns()}-{command['id']}.json")
    return {k: v for k, v in command.items() if k != "secret"}


def wait_applied(run: str, command_id: str, *, timeout_s: float, directory: str = "") -> dict[str, Any] | None:
    """The job's answer to one command (``applied.jsonl``), or None after ``timeout_s``."""
    path = _run_folder(run, directory) / "applied.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines: list[str] = []
        with contextlib.suppress(OSError):  # not there yet, or not a readable file: asked again
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError, RecursionError):
                answer = json.loads(line)
                if isinstance(answer, dict) and answer.get("id") == command_id:
                    return answer
        time.sleep(0.2)
    return None


class RunControl:
    """The job side, one per rank; rank 0 owns the folder."""

    def __init__(self, cfg: Any, *, run_id: str, rank: int, world_control: Any) -> None:
        self.every = cfg.control.every_steps
        self.rank = rank
        self.world_control = world_control
        self.folder = control_root(cfg.control.directory) / safe_run_id(run_id)
        self.paused = False
        self.steps = 0  # boundaries seen: the same on every rank, whatever else SCOUT runs
        self._secret = ""
        if rank == 0:
            self._make_folder(run_id)

    def _make_folder(self, run_id: str) -> None:
        """The folder, owner-only, made fresh (a restart under the same run id starts clean: commands left for
        the previous job are not this one's); nothing in it is followed through a link."""
        try:  # the root first: once it is this user's and owner-only, nobody else can swap the folder below
            private_dir(str(self.folder.parent), "control.directory")
            if os.path.lexists(self.folder):
                private_dir(str(self.folder), "control.directory")  # a link or another user's folder: refused
        except OSError as e:  # UnsafeFolderError, or a level this user may not even look at
            raise ControlError(f"control.directory: {e}") from None
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(mode=0o700)
        (self.folder / "commands").mkdir(mode=0o700)
        self._secret = secrets.token_hex(16)
        fd = os.open(self.folder / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self._secret + "\n")
        (self.folder / "run.json").write_text(json.dumps(
            {"run_id": run_id, "pid": os.getpid(), "every_steps": self.every, "live_keys": list(LIVE_KEYS)}))

    def tick(self) -> bool:
        """Count a step boundary; True where this one looks for commands (the same boundary on every rank)."""
        self.steps += 1
        return self.every > 0 and self.steps % self.every == 0

    def exchange(self) -> list[dict[str, Any]]:
        """Rank 0's pending commands, on every rank (one broadcast of a count, then the commands if any)."""
        import torch
        import torch.distributed as dist

        from scout_core.wire import broadcast_data

        pending: list[dict[str, Any]] = []
        if self.rank == 0:
            try:  # rank 0 alone reads the folder: nothing it finds there may keep it from the broadcast
                pending = self._read()
            except Exception as exc:  # noqa: BLE001
                pending = [{"id": "?", "op": "?", "bad": f"the control folder could not be read: {exc}"}]
        count = torch.tensor([len(pending)], dtype=torch.int64)
        dist.broadcast(count, src=0, group=self.world_control)
        if int(count.item()) == 0:
            return []
        return list(broadcast_data(pending, 0, self.world_control, what="control commands"))

    def _read(self) -> list[dict[str, Any]]:
        out = []
        folder = self.folder / "commands"
        for entry in sorted(folder.glob("*.json"))[:MAX_COMMANDS]:
            try:
                if entry.is_symlink() or not entry.is_file() or entry.stat().st_size > MAX_COMMAND_BYTES:
                    raise ValueError("not a command file")
                command = json.loads(entry.read_text(encoding="utf-8"))
                if not isinstance(command, dict):
                    raise ValueError("not a command file")
                command = {k: str(command.get(k, ""))[:256] for k in ("id", "op", "key", "value", "secret")}
                if not hmac.compare_digest(command.pop("secret").encode(), self._secret.encode()):
                    command["bad"] = "wrong secret: only the job's owner can steer it"
            except Exception:  # noqa: BLE001 - any file at all is answered, never raised on rank 0 alone
                command = {"id": entry.stem[:64], "op": "?", "bad": "not a command file"}
            with contextlib.suppress(OSError):
                entry.unlink() if not entry.is_dir() else shutil.rmtree(entry)
            out.append(command)
        return out

    def answer(self, command: Mapping[str, Any], step: int, status: str, reason: str = "") -> None:
        """Rank 0 records what became of a command (``scout ctl --wait`` reads it)."""
        if self.rank != 0:
            return
        line = {"id": command.get("id"), "op": command.get("op"), "key": command.get("key", ""),
                "value": command.get("value", ""), "step": step, "status": status, "reason": reason,
                "time_unix": time.time()}
        try:
            with open(self.folder / "applied.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")
        except OSError as exc:  # the command was applied all the same; the answer is best effort
            _log.warning("SCOUT control: answer to %s not written: %s", command.get("id"), exc)

    def close(self) -> None:
        """The job is over: its folder (and secret) go with it."""
        if self.rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)
