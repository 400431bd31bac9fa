"""The ``scout`` command: incident tables, hosts to drain, named fault-injection cells, the MoE shape catalog."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def _read_records(paths: Sequence[str], command: str) -> tuple[list, int] | None:
    """Every readable record of ``paths`` and how many bad lines were skipped (each named on stderr with its
    file and line), or None after saying on stderr which file cannot be read."""
    from scout_core.report import read_incidents

    bad = [0]

    def truncated(message: str) -> None:
        print(f"scout {command}: warning: {message}", file=sys.stderr)

    def skipped(message: str) -> None:  # RecordError names the file and line
        bad[0] += 1
        print(f"scout {command}: {message}; the line was skipped", file=sys.stderr)

    incidents = []
    for path in paths:
        try:
            incidents += read_incidents(path, on_truncated=truncated, on_bad=skipped)
        except FileNotFoundError:
            print(f"scout {command}: {path}: no such file", file=sys.stderr)
            return None
        except (OSError, ValueError) as exc:
            print(f"scout {command}: {path}: {exc}", file=sys.stderr)
            return None
    return incidents, bad[0]


def _cmd_report(args: argparse.Namespace) -> int:
    import shutil

    from scout_core.report import format_table
    from scout_core.run_log import read_run_log, run_log_path, run_summary

    runs = read_run_log(run_log_path(args.path))
    if runs and not os.path.exists(args.path):  # a run that found nothing writes no incident record
        print(run_summary(runs, incidents=0))
        return 0
    read = _read_records([args.path], "report")
    if read is None:
        if not os.path.exists(args.path):
            print(f"scout report: no start record in {run_log_path(args.path)} either: no SCOUT run wrote its "
                  "records here (report.jsonl_path)", file=sys.stderr)
        return 2
    incidents, bad = read
    if args.kind:
        incidents = [i for i in incidents if i.kind.value in args.kind]
    if args.html:
        return _write_html(args, incidents) or (1 if bad else 0)
    width = None if args.wide else shutil.get_terminal_size((160, 24)).columns
    print(format_table(incidents, width=width, group=not args.every))
    if runs:
        print("\n" + run_summary(runs, incidents=len(incidents)))
    return 1 if bad else 0


def _write_html(args: argparse.Namespace, incidents: list) -> int:
    import json
    import os

    from scout_core.report_html import render_html

    path = args.decisions or os.path.join(os.path.dirname(os.path.abspath(args.path)), "decisions.jsonl")
    decisions = []
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, start=1):
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    print(f"scout report: warning: {path}:{number}: not a decision record, skipped", file=sys.stderr)
                    continue
                if isinstance(record, dict):
                    decisions.append(record)
    elif args.decisions:
        print(f"scout report: {path}: no such file", file=sys.stderr)
        return 2
    page = render_html(incidents, decisions=decisions, source=os.path.abspath(args.path))
    tmp = f"{args.html}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(page)
        os.replace(tmp, args.html)
    except OSError as exc:
        print(f"scout report: cannot write {args.html}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.html} ({len(incidents)} records, {len(decisions)} decisions)")
    return 0


def _cmd_hosts_to_exclude(args: argparse.Namespace) -> int:
    from scout_core.report import hosts_to_exclude

    read = _read_records(args.paths, "hosts-to-exclude")
    if read is None:
        return 2
    incidents, bad = read
    for host in hosts_to_exclude(incidents):  # the machines the readable records name, even past a bad line
        print(host)
    return 1 if bad else 0


PLUGIN_GROUP = "scout.plugins"
"""The entry-point group framework plugins register in (each names an object with ``name``, ``framework``,
``framework_version``, ``supported`` and ``how``)."""


def _cmd_plugins(_args: argparse.Namespace) -> int:
    """Each installed plugin: its framework's version against the range it is tested with, and how to turn it on.
    A plugin whose framework is missing or outside its range is listed with why (exit status 1)."""
    from importlib import metadata

    found = sorted(metadata.entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name)
    if not found:
        print(f"no SCOUT plugins installed (entry-point group {PLUGIN_GROUP}); scout_core.enable() works without")
        return 0
    failed = 0
    for ep in found:
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - a plugin's version gate or a missing framework: reported
            failed += 1
            print(f"{ep.name}: unusable: {type(exc).__name__}: {exc}")
            continue
        print(f"{ep.name}: {plugin.framework} {plugin.framework_version} (tested: {plugin.supported})\n"
              f"  {plugin.how}")
    return 1 if failed else 0


def _cmd_ctl(args: argparse.Namespace) -> int:
    from scout_core.control import ControlError, send_command, wait_applied

    key = value = ""
    if args.op == "set":
        if len(args.assignment) != 1 or "=" not in args.assignment[0]:
            print("scout ctl: set takes one KEY=VALUE", file=sys.stderr)
            return 2
        key, value = args.assignment[0].split("=", 1)
    elif args.assignment:
        print(f"scout ctl: {args.op} takes no KEY=VALUE", file=sys.stderr)
        return 2
    try:
        command = send_command(args.run, args.op, key, value, directory=args.dir or "")
    except (ControlError, OSError) as exc:
        print(f"scout ctl: {exc}", file=sys.stderr)
        return 2
    print(f"sent {command['op']} {key}{'=' + value if key else ''} (id {command['id']}); every rank applies it at "
          "the next control boundary")
    if args.wait:
        answer = wait_applied(args.run, command["id"], timeout_s=args.wait, directory=args.dir or "")
        if answer is None:
            print(f"scout ctl: no answer within {args.wait:g}s (is the job running and stepping?)", file=sys.stderr)
            return 1
        print(f"{answer['status']} at step {answer['step']}" + (f": {answer['reason']}" if answer["reason"] else ""))
        return 0 if answer["status"] == "applied" else 1
    return 0


def _progress_bar(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr, redrawn at most once per percent."""
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct != last[0] or done == total:
            last[0] = pct
            bar = "#" * (pct // 4)
            print(f"\r{label} [{bar:<25}] {pct:3d}% {done}/{total}", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)

    return show


def _cmd_catalog_build(args: argparse.Namespace) -> int:
    import torch

    from scout_core.moe.catalog import (
        CudaPathProfiler,
        KernelOpProfiler,
        MoESpec,
        ReferencePathProfiler,
        build_catalog,
        import_kernel,
    )

    try:
        spec = MoESpec(layers=tuple(args.layers), hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                       ep_size=args.ep_size, capacity=args.capacity, experts_per_kernel=args.experts_per_kernel)
        if args.profiler == "ops":
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            profiler = KernelOpProfiler(import_kernel(args.kernel), kernel_name=args.kernel, device=device,
                                        dtype=args.dtype)
        elif args.kernel:
            raise ValueError("--kernel names the code that --profiler ops profiles")
        else:
            profiler = CudaPathProfiler() if args.profiler == "cuda" else ReferencePathProfiler()
    except (ValueError, RuntimeError, ImportError, AttributeError) as exc:  # AttributeError: --kernel's name
        print(f"scout catalog build: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda") if args.profiler == "cuda" else getattr(profiler, "device", torch.device("cpu"))
    catalog = build_catalog(spec, profiler, device=device, progress=_progress_bar("profiling shapes"))
    catalog.save(args.out)
    print(f"{args.out}: {catalog.admitted} admitted shapes, {catalog.selected} representatives "
          f"({len(catalog.entries)} kernel groups)")
    return 0


def _add_catalog_parser(sub: Any) -> None:
    """``scout catalog build``."""
    cat = sub.add_parser("catalog", help="the offline MoE shape catalog")
    cat_sub = cat.add_subparsers(dest="catalog_command", required=True)
    build = cat_sub.add_parser("build", help="enumerate, profile and compress the experts' input shapes")
    build.add_argument("--out", required=True, help="catalog file to write (JSON, versioned)")
    build.add_argument("--layers", nargs="+", default=["layers.0.moe"], help="MoE layer module names")
    build.add_argument("--hidden", type=int, default=128)
    build.add_argument("--ffn", type=int, default=128)
    build.add_argument("--experts", type=int, default=8, help="experts per layer over all EP positions")
    build.add_argument("--ep-size", type=int, default=4)
    build.add_argument("--capacity", type=int, default=128, help="most rows one expert receives")
    build.add_argument("--experts-per-kernel", type=int, default=1)
    build.add_argument("--profiler", choices=["reference", "cuda", "ops"], default="reference")  # ops: --kernel
    build.add_argument("--kernel", help="with --profiler ops: package.module:function, your expert MLP as "
                                        "kernel(x, up, down) (imported): the operators it runs are profiled")
    build.add_argument("--device", help="with --profiler ops: where to run it (cuda where there is one)")
    build.add_argument("--dtype", default="bfloat16", help="with --profiler ops: float32, bfloat16 or float16")
    build.set_defaults(func=_cmd_catalog_build)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scout", description="SCOUT failure localization tools")
    sub = parser.add_subparsers(dest="command", required=True)

    rep = sub.add_parser("report", help="print incident records from a JSON-lines file as a table")
    rep.add_argument("path")
    rep.add_argument("--kind", action="append", help="only incidents of this kind (repeatable)")
    rep.add_argument("--every", action="store_true",
                     help="one row per record (default: repeated records of one fault on one rank are one row)")
    rep.add_argument("--wide", action="store_true", help="never clip long surfaces and reasons")
    rep.add_argument("--html", metavar="OUT",
                     help="write one self-contained page instead: timeline, per-rank timings, certification")
    rep.add_argument("--decisions", metavar="FILE",
                     help="retrieval decisions for the page (default: decisions.jsonl beside PATH, if any)")
    rep.set_defaults(func=_cmd_report)

    hosts = sub.add_parser(
        "hosts-to-exclude",
        help="print the machines a scheduler should drain (SDC, machine-scoped stragglers), one per line")
    hosts.add_argument("paths", nargs="+", help="incident JSON-lines files (report.jsonl_path)")
    hosts.set_defaults(func=_cmd_hosts_to_exclude)

    plugins = sub.add_parser("plugins", help="the installed framework plugins, their framework versions, how to "
                                             "turn each on")
    plugins.set_defaults(func=_cmd_plugins)
    from scout_core.tryout import add_try_parser

    add_try_parser(sub, PLUGIN_GROUP)

    ctl = sub.add_parser("ctl", help="steer a running job: pause, resume, or set a live key (docs/control.md)")
    ctl.add_argument("run", help="the run id (report.run_id), or the path of its control folder")
    ctl.add_argument("op", choices=["pause", "resume", "set"])
    ctl.add_argument("assignment", nargs="*", help="KEY=VALUE for set")
    ctl.add_argument("--dir", help="control.directory of the job (default: $XDG_RUNTIME_DIR/scout or ~/.scout/runs)")
    ctl.add_argument("--wait", type=float, default=0.0, metavar="S",
                     help="wait up to S seconds for the job's answer (applied at step N, or refused and why)")
    ctl.set_defaults(func=_cmd_ctl)

    from scout_core.testing.cells_cli import add_cells_parser

    add_cells_parser(sub)
    _add_catalog_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if argv[:1] == ["try"] and "--" in argv:  # what follows is the plugin's try-out options, passed as they are
        argv, passed = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser().parse_args(argv)
    args.passed = passed
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
