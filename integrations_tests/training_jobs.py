"""What the framework cells (TorchTitan, Megatron) share: run a real training job on forked ranks and judge it.

A cell builds its ranks' arguments; :func:`run_job` launches them, waits for a hang verdict where one is expected,
and checks the outcome (finished, stopped by SCOUT with its exit status, or hung and diagnosed), the incident
records against the cell's ``expect``, and that replay checks ran and none was skipped. :func:`bitwise_problems`
runs the same job again without SCOUT and compares the final states bit for bit; :func:`cell_report` makes the
cell's report.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from integrations_tests.expect import record_problems
from integrations_tests.hang_cells import _RecordsSettled
from scout_core.report import read_incidents
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.launcher import LaunchResult, RankContext, launch

__all__ = ["JobRun", "bitwise_problems", "cell_report", "loop_problems", "restart_problems", "run_job"]

STOP_STATUS = 75
"""SCOUT's default exit status for ``actions.on_verdict: stop``."""


@dataclass
class JobRun:
    """One launch of a cell's job and what it got wrong."""

    result: LaunchResult
    incidents: list[Any]
    problems: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    started: float = 0.0


def quiet_renamed_collectives() -> None:
    """Megatron-Core and DeepSpeed call ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, names torch 2.13
    deprecates (FutureWarning, once per call site and rank: a wall of them in a 16-rank cell); the calls work."""
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor). is deprecated",
                            category=FutureWarning)


def run_job(rank: Callable[[RankContext], Any], spec: CellSpec, world_size: int, workdir: str,
            args: dict[str, Any], *, hang: bool = False, stop: bool = False) -> JobRun:
    """Launch the job, then judge it: ``hang``, it must hang and be diagnosed (the ranks are stopped once the
    records settle); ``stop``, every rank must end with SCOUT's stop status; else every rank must finish, with
    replay checks run and none skipped (each rank returns ``{"checks": [(step, recipes, skipped), ...]}``)."""
    started = time.monotonic()
    jsonl = os.path.join(workdir, "incidents.jsonl")
    settled = _RecordsSettled(jsonl, settle_s=1.5) if hang else None
    result = launch(rank, world_size, timeout_s=spec.timeout_s, args=args, stop_when=settled,
                    failure_grace_s=spec.timeout_s if hang else 10.0, keep_groups=hang)
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    problems: list[str] = []
    if hang and not result.stopped:
        problems.append("the job was expected to hang and be diagnosed, but: " + (result.failures() or "it finished"))
    elif stop:
        codes = sorted({o.exitcode for o in result.outcomes})
        if codes != [STOP_STATUS]:
            problems.append(f"the job should stop with status {STOP_STATUS} on every rank, got {codes}: "
                            f"{result.failures()}")
    elif not hang and not result.ok:
        problems.append(result.failures())
    problems += record_problems(incidents, spec.params.get("expect", {}))
    metrics: dict[str, float] = {}
    if result.ok and not hang:
        checks = result.values()[0]["checks"]
        if not checks or any(c[2] for c in checks):
            problems.append(f"replay checks {checks}: expected some, none skipped")
        metrics["checks"] = float(len(checks))
    return JobRun(result, incidents, problems, metrics, started)


def bitwise_problems(rank: Callable[[RankContext], Any], spec: CellSpec, world_size: int, args: dict[str, Any],
                     run: JobRun) -> list[str]:
    """Harmless: the same job without SCOUT (``scout: None``, no faults) ends in the same state, bit for bit
    (each rank returns ``{"final": signature}``): replay, its unshards and its hooks never touch training's
    numbers."""
    plain = launch(rank, world_size, timeout_s=spec.timeout_s,
                   args={**args, "scout": None, "faults": [], "phase": "plain"}, failure_grace_s=10.0)
    if not plain.ok:
        return [f"the run without SCOUT failed: {plain.failures()}"]
    if [v["final"] for v in plain.values()] != [v["final"] for v in run.result.values()]:
        differ = [r for r, (x, y) in enumerate(zip(plain.values(), run.result.values())) if x["final"] != y["final"]]
        return [f"training with SCOUT ended in another state than without it on ranks {differ}"]
    return []


def _labels(folder: str) -> dict[str, Any]:
    from scout_core.checkpoint.durable import LABELS_FILE

    with open(os.path.join(folder, LABELS_FILE)) as fh:
        return json.load(fh)


