"""Trust labels for a framework's own durable checkpoints (TorchTitan steps, Megatron iterations, DeepSpeed
tags), and the one a restart should load.

SCOUT's certifier (:mod:`scout_core.checkpoint.certify`) decides which *generations* (steps) replay evidence
vouches for. A framework checkpoint of step ``N`` holds the state after step ``N``, so it inherits the trust of
that step:

* ``verified``: the certifier verified a generation at or after ``N`` with no SDC verdict in between (an SDC
  verdict makes every checkpoint newer than the verified generation of that moment ``rejected``, for good);
* ``candidate``: the certifier's candidate is at or after ``N`` (accepted checks, not yet a full cycle);
* ``latest``: saved, no accepted check since;
* ``rejected``: saved after the last verified generation when an SDC verdict came (it may hold the corruption,
  however perfect its checksum), or later in the same run: a job that goes on after the verdict
  (``actions.on_verdict: log``) trains on from the suspect state, so nothing it saves counts as clean until a
  restart has loaded a verified checkpoint.

A restart loads what the retrieval policy (:func:`~scout_core.checkpoint.certify.decide_retrieval`) chose for
the failure that stopped the job: after SDC, an unreachable machine, a straggler verdict or an unexplained stop,
the newest ``verified`` one (no emergency sweep can run on a framework checkpoint, and a straggler's slowness
says nothing about an SDC no check has reached yet). After a straggler or an unexplained stop with nothing
verified yet, the newest not ``rejected`` (no evidence says it is bad, and starting over would discard the
run); the reason says it is unproven. The labels live in one JSON file beside
the checkpoints, rewritten atomically (temporary file, fsync, rename, fsync of the folder) by one rank whenever
a label changes, so an operator or a scheduler can read them too.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scout_core.checkpoint.certify import Action, Certifier, FailureKind
from scout_core.checkpoint.store import fsync_dir
from scout_core.wire import broadcast_data

__all__ = ["LABELS_FILE", "SET_ASIDE", "FrameworkCheckpoints", "LoadChoice", "RejectedCheckpointError",
           "agreed_restart_plan", "point_tracker", "refuse_rejected", "rejected_message", "set_aside"]

_log = logging.getLogger("scout")

LABELS_FILE = "scout-labels.json"
"""The file of labels, in the framework's checkpoint folder."""
SET_ASIDE = "scout-set-aside"
"""Where a restart moves a framework's checkpoints newer than the one it loads (inside the checkpoint folder)."""


def set_aside(folder: str, name: str) -> str:
    """Move ``folder/name`` (a newer checkpoint a restart abandons) into ``folder/scout-set-aside/``, stamped with
    the time and this process, out of the framework's reach (a later save of the same step never lands on an
    abandoned one) but kept for forensics: SCOUT never deletes it. Returns where it went."""
    target_dir = os.path.join(folder, SET_ASIDE)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, f"{os.path.basename(name)}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(os.path.join(folder, name), target)
    for f in (target_dir, folder):
        fsync_dir(f)
    return target


def agreed_restart_plan(folder: str, plan: Callable[[], dict[str, Any] | None], *, who: str,
                        what: str) -> dict[str, Any] | None:
    """A framework's restart plan for ``folder``, made by rank 0 (``plan``: choose from the labels, move files,
    point the framework's tracker) and broadcast to every rank (every rank calls it). None: no labels, or the plan
    failed and the framework's own choice is loaded, with an error logged. After an SDC stop a plan that cannot be
    made raises on every rank: loading the framework's newest checkpoint then would restore the state the verdict
    rejected. ``who`` names the plugin and ``what`` the framework's checkpoint (``Megatron's iteration``) in
    messages."""
    import torch.distributed as dist

    made: dict[str, Any] | None = None
    if dist.get_rank() == 0:
        stopped = None
        try:
            stopped = FrameworkCheckpoints(folder, writer=False).stopped_for  # before the plan changes anything
            made = plan()
        except Exception as exc:  # noqa: BLE001 - reported below on every rank
            made = {"error": f"{type(exc).__name__}: {exc}", "fatal": stopped == "sdc"}
    made = broadcast_data(made, 0, what="checkpoint plan")
    if made is not None and "error" in made:
        if made["fatal"]:
            raise RuntimeError(f"{who}: the job stopped on an SDC verdict and the restart point ({what}) cannot be "
                               f"chosen ({made['error']}): refusing to load the newest one")
        _log.error("%s: choosing the restart point (%s) failed (%s): the framework's own choice is loaded, "
                   "unchecked by SCOUT", who, what, made["error"])
        return None
    return made


