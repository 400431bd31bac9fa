"""The ``scout`` command: incident tables and named fault-injection cells."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _cmd_report(args: argparse.Namespace) -> int:
    from scout_core.report import format_table, read_incidents

    try:
        incidents = list(read_incidents(args.path))
    except FileNotFoundError:
        print(f"scout report: {args.path}: no such file", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"scout report: {exc}", file=sys.stderr)
        return 2
    if args.kind:
        incidents = [i for i in incidents if i.kind.value in args.kind]
    print(format_table(incidents))
    return 0


def _load_specs(args: argparse.Namespace):
    from scout_core.cells import find_cells_file, load_cells

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
    from scout_core.cells import format_cell_table, run_cells, write_json

    path, specs = _load_specs(args)
    if args.all:
        names = list(specs)
    elif args.tag:
        names = [n for n, s in specs.items() if set(args.tag) & set(s.tags)]
    else:
        names = args.names
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

    def progress(report) -> None:
        print(f"[{report.verdict}] {report.name} ({report.world_size} ranks, {report.wall_s:.1f}s)", flush=True)
        if report.verdict != "PASS" and report.details:
            print("    " + report.details.replace("\n", "\n    "), flush=True)

    reports = run_cells([specs[n] for n in names], root=path.parent.parent, world_size=args.world,
                        on_result=progress, workdir=args.workdir)
    print()
    print(format_cell_table(reports))
    if args.json:
        write_json(reports, args.json)
        print(f"\nwrote {args.json}")
    failed = [r.name for r in reports if r.verdict != "PASS"]
    print(f"\ncells: {len(reports) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scout", description="SCOUT failure localization tools")
    sub = parser.add_subparsers(dest="command", required=True)

    rep = sub.add_parser("report", help="print incident records from a JSON-lines file as a table")
    rep.add_argument("path")
    rep.add_argument("--kind", action="append", help="only incidents of this kind (repeatable)")
    rep.set_defaults(func=_cmd_report)

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
            p.add_argument("--workdir", help="keep each cell's incident records in WORKDIR/<cell>")
            p.set_defaults(func=_cmd_cells_run)
        else:
            p.set_defaults(func=_cmd_cells_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