def restart_problems(rank: Callable[[RankContext], Any], spec: CellSpec, world_size: int, workdir: str,
                     args: dict[str, Any], *, folder: str, unit: str, prefix: str, counted: str) -> list[str]:
    """The restart of a recovery cell over a framework's own checkpoints in ``folder``: the labels the stopped run
    left (``labels`` in the cell's params), then the framework must load the ``restart_step`` SCOUT chose (bitwise
    the state the first run saved there: each rank of the first run wrote ``sigs-a-r<rank>.json``, and each rank of
    the restart returns ``loaded: [step, *signature]``), with the newer ones set aside (``set_aside``: their
    folders are named ``<prefix><step>``), and train on to the end (``counted``: the step count each rank returns)
    without a report, its own saves labelled ``labels_after_restart``. ``unit`` names a step in messages."""
    p = spec.params
    problems = []
    labels = {int(k): v["label"] for k, v in _labels(folder)["checkpoints"].items()}
    if labels != {int(k): v for k, v in p["labels"].items()}:
        problems.append(f"labels after the stop {labels}, expected {p['labels']}")
    first = os.path.join(workdir, "incidents.jsonl")
    os.replace(first, os.path.join(workdir, "incidents-first-run.jsonl"))
    result = launch(rank, world_size, timeout_s=spec.timeout_s, args={**args, "faults": [], "phase": "b"},
                    failure_grace_s=10.0)
    if not result.ok:
        return problems + [f"the restart failed: {result.failures()}"]
    want = int(p["restart_step"])
    for r, value in enumerate(result.values()):
        with open(os.path.join(workdir, f"sigs-a-r{r}.json")) as fh:
            saved = json.load(fh).get(str(want))
        if value["loaded"] != [want, *(saved or [])]:
            problems.append(f"rank {r} loaded {unit} {value['loaded'][:1]} (bitwise the first run's {unit} {want}: "
                            f"{value['loaded'][1:] == saved}), expected {unit} {want} bitwise")
        if value[counted] != args["steps"]:
            problems.append(f"rank {r} trained to {unit} {value[counted]}, expected {args['steps']}")
    again = list(read_incidents(first)) if os.path.exists(first) else []
    if again:
        problems.append(f"the restart reported {[(i.kind.value, i.ranks, i.step) for i in again]}, expected nothing")
    body = _labels(folder)
    after = {int(k): v["label"] for k, v in body["checkpoints"].items()}
    if after != {int(k): v for k, v in p["labels_after_restart"].items()}:
        problems.append(f"labels after the restarted run {after}, expected {p['labels_after_restart']}")
    # A set-aside checkpoint is named <its name>-<time>-<pid> (scout_core.checkpoint.durable.set_aside); a
    # framework's tracker file set aside with them (Lightning's last.ckpt) names no step.
    found = [re.match(rf"{re.escape(prefix)}(\d+)\D", os.path.basename(x)) for x in body.get("set_aside", [])]
    aside = sorted(int(m.group(1)) for m in found if m)
    if aside != sorted(p["set_aside"]):
        problems.append(f"set aside {body.get('set_aside')}, expected the {unit}s {p['set_aside']}")
    return problems


def loop_problems(rank: Callable[[RankContext], Any], spec: CellSpec, world_size: int, workdir: str,
                  args: dict[str, Any], run: JobRun, *, hang: bool, recovery: bool, folder: str,
                  prefix: str) -> None:
    """What a cell of a framework's own training loop (the HF Trainer, Accelerate, Lightning) checks after its run,
    into ``run.problems``: every rank trained ``args["steps"]`` steps, the model was FSDP2 exactly where the cell
    asked (each rank returns ``fsdp2``), then ``bitwise_without_scout`` and, for ``recovery``, the restart over the
    framework's checkpoints in ``folder`` (:func:`restart_problems`, files named ``<prefix><step>``)."""
    values = run.result.values()
    if run.result.ok and not hang and any(v["steps"] != args["steps"] for v in values):
        run.problems.append(f"trained {[v['steps'] for v in values]} steps, expected {args['steps']}")
    if run.result.ok and not hang and any(v["fsdp2"] != args["fsdp"] for v in values):
        run.problems.append(f"FSDP2 asked: {args['fsdp']}; the trained model was FSDP2 on "
                            f"{[v['fsdp2'] for v in values]}")
    if spec.params.get("bitwise_without_scout") and run.result.ok and not run.problems:
        run.problems += bitwise_problems(rank, spec, world_size, args, run)
    if recovery and not run.problems:
        run.problems += restart_problems(rank, spec, world_size, workdir, args, folder=folder, unit="step",
                                         prefix=prefix, counted="steps")


def cell_report(spec: CellSpec, world_size: int, run: JobRun, *, hang: bool = False) -> CellReport:
    return CellReport(name=spec.name, verdict="FAIL" if run.problems else "PASS", world_size=world_size,
                      injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in run.incidents],
                      details="\n".join(run.problems), wall_s=time.monotonic() - run.started, metrics=run.metrics,
                      time_to_verdict_s=max((i.time_to_verdict_s or 0.0 for i in run.incidents), default=None)
                      if hang else None)
