"""SCOUT benchmarks' command line: measure every section (or some), write results.json and the tables.

    python benchmarks/run.py --out benchmarks/results.json [--readme README.md] [--docs docs/benchmarks.md]
    python benchmarks/run.py --quick      # the three headline budgets only, in a few minutes

Each figure is a ratio against a baseline measured in the same process on the same data (or a time with
its goal beside it), so a slow or busy machine moves both sides together. Each section records the commit it
was measured on (``provenance``), so sections re-measured with ``--only`` say so. Nothing here asserts; tests
never time anything. ``--readme`` rewrites the README's headline rows and, unless ``--docs`` names another
file, the full table in the docs/benchmarks.md beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scout_core import __version__  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import catalog_bench  # noqa: E402
import hang as hang_bench  # noqa: E402
import replay_bench  # noqa: E402
import replay_stages  # noqa: E402
import scale_sim  # noqa: E402
import straggler_bench  # noqa: E402
from checkpoint_bench import bench_checkpoint, bench_snapshot_ab  # noqa: E402
from hang_hooks_bench import bench_hang  # noqa: E402
from primitives_bench import bench_consensus, bench_signature, bench_topology  # noqa: E402
from tables import budget_table, headline, markdown, replace_block  # noqa: E402

DEFAULT_OUT = "benchmarks/results.json"
SECTIONS: dict[str, Callable[[Any, torch.device], Any]] = {
    "signature": lambda a, d: bench_signature(d, a.mib, a.repeats),
    "topology": lambda a, d: bench_topology(max(3, a.repeats // 2)),
    "consensus": lambda a, d: bench_consensus(a.repeats),
    "hang": lambda a, d: bench_hang(a.repeats),
    "checkpoint": lambda a, d: bench_checkpoint(a.repeats),
    "snapshot_ab": lambda a, d: bench_snapshot_ab(max(1, a.repeats // 2)),
    "replay": lambda a, d: replay_bench.bench_replay_curve(plot_path="benchmarks/replay_overhead.png"),
    # The same curve on a longer step (issue 33: where a budget cannot be met on 2 shared cores, the same code
    # on a longer step): a check's collectives cost the same milliseconds, its replayed passes scale with the step.
    "replay_long": lambda a, d: replay_bench.bench_replay_curve(intervals=(20, 100), pairs=4, width=512, batch=512),
    # Where a check's fixed cost goes: every stage timed on every rank (the isolating measurement issue 33 asks for).
    # The probe job replaces the timed collective by a barrier and three recorded runs (the spread of 1, 2, 3 runs).
    "replay_stages": lambda a, d: {**replay_stages.bench_replay_stages(),
                                   "probe": replay_stages.bench_replay_stages(periods=20, probe_runs=True)["runs"]},
    "replay_memory": lambda a, d: {**replay_bench.bench_replay_memory(), "goal_over_layer": 4.0},
    "straggler": lambda a, d: straggler_bench.bench_straggler_sensitivity(),
    "straggler_8": lambda a, d: straggler_bench.bench_straggler_sensitivity(world=8),
    # The persistence path, off as shipped, measured on: what it would name (docs/consensus.md).
    "straggler_persist": lambda a, d: straggler_bench.bench_straggler_sensitivity(rule={"persist_rounds": 3}),
    "clock_noise": lambda a, d: straggler_bench.bench_clock_noise(),
    "catalog": lambda a, d: catalog_bench.bench_catalog(),
    "hang_real": lambda a, d: hang_bench.bench_real_overhead(repeats=5),
    "stall_to_verdict": lambda a, d: hang_bench.bench_stall_to_verdict(),
    "scale": lambda a, d: scale_sim.scale_table(),
}
# The three headline budgets (issue 33) in a few minutes: fewer jobs and rounds, no DETAIL jobs, the replay curve's
# default interval only. The same measurements as the full run, with wider ranges.
QUICK: dict[str, Callable[[Any, torch.device], Any]] = {
    "hang_real": lambda a, d: hang_bench.bench_real_overhead(repeats=3, rounds=60, detail_jobs=False),
    "replay": lambda a, d: replay_bench.bench_replay_curve(intervals=(20,), pairs=4),
    "snapshot_ab": lambda a, d: bench_snapshot_ab(1, steps=480),
}
FULL_ORDER = ("signature", "topology", "consensus", "hang", "checkpoint", "snapshot_ab", "replay", "replay_long",
              "replay_stages", "replay_memory", "straggler", "straggler_8", "straggler_persist", "clock_noise",
              "catalog", "hang_real", "stall_to_verdict", "scale")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--readme", help="rewrite the headline block of this README (and, without --docs, the "
                                         "full table in docs/benchmarks.md beside it)")
    parser.add_argument("--docs", help="rewrite the full benchmark table of this file (docs/benchmarks.md)")
    parser.add_argument("--mib", type=int, default=64, help="tensor size for the fold benchmark")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS),
                        help="re-measure these sections and keep the others from --out")
    parser.add_argument("--quick", action="store_true",
                        help="measure the three headline budgets only (hang path, replay at I=20, snapshots) and "
                             "print their table; writes benchmarks/results-quick.json unless --out says otherwise")
    args = parser.parse_args(argv)
    if args.quick and (args.only or args.readme or args.docs):
        parser.error("--quick measures its own three sections and writes no tables: drop --only, --readme, --docs")
    return args


def provenance() -> dict[str, Any]:
    """What a section is measured on: the commit (and whether the tree differs from it) and when it started;
    :func:`measure` adds how long it took."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "time_unix": round(time.time())}


def measure(results: dict, sections: dict[str, Callable[[Any, torch.device], Any]], names: tuple[str, ...],
            args: Any, device: torch.device) -> None:
    """Measure ``names`` into ``results``, each with its provenance."""
    for name in names:
        prov, started = provenance(), time.perf_counter()
        results[name] = sections[name](args, device)
        results.setdefault("provenance", {})[name] = {**prov, "duration_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.only:
        with open(args.out, encoding="utf-8") as fh:
            results = json.load(fh)
        measure(results, SECTIONS, tuple(args.only), args, device)
        _write(results, args)
        return
    results = {
        "version": __version__,
        "machine": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU {platform.machine()}",
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "time_unix": time.time(),
        },
    }
    if args.quick:
        measure(results, QUICK, tuple(QUICK), args, device)
        out = args.out if args.out != DEFAULT_OUT else "benchmarks/results-quick.json"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(budget_table(results))
        return
    measure(results, SECTIONS, FULL_ORDER, args, device)
    _write(results, args)


def write_tables(results: dict, readme: str | None, docs: str | None) -> None:
    """The headline rows into the README's ``bench-headline`` block, the full table into the docs' ``bench``
    block (by default the docs/benchmarks.md beside the README)."""
    if readme:
        replace_block(Path(readme), "bench-headline", headline(results))
        docs = docs or str(Path(readme).resolve().parent / "docs" / "benchmarks.md")
    if docs:
        replace_block(Path(docs), "bench", markdown(results))


def _write(results: dict, args: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=2)
    print(budget_table(results))
    print(markdown(results))
    write_tables(results, args.readme, args.docs)


if __name__ == "__main__":
    main()
