"""SCOUT benchmarks' command line: measure every section (or some), write results.json and the tables.

    python benchmarks/run.py --out benchmarks/results.json [--readme README.md] [--docs docs/benchmarks.md]

Each figure is a ratio against a baseline measured in the same process on the same data (or a time with
its goal beside it), so a slow or busy machine moves both sides together. Nothing here asserts; tests
never time anything. ``--readme`` rewrites the README's headline rows and, unless ``--docs`` names another
file, the full table in the docs/benchmarks.md beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
import scale_sim  # noqa: E402
import straggler_bench  # noqa: E402
from checkpoint_bench import bench_checkpoint, bench_snapshot_ab  # noqa: E402
from hang_hooks_bench import bench_hang  # noqa: E402
from primitives_bench import bench_consensus, bench_signature, bench_topology  # noqa: E402
from tables import headline, markdown, replace_block  # noqa: E402

SECTIONS: dict[str, Callable[[Any, torch.device], Any]] = {
    "signature": lambda a, d: bench_signature(d, a.mib, a.repeats),
    "hang": lambda a, d: bench_hang(a.repeats),
    "checkpoint": lambda a, d: bench_checkpoint(a.repeats),
    "snapshot_ab": lambda a, d: bench_snapshot_ab(a.repeats),
    "replay": lambda a, d: replay_bench.bench_replay_curve(plot_path="benchmarks/replay_overhead.png"),
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


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results.json")
    parser.add_argument("--readme", help="rewrite the headline block of this README (and, without --docs, the "
                                         "full table in docs/benchmarks.md beside it)")
    parser.add_argument("--docs", help="rewrite the full benchmark table of this file (docs/benchmarks.md)")
    parser.add_argument("--mib", type=int, default=64, help="tensor size for the fold benchmark")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS),
                        help="re-measure these sections and keep the others from --out")
    return parser.parse_args(argv)


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.only:
        with open(args.out, encoding="utf-8") as fh:
            results = json.load(fh)
        for name in args.only:
            results[name] = SECTIONS[name](args, device)
        results["machine"]["time_unix"] = time.time()
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
        "signature": bench_signature(device, args.mib, args.repeats),
        "topology": bench_topology(max(3, args.repeats // 2)),
        "consensus": bench_consensus(args.repeats),
        "hang": bench_hang(args.repeats),
        "checkpoint": bench_checkpoint(args.repeats),
        "snapshot_ab": bench_snapshot_ab(args.repeats),
    }
    for name in ("replay", "replay_memory", "straggler", "straggler_8", "straggler_persist", "clock_noise", "catalog",
                 "hang_real", "stall_to_verdict", "scale"):
        results[name] = SECTIONS[name](args, device)
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
    print(markdown(results))
    write_tables(results, args.readme, args.docs)


if __name__ == "__main__":
    main()