class RejectedCheckpointError(RuntimeError):
    """A restart named a checkpoint that SCOUT labelled rejected (and ``checkpoint.load_rejected`` is false)."""


def rejected_message(labels: FrameworkCheckpoints, named: Callable[[int, Mapping[str, Any]], bool], what: str, *,
                     who: str) -> str | None:
    """Why loading the checkpoint ``named(step, entry)`` picks out of ``labels`` is refused (None: it is not
    labelled rejected). Local: the caller shares the finding with every rank."""
    try:
        steps = sorted(s for s, e in labels.entries.items() if e.get("label") == "rejected" and named(s, e))
    except Exception as exc:  # noqa: BLE001 - a foreign entry: no finding (the caller's broadcast must still run)
        _log.error("%s: cannot read the labels in %s (%s): the checkpoint named is loaded unchecked", who,
                   labels.path, exc)
        return None
    if not steps:
        return None
    verified = max((s for s, e in labels.entries.items() if e.get("label") == "verified"), default=None)
    return (f"{who}: {what} is labelled rejected in {labels.path}: it was saved after the last verified state when an "
            f"SDC verdict came (step {steps[0]}), so it may hold the corruption. "
            + (f"The newest verified checkpoint is step {verified}. " if verified is not None else
               "No checkpoint there is verified. ")
            + "Restart without naming a checkpoint and SCOUT loads the one it chose, or set checkpoint.load_rejected "
              "to load this one anyway.")


def refuse_rejected(folder: str, named: Callable[[int, Mapping[str, Any]], bool], what: str, *, who: str,
                    allowed: bool) -> None:
    """Before a load that names its checkpoint (every rank calls it): raise :class:`RejectedCheckpointError` on
    every rank when SCOUT labelled that checkpoint rejected (:func:`rejected_message`). ``allowed``
    (``checkpoint.load_rejected``): a warning instead. Rank 0 reads the labels and broadcasts its finding, so a
    rank whose read fails cannot load while the others stop."""
    import torch.distributed as dist

    found: str | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        found = rejected_message(FrameworkCheckpoints(folder, writer=False), named, what, who=who)
    if dist.is_initialized():
        found = broadcast_data(found, 0, what="checkpoint check")
    if found is None:
        return
    if allowed:
        _log.warning("%s (checkpoint.load_rejected: loading it as asked)", found)
        return
    raise RejectedCheckpointError(found)


def point_tracker(folder: str, tracker: str, value: str | None) -> None:
    """Make the framework's tracker file ``folder/tracker`` (Megatron's ``latest_checkpointed_iteration.txt``,
    DeepSpeed's ``latest``) name ``value``, crash-safely (written, fsynced, then renamed into place); None: nothing
    is safe to load, and the tracker is set aside so the framework starts from its initialization."""
    path = os.path.join(folder, tracker)
    if value is None:
        if os.path.exists(path):
            os.makedirs(os.path.join(folder, SET_ASIDE), exist_ok=True)
            os.replace(path, os.path.join(folder, SET_ASIDE, f"{tracker}-{time.strftime('%Y%m%dT%H%M%S')}"))
        fsync_dir(folder)
        return
    tmp = f"{path}.scout-tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(value)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)


@dataclass(frozen=True)
class LoadChoice:
    """What a restart loads: a checkpoint ``step`` (None: none is safe, or none exists) and why."""

    step: int | None
    label: str | None
    failure: str
    reason: str


