"""Named multi-rank fault-injection cells: definitions, runner and verdicts.

A cell is declared in ``configs/cells.yaml``::

    cells:
      ddp-sdc-weight:
        target: integrations_tests.replay_cells:replay_cell
        world_size: 16
        timeout_s: 120
        tags: [fast]
        faults:
          - {surface: layers.1.weight, rank: 9, kind: set, value: 0.5, index: 7, from_step: 3}
        params: {...}

``target`` is a function ``(spec: CellSpec, world_size: int, workdir: str) ->
CellReport`` that launches the ranks, injects the faults through
:class:`scout_core.testing.inject.Injector` and compares what SCOUT reported with what
was injected. The runner adds the repository root (the parent of the
``configs`` directory) to ``sys.path`` so targets in ``integrations_tests``
import without being installed; scout_core itself never imports them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scout_core.report import ranks_text
from scout_core.testing.inject import Fault

__all__ = ["MATRIX_FAULTS", "MATRIX_LAYOUTS", "CellReport", "CellSpec", "MatrixPlace", "find_cells_file", "load_cells",
           "run_cells", "format_cell_table"]


@dataclass(frozen=True, kw_only=True)
class CellSpec:
    name: str
    target: str
    world_size: int = 16
    timeout_s: float = 120.0
    tags: tuple[str, ...] = ()
    description: str = ""
    faults: tuple[Fault, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    matrix: MatrixPlace | None = None
    """Where the cell sits in the fault matrix (``nox -s matrix``): every 16-rank cell has a place."""


MATRIX_LAYOUTS = ("ddp", "fsdp2", "hsdp", "moe", "titan", "megatron", "deepspeed", "hf", "lightning")
"""Columns of the matrix: the four parallel layouts and the plugins' real frameworks (every cell a training job
through ``enable()`` or a plugin)."""
MATRIX_FAULTS = ("clean", "sdc", "compute_straggler", "comm_straggler", "hang", "input_stall", "checkpoint_stall",
                 "recovery", "scout_failure")
"""Rows of the matrix: the fault classes (``scout_failure``: SCOUT's own failure, isolated and skipped)."""


@dataclass(frozen=True)
class MatrixPlace:
    layout: str
    fault: str


def _matrix_place(path: Any, name: str, raw: Any) -> MatrixPlace | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"layout", "fault"}:
        raise ValueError(f"{path}: cell {name!r}: matrix must be {{layout: ..., fault: ...}}, got {raw!r}")
    if raw["layout"] not in MATRIX_LAYOUTS or raw["fault"] not in MATRIX_FAULTS:
        raise ValueError(f"{path}: cell {name!r}: matrix {raw!r}; layouts {MATRIX_LAYOUTS}, faults {MATRIX_FAULTS}")
    return MatrixPlace(raw["layout"], raw["fault"])


