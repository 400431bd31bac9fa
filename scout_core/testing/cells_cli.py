"""The ``scout cells`` commands: list the named fault-injection cells, run some, or run the fault matrix."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["add_cells_parser"]


def _load_specs(args: argparse.Namespace):
    from scout_core.testing.cells import find_cells_file, load_cells

    path = Path(args.cells) if args.cells else find_cells_file()
    return path, load_cells(path)


def _cmd_cells_list(args: argparse.Namespace) -> int:
    path, specs = _load_specs(args)
    width = max((len(n) for n in specs), default=4)
    for name, spec in specs.items():
        tags = ",".join(spec.tags) or "-"
        print(f"{name:<{width}}  ranks={spec.world_size:<3} tags={tags:<16} {spec.description[:90]}")
    return 0


def _cmd_cells_run(args: argparse.Namespace) -> int:
    from scout_core.testing.cells import format_cell_table, write_json

    path, specs = _load_specs(args)
    if args.all:
        names = list(specs)
    elif args.tag:
        names = [n for n, s in specs.items() if set(args.tag) & set(s.tags)]
    else:
        names = list(dict.fromkeys(args.names))  # a cell named twice runs once (its folder is its name)
    if not names:
        print("scout cells run: name at least one cell, or use --all / --tag", file=sys.stderr)
        return 2
    unknown = [n for n in names if n not in specs]
    if unknown:
        print(f"scout cells run: unknown cells {unknown}; see `scout cells list`", file=sys.stderr)
        return 2
    if args.world is not None and args.world < 1:
        print("scout cells run: --world must be >= 1", file=sys.stderr)
        return 2

    reports = _run_with_progress(path, [specs[n] for n in names], world_size=args.world, workdir=args.workdir,
                                 show_output=args.show_output, lanes=args.lanes)
    print()
    print(format_cell_table(reports))
    if args.json:
        write_json(reports, args.json)
        print(f"\nwrote {args.json}")
    failed = [r.name for r in reports if r.verdict != "PASS"]
    print(f"\ncells: {len(reports) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _console() -> TextIO:
    """Where progress lines go while a cell's output is captured: a copy of stdout's file descriptor (fd 1 itself
    then points at the cell's log), or stdout as it is where it has no descriptor of its own (a test's capture)."""
    try:
        return os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return sys.stdout


def _run_with_progress(path: Path, specs: Sequence, *, show_output: bool = False, **kwargs) -> list:
    """Run cells, one line per cell as it finishes (``[i/n]``, verdict, wall time), failures with details and the
    last lines the cell printed; the cells' own output goes to each cell's ``output.log`` unless ``show_output``."""
    import time

    from scout_core.testing import launcher
    from scout_core.testing.cells import run_cells

    console = sys.stdout if show_output else _console()
    done = [0]
    running: list = [None, 0.0]  # the cell in progress and when it started

    def start(spec) -> None:
        running[:] = [spec.name, time.monotonic()]

    def progress(report) -> None:
        running[0] = None
        done[0] += 1
        print(f"[{done[0]}/{len(specs)}] {report.verdict} {report.name} ({report.world_size} ranks, "
              f"{report.wall_s:.1f}s)", file=console, flush=True)
        if report.verdict != "PASS" and report.details:
            print("    " + report.details.replace("\n", "\n    "), file=console, flush=True)

    def still_running() -> None:  # a cell may run for minutes: say it is still going
        if running[0] is not None:
            print(f"    ... {running[0]} running for {time.monotonic() - running[1]:.0f}s", file=console, flush=True)

    launcher.heartbeat = still_running
    try:
        return run_cells(specs, root=path.parent.parent, on_result=progress, on_start=start,
                         capture_output=not show_output, **kwargs)
    finally:
        launcher.heartbeat = None
        if console is not sys.stdout:
            console.close()


def _cmd_cells_matrix(args: argparse.Namespace) -> int:
    from scout_core.testing.cells import write_json
    from scout_core.testing.matrix import matrix_plot, matrix_summary, slowest_cells

    path, specs = _load_specs(args)
    placed = [n for n, s in specs.items() if s.matrix is not None]
    names = list(dict.fromkeys(args.names)) or placed
    unknown = [n for n in names if n not in specs]
    outside = [n for n in names if n in specs and specs[n].matrix is None]
    if unknown or outside:
        print(f"scout cells matrix: {'unknown cells ' + str(unknown) if unknown else ''}"
              f"{'; ' if unknown and outside else ''}{'not in the matrix ' + str(outside) if outside else ''}; "
              "see `scout cells list`", file=sys.stderr)
        return 2
    reports = _run_with_progress(path, [specs[n] for n in names], workdir=args.workdir,
                                 show_output=args.show_output, lanes=args.lanes)
    out = Path(args.out)
    write_json(reports, out / "matrix.json")
    summary = matrix_summary(specs, reports)
    (out / "matrix.md").write_text(summary)
    print()
    print(summary)
    print(slowest_cells(reports))
    try:
        matrix_plot(specs, reports, out / "matrix.png")
        print(f"wrote {out / 'matrix.json'}, {out / 'matrix.md'}, {out / 'matrix.png'}")
    except RuntimeError as exc:  # no matplotlib: the JSON and the summary stand
        print(f"wrote {out / 'matrix.json'}, {out / 'matrix.md'}; no plot: {exc}", file=sys.stderr)
    return 0 if all(r.verdict == "PASS" for r in reports) else 1


def _lanes(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: >= 1")
    return value


def _add_lanes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lanes", type=_lanes, default=1, metavar="N",
                        help="run the cells tagged `waits` (hangs and stalls: they mostly sleep) N at a time, side "
                             "by side, before the others, which run one at a time (default 1: all one at a time)")


def add_cells_parser(sub: Any) -> None:
    """``scout cells list|run|matrix`` under the ``scout`` command's subparsers ``sub``."""
    cells = sub.add_parser("cells", help="multi-rank fault-injection cells")
    cells_sub = cells.add_subparsers(dest="cells_command", required=True)
    for name in ("list", "run"):
        p = cells_sub.add_parser(name)
        p.add_argument("--cells", help="path to cells.yaml (default: configs/cells.yaml at or above cwd)")
        if name == "run":
            p.add_argument("names", nargs="*", help="cell names")
            p.add_argument("--all", action="store_true", help="run every cell")
            p.add_argument("--tag", action="append", help="run cells with this tag (repeatable)")
            p.add_argument("--world", type=int, default=None, help="override each cell's world size")
            p.add_argument("--json", help="write results as JSON to this path")
            p.add_argument("--workdir", help="keep each cell's incident records and output.log in WORKDIR/<cell>")
            p.add_argument("--show-output", action="store_true",
                           help="let the ranks print to the terminal (default: to each cell's output.log)")
            _add_lanes_argument(p)
            p.set_defaults(func=_cmd_cells_run)
        else:
            p.set_defaults(func=_cmd_cells_list)
    mat = cells_sub.add_parser("matrix", help="the fault matrix: every 16-rank cell by layout and fault class")
    mat.add_argument("names", nargs="*", help="only these cells (default: every cell with a matrix place)")
    mat.add_argument("--cells", help="path to cells.yaml (default: configs/cells.yaml at or above cwd)")
    mat.add_argument("--out", default="runs", help="writes OUT/matrix.json, OUT/matrix.md, OUT/matrix.png")
    mat.add_argument("--workdir", help="keep each cell's incident records and output.log in WORKDIR/<cell>")
    mat.add_argument("--show-output", action="store_true",
                     help="let the ranks print to the terminal (default: to each cell's output.log)")
    _add_lanes_argument(mat)
    mat.set_defaults(func=_cmd_cells_matrix)