class FrameworkCheckpoints:
    """The labels of one job's framework checkpoints. Every rank keeps the same labels (they follow the
    certifier, which is identical on every rank); the rank with ``writer=True`` writes the file."""

    def __init__(self, folder: str, *, writer: bool) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LABELS_FILE)
        self.writer = writer
        self.entries: dict[int, dict[str, Any]] = {}
        self.stopped_for: str | None = None
        """The failure a verdict stopped the job for (read back by the restart)."""
        self.set_aside: list[str] = []
        """Checkpoints earlier restarts moved away (newer than what they loaded)."""
        self.ended_normally = False
        """The run that saved these ended normally (its last step done, SCOUT closed without a failure or a stop):
        its newest checkpoint not rejected is where a relaunch goes on, verified yet or not."""
        self._rejected_above: int | None = None  # after an SDC verdict: newer than this is rejected
        self._load()

    # -- the file -------------------------------------------------------------------------------------

    def _load(self) -> None:
        if not os.path.exists(self.path):
            return
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            self.entries, self.stopped_for, self.set_aside, self.ended_normally = _parse_labels(data)
        except (OSError, ValueError, RecursionError) as exc:
            # A torn or foreign file must not stop the restart: without labels nothing counts as verified.
            _log.error("SCOUT: cannot read checkpoint labels %s (%s): treating every checkpoint as unlabelled",
                       self.path, exc)
            self.entries = {}

    def _write(self) -> None:
        if not self.writer:
            return
        os.makedirs(self.folder, exist_ok=True)
        body = {"checkpoints": {str(k): v for k, v in sorted(self.entries.items())},
                "stopped_for": self.stopped_for, "set_aside": self.set_aside, "ended_normally": self.ended_normally,
                "time_unix": time.time()}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(body, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.folder)

    # -- while training -------------------------------------------------------------------------------

    def saved(self, step: int, where: str, certifier: Certifier) -> None:
        """The framework wrote its checkpoint of ``step`` (at ``where``). Step 0 is the initial state (a seed
        checkpoint, before any training step): nothing can have corrupted it, it is verified."""
        label = "verified" if int(step) == 0 else "latest"
        # A folder saved to again (a rolling tag such as DeepSpeed's ``save_checkpoint(dir, "last")``) no longer
        # holds the step it held: that step's label would vouch for state that is gone.
        same = os.path.realpath(where) if where else None
        for older in [s for s, e in self.entries.items()
                      if same and e.get("path") and os.path.realpath(e["path"]) == same and s != int(step)]:
            del self.entries[older]
        self.entries[int(step)] = {"label": label, "path": where, "saved_unix": time.time()}
        self.ended_normally = False  # the run goes on
        self._relabel(certifier)
        self._write()

    def on_boundary(self, step: int, action: Action | None, certifier: Certifier, *,
                    failure: FailureKind | None = None, stopping: bool = False) -> None:
        """After the certifier took this boundary's evidence. ``failure``: the kind of a verdict at it;
        ``stopping``: the job stops for it (the restart follows it)."""
        if action is Action.RECOVER:
            verified = certifier.verified
            self._rejected_above = -1 if verified is None else verified
        if failure is not None and stopping:
            self.stopped_for = FailureKind(failure).value
        before = {k: v["label"] for k, v in self.entries.items()}
        self._relabel(certifier)
        if before != {k: v["label"] for k, v in self.entries.items()} or (failure is not None and stopping):
            self._write()

    def reject_above(self, step: int, *, stopped_for: FailureKind | None = None) -> None:
        """A recovery verdict came before these labels existed: everything newer than ``step`` (the newest
        verified one then, -1: none) is rejected, and the restart follows ``stopped_for`` where the job stops."""
        self._rejected_above = int(step) if self._rejected_above is None else min(self._rejected_above, int(step))
        if stopped_for is not None:
            self.stopped_for = FailureKind(stopped_for).value
        for s, entry in self.entries.items():
            if s > self._rejected_above and s != 0:
                entry["label"] = "rejected"
        self._write()

    def _relabel(self, certifier: Certifier) -> None:
        """Labels only rise (latest, candidate, verified) or fall to rejected: a restarted job's certifier
        starts empty, and must not take back what the run before it verified."""
        for step, entry in self.entries.items():
            if entry["label"] == "rejected" or step == 0:
                continue  # for good: an SDC verdict found it may hold corruption; step 0 is the initial state
            if self._rejected_above is not None and step > self._rejected_above:
                entry["label"] = "rejected"
            elif certifier.verified is not None and step <= certifier.verified:
                entry["label"] = "verified"
            elif certifier.candidate is not None and step <= certifier.candidate and entry["label"] == "latest":
                entry["label"] = "candidate"

    def ended(self) -> None:
        """The run ended normally (SCOUT closed after its last step, neither failing nor stopped by a verdict):
        a relaunch goes on from its newest checkpoint not rejected (a job's last save, at the end of its iterations,
        a planned exit or a preemption's save, usually comes between two checks, unverified). That checkpoint keeps
        the mark (``ended``) through restarts: a second load of the folder, or a relaunch whose run fails before
        its first save, still finds it."""
        if self.stopped_for is None:
            self.ended_normally = True
            live = [s for s, e in self.entries.items() if e["label"] != "rejected"]
            if live:
                self.entries[max(live)]["ended"] = True
            self._write()

    # -- at restart -----------------------------------------------------------------------------------

    def choose(self, failure: FailureKind | str | None = None, *,
               exists: Callable[[int], bool] = lambda _step: True) -> LoadChoice:
        """The checkpoint a restart loads (the same on every rank that reads the same file). ``failure``
        overrides the recorded one; ``exists(step)``: the checkpoint is still there (not purged, complete)."""
        kind = FailureKind(failure or self.stopped_for or FailureKind.OTHER)
        live = {s: e for s, e in self.entries.items() if e["label"] != "rejected" and exists(s)}
        if failure is None and self.stopped_for is None and live and (self.ended_normally
                                                                      or live[max(live)].get("ended")):
            step = max(live)
            return LoadChoice(step, live[step]["label"], "none",
                              "the last run ended normally: its newest checkpoint not rejected")
        pool, wanted = {s: e for s, e in live.items() if e["label"] == "verified"}, "verified"
        reason = {FailureKind.SDC: "confirmed SDC: only a verified checkpoint is safe",
                  FailureKind.MACHINE_UNREACHABLE: "a machine is unreachable: only a verified checkpoint",
                  FailureKind.STRAGGLER: "straggler: slowness is not numerical divergence, but a newer checkpoint "
                                         "may carry an SDC no check has reached yet, and no sweep can run on a "
                                         "framework checkpoint: the newest verified one",
                  }.get(kind, "no verdict explains the stop and no sweep can run on a framework checkpoint: "
                              "the newest verified one")
        if not pool and kind in (FailureKind.STRAGGLER, FailureKind.OTHER) and live:
            # A crash, a preemption, a hang, a slow rank: no verdict says the state is bad, and none has been
            # verified yet (early in a job). Starting over would throw the run away for no evidence at all.
            pool = live
            reason = ("no SDC verdict explains the stop and nothing is verified yet: the newest checkpoint not "
                      "rejected, unproven")
        if not pool:
            return LoadChoice(None, None, kind.value, f"{reason}; no {wanted} checkpoint exists")
        step = max(pool)
        return LoadChoice(step, pool[step]["label"], kind.value, reason)

    def verified_at(self, step: int) -> int | None:
        """The newest verified checkpoint at or before ``step`` (the trust of the state restored from it)."""
        return max((s for s, e in self.entries.items() if e["label"] == "verified" and s <= step), default=None)

    def restarted_from(self, step: int | None, *, set_aside: Sequence[str] = ()) -> None:
        """The restart loaded ``step`` (None: none of these): newer checkpoints belong to the abandoned run and
        leave the labels (``set_aside``: where the caller moved them, kept in the file for the operator)."""
        dropped = sorted(s for s in self.entries if step is None or s > step)
        for s in dropped:
            del self.entries[s]
        self.stopped_for = None
        self.ended_normally = False
        self._rejected_above = None
        self.set_aside = [*self.set_aside, *set_aside]
        if dropped:
            _log.warning("SCOUT: checkpoints of steps %s are newer than the restart point and no longer labelled",
                         dropped)
        self._write()