@dataclass(kw_only=True)
class CellReport:
    """Outcome of one cell, in the shape written by ``--json``."""

    name: str
    verdict: str  # "PASS" or "FAIL"
    world_size: int
    injected: list[dict[str, Any]]
    reported: list[dict[str, Any]]
    wall_s: float = 0.0
    details: str = ""
    time_to_verdict_s: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """Measured facts worth keeping (e.g. observer start-up), never pass/fail criteria."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_cells_file(start: str | os.PathLike[str] | None = None) -> Path:
    """Locate ``configs/cells.yaml`` from ``start`` (default: cwd) upward."""
    here = Path(start or os.getcwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / "configs" / "cells.yaml"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no configs/cells.yaml at or above {here}; pass --cells PATH")


def load_cells(path: str | os.PathLike[str]) -> dict[str, CellSpec]:
    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh) or {}
    entries = raw.get("cells")
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: expected a top-level 'cells' mapping")
    allowed = {"target", "world_size", "timeout_s", "tags", "description", "faults", "params", "seed", "matrix"}
    specs = {}
    for name, entry in entries.items():
        unknown = set(entry) - allowed
        if unknown:
            raise ValueError(f"{path}: cell {name!r} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        if "target" not in entry or ":" not in entry["target"]:
            raise ValueError(f"{path}: cell {name!r} needs target 'module:function'")
        specs[name] = CellSpec(
            name=name,
            target=entry["target"],
            world_size=int(entry.get("world_size", 16)),
            timeout_s=float(entry.get("timeout_s", 120.0)),
            tags=tuple(entry.get("tags", ())),
            description=str(entry.get("description", "")).strip(),
            faults=tuple(Fault.from_dict(f) for f in entry.get("faults", ()) or ()),
            params=dict(entry.get("params", {}) or {}),
            seed=int(entry.get("seed", 0)),
            matrix=_matrix_place(path, name, entry.get("matrix")),
        )
    return specs


def _resolve(target: str, root: Path) -> Callable[..., CellReport]:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module_name, func_name = target.split(":", 1)
    return getattr(importlib.import_module(module_name), func_name)


def run_cells(
    specs: Sequence[CellSpec],
    *,
    root: str | os.PathLike[str],
    world_size: int | None = None,
    on_result: Callable[[CellReport], None] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    on_start: Callable[[CellSpec], None] | None = None,
    capture_output: bool = False,
    lanes: int = 1,
) -> list[CellReport]:
    """Run cells one after another; a crashing cell is a FAIL, not an abort. The reports come in the specs' order.

    With ``workdir`` each cell's files (its incident JSON lines) are kept in
    ``workdir/<cell name>``; otherwise they live in a temporary directory.
    With ``capture_output`` everything the cell's processes print (the frameworks' banners and warnings, SCOUT's
    log lines) goes to ``output.log`` in that directory instead of the terminal, and a failed cell's details end
    with the last lines of it: a run of many cells then prints one line per cell.
    With ``lanes`` above 1 the cells tagged ``waits`` (:data:`~scout_core.testing.lanes.WAITS_TAG`) run first,
    that many at a time in processes forked from this one, and the others after them, one at a time.
    """
    from scout_core.testing.lanes import WAITS_TAG, run_in_lanes
    from scout_core.testing.launcher import prepare_parent

    prepare_parent()

    def run_one(spec: CellSpec) -> CellReport:
        if on_start:
            on_start(spec)
        return _run_cell(spec, world_size or spec.world_size, Path(root), workdir, capture_output)

    def failed(spec: CellSpec, details: str) -> CellReport:
        return _failed(spec, world_size or spec.world_size, details)

    waiting = [i for i, spec in enumerate(specs) if lanes > 1 and WAITS_TAG in spec.tags]
    in_lanes = run_in_lanes([specs[i] for i in waiting], lanes, run_one, to_dict=CellReport.to_dict,
                            from_dict=lambda d: CellReport(**d), failed=failed, on_result=on_result)
    reports = dict(zip(waiting, in_lanes))
    for i, spec in enumerate(specs):
        if i not in reports:
            reports[i] = run_one(spec)
            if on_result:
                on_result(reports[i])
    return [reports[i] for i in range(len(specs))]


def _run_cell(spec: CellSpec, n: int, root: Path, workdir: str | os.PathLike[str] | None,
              capture_output: bool) -> CellReport:
    start = time.monotonic()
    with _cell_dir(spec.name, workdir) as cell_dir:
        log = Path(cell_dir) / OUTPUT_LOG
        out_of_world = sorted({f.rank for f in spec.faults if f.rank >= n})
        try:
            if out_of_world:
                report = _failed(spec, n, f"cell {spec.name!r} injects on ranks {out_of_world} but runs {n} ranks")
            else:
                with _output_to(log) if capture_output else contextlib.nullcontext():
                    report = _resolve(spec.target, root)(spec, n, cell_dir)
        except Exception:
            report = _failed(spec, n, traceback.format_exc())
        report.wall_s = round(time.monotonic() - start, 3)
        problem = reporting_problem(spec, report)
        if report.verdict == "PASS" and problem:
            report.verdict, report.details = "FAIL", problem
        if capture_output and report.verdict != "PASS" and log.exists():
            kept = f" ({log})" if workdir is not None else ""
            report.details = (f"{report.details}\n--- last lines the cell printed{kept} ---\n"
                              f"{_tail(log, OUTPUT_TAIL_LINES)}")
    return report


def _failed(spec: CellSpec, world_size: int, details: str) -> CellReport:
    """The report of a cell that did not run to its own verdict (it raised, or its lane died)."""
    return CellReport(name=spec.name, verdict="FAIL", world_size=world_size, injected=fault_dicts(spec.faults),
                      reported=[], details=details)


def reporting_problem(spec: CellSpec, report: CellReport) -> str | None:
    """The rule every cell is held to beside its own expectations: a cell that injects a fault (or lists the
    records it expects) must report something, and a clean cell nothing at all."""
    expect = spec.params.get("expect")
    if spec.faults or (isinstance(expect, list) and expect):
        return None if report.reported else "a faulty cell must report something; it reported nothing"
    return None if not report.reported else f"a clean cell must report nothing; it reported {report.reported[:3]}"


OUTPUT_LOG = "output.log"
"""Where a cell's processes print when :func:`run_cells` captures their output (in the cell's directory)."""
OUTPUT_TAIL_LINES = 40


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Point this process's stdout and stderr at ``path`` for the duration: file descriptors 1 and 2, which the
    ranks forked meanwhile and any process they start inherit. ``sys.stdout`` / ``sys.stderr`` normally write
    through them and stay as they are: a framework imported during the cell keeps a handler on them (DeepSpeed's
    logger does), and it must still write, to the next cell's log, once this one's file is closed. Only a stream
    that bypasses the descriptor (a caller's own capture, as pytest's) is swapped for the cell's duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved: list[int] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        saved += [os.dup(1), os.dup(2)]
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        with contextlib.ExitStack() as stack:
            bypassing = [name for name, number in (("stdout", 1), ("stderr", 2))
                         if _descriptor(getattr(sys, name)) != number]
            if bypassing:
                log = stack.enter_context(open(os.dup(fd), "w", buffering=1))
                for name in bypassing:
                    stack.enter_context(getattr(contextlib, f"redirect_{name}")(log))
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for number, copy in enumerate(saved, start=1):
            os.dup2(copy, number)
        for f in (fd, *saved):
            os.close(f)


def _descriptor(stream: Any) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _tail(path: Path, lines: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(f.tell() - lines * 1024, 0))  # the lines wanted (up to 1 KiB each), never a whole long log
        return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")


@contextlib.contextmanager
def _cell_dir(name: str, workdir: str | os.PathLike[str] | None) -> Iterator[str]:
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix=f"scout-{name}-") as tmp:
            yield tmp
        return
    path = Path(workdir) / name
    if path.exists():
        shutil.rmtree(path)  # a rerun must not mix old incident records with new ones
    path.mkdir(parents=True)
    yield str(path)


def _fault_dict(fault: Fault) -> dict[str, Any]:
    d = asdict(fault)
    d["kind"] = fault.kind.value
    return d


def fault_dicts(faults: Sequence[Fault]) -> list[dict[str, Any]]:
    return [_fault_dict(f) for f in faults]


def _reported_text(reported: Sequence[dict[str, Any]]) -> str:
    """What a cell reported, one entry per (kind, scope, ranks) with how often and its first surface."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for i in reported:
        if i["kind"] == "decision":
            key: tuple[Any, ...] = ("decision", i["scope"], str(i.get("surface")))
        else:
            key = (i["kind"], i["scope"], tuple(i["ranks"]), tuple(i.get("hosts") or ()) if i["scope"] == "machine"
                   else ())
        groups.setdefault(key, []).append(i)
    parts = []
    for key, items in groups.items():
        first = items[0]
        if key[0] == "decision":
            parts.append(f"restore {first['scope']} gen {first['surface']}")
            continue
        text = f"{first['kind']}/{first['scope']} r{ranks_text(first['ranks'])}"
        if key[3]:
            text += " " + ",".join(dict.fromkeys(key[3]))
        if len(items) > 1:
            text += f" x{len(items)}"
        surface = (first.get("surface") or "").split(";")[0]
        if surface:
            text += f" {surface[:40]}"
        parts.append(text)
    return "; ".join(parts) or "nothing"