_LABELS = ("latest", "candidate", "verified", "rejected")


def _parse_labels(data: Any) -> tuple[dict[int, dict[str, Any]], str | None, list[str], bool]:
    """The labels file's content, checked field by field (it is read at a restart, and may be torn, foreign or
    edited by hand); ValueError says what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"a labels file is a JSON object, not {type(data).__name__}")
    checkpoints = data.get("checkpoints", {})
    if not isinstance(checkpoints, dict):
        raise ValueError("checkpoints is not an object")
    entries = {}
    for key, entry in checkpoints.items():
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(entry, dict) \
                or entry.get("label") not in _LABELS or not isinstance(entry.get("path"), (str, type(None))):
            raise ValueError(f"checkpoint entry {str(key)[:20]!r} is not a step with a label and a path")
        entries[int(key)] = dict(entry)
    stopped_for = data.get("stopped_for")
    if stopped_for is not None and (not isinstance(stopped_for, str) or stopped_for not in set(FailureKind)):
        raise ValueError(f"stopped_for {str(stopped_for)[:40]!r} is not a failure kind")
    set_aside = data.get("set_aside", [])
    if not isinstance(set_aside, list):
        raise ValueError("set_aside is not a list")
    ended = data.get("ended_normally", False)
    if not isinstance(ended, bool):
        raise ValueError("ended_normally is not true or false")
    return entries, stopped_for, [str(p) for p in set_aside], ended