def _injected_text(injected: Sequence[dict[str, Any]]) -> str:
    """What a cell injected, one entry per (kind, surface) with the ranks it hit: ``kill@r8-15:step.start``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for f in injected:
        groups.setdefault((f["kind"], f["surface"]), []).append(f["rank"])
    return "; ".join(f"{kind}@r{ranks_text(ranks)}:{surface}" for (kind, surface), ranks in groups.items()) or "nothing"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_cell_table(reports: Sequence[CellReport], *, width: int | None = None) -> str:
    """One row per cell, at most ``width`` characters wide (default: the terminal's, else 160, as in a CI log):
    the injected and reported columns are summarised (one entry per kind and surface or scope, with the ranks)
    and share what the other columns leave, clipped (every record is in the JSON ``--json`` writes)."""
    if width is None:
        width = shutil.get_terminal_size(fallback=(160, 24)).columns
    headers = ("cell", "verdict", "ranks", "injected", "reported", "verdict_s", "wall_s")
    rows = []
    for r in reports:
        ttv = "-" if r.time_to_verdict_s is None else f"{r.time_to_verdict_s:.3f}"
        rows.append([r.name, r.verdict, str(r.world_size), _injected_text(r.injected), _reported_text(r.reported),
                     ttv, f"{r.wall_s:.1f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    inj, rep = headers.index("injected"), headers.index("reported")
    room = width - sum(w for i, w in enumerate(widths) if i not in (inj, rep)) - 2 * (len(headers) - 1)
    if widths[inj] + widths[rep] > room:  # the injected column takes up to 40 % of the room, reported the rest
        widths[inj] = max(min(widths[inj], room * 2 // 5), 12)
        widths[rep] = max(min(widths[rep], room - widths[inj]), 12)
        for row in rows:
            row[inj], row[rep] = _clip(row[inj], widths[inj]), _clip(row[rep], widths[rep])
        widths[inj] = max(len(headers[inj]), *(len(row[inj]) for row in rows))
        widths[rep] = max(len(headers[rep]), *(len(row[rep]) for row in rows))
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in rows]
    return "\n".join(line.rstrip() for line in out)


def write_json(reports: Sequence[CellReport], path: str | os.PathLike[str]) -> None:
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"cells": [r.to_dict() for r in reports]}, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
