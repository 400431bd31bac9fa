"""SCOUT benchmarks: ratios measured within one run, written as JSON.

    python benchmarks/run.py --out benchmarks/results.json [--readme README.md]

Each figure is a ratio against a baseline measured in the same process on the
same data (or a time with its goal beside it), so a slow or busy machine moves
both sides together. Nothing here asserts; tests never time anything.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scout_core import __version__  # noqa: E402
from scout_core.consensus import exact, statistical  # noqa: E402
from scout_core.signature import fold, sign_many, signature  # noqa: E402
from scout_core.topology import GroupTiming, axis_groups, localize_slow_groups, peer_groups  # noqa: E402


def _best(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_signature(device: torch.device, mib: int, repeats: int) -> list[dict]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        numel = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
        x = torch.randn(numel, device=device).to(dtype)
        t_sum = _best(lambda x=x: torch.sum(x), repeats, sync)
        t_fold = _best(lambda x=x: fold(x), repeats, sync)
        t_sig = _best(lambda x=x: signature(x), repeats, sync)
        gbps = x.numel() * x.element_size() / 1e9
        rows.append({
            "dtype": str(dtype).removeprefix("torch."),
            "bytes": x.numel() * x.element_size(),
            "sum_gb_s": round(gbps / t_sum, 2),
            "fold_gb_s": round(gbps / t_fold, 2),
            "fold_vs_sum": round(t_sum / t_fold, 3),
            "signature_vs_sum": round(t_sum / t_sig, 3),
            "goal_fold_vs_sum": 0.5,
        })
    # Many small surfaces, one transfer: cost per surface.
    small = [torch.randn(4096, device=device) for _ in range(64)]
    t_many = _best(lambda: sign_many(small), repeats, sync)
    per_surface_us = round(t_many / len(small) * 1e6, 1)
    rows.append({"dtype": "float32", "surfaces": len(small), "sign_many_us_per_surface": per_surface_us})
    return rows


def bench_topology(repeats: int) -> dict:
    shape = {"d": 1250, "t": 8, "p": 10}  # 100,000 ranks
    world = 1250 * 8 * 10
    t_peer = _best(lambda: peer_groups(shape), repeats, lambda: None)
    fig_order = ("t", "d", "s", "p", "c", "e")
    big = {"t": 8, "d": 1250, "s": 10}
    t_axes = _best(lambda: (axis_groups(big, "s", fig_order), axis_groups(big, "t", fig_order)), repeats, lambda: None)
    fsdp = axis_groups(big, "s", fig_order)
    tp = axis_groups(big, "t", fig_order)
    host_of = {r: f"node{i}" for i, g in enumerate(tp) for r in g}
    culprit = 4242
    obs = [GroupTiming("fsdp", g, culprit in g) for g in fsdp] + [GroupTiming("tp", g, culprit in g) for g in tp]
    t_loc = _best(lambda: localize_slow_groups(obs, host_of), repeats, lambda: None)
    loc = localize_slow_groups(obs, host_of)
    assert loc.ranks == (culprit,), loc  # a wrong answer would make the timing meaningless
    return {
        "world_size": world,
        "peer_groups_s": round(t_peer, 4),
        "groups": len(peer_groups(shape)),
        "fsdp_and_tp_groups_s": round(t_axes, 4),
        "intersection_s": round(t_loc, 4),
        "goal_s": 1.0,
    }


def bench_consensus(repeats: int) -> dict:
    out = {}
    for n in (16, 1024):
        sigs = [12345] * n
        sigs[n // 3] = 999
        times = [1.0 + 0.01 * (i % 7) for i in range(n)]
        out[f"exact_n{n}_us"] = round(_best(lambda sigs=sigs: exact(sigs), repeats, lambda: None) * 1e6, 1)
        t_stat = _best(lambda times=times: statistical(times), repeats, lambda: None)
        out[f"statistical_n{n}_us"] = round(t_stat * 1e6, 1)
    return out


def markdown(results: dict) -> str:
    sig = [r for r in results["signature"] if "fold_vs_sum" in r]
    many = next(r for r in results["signature"] if "surfaces" in r)
    topo = results["topology"]
    cons = results["consensus"]
    lines = [
        f"Measured on {results['machine']['device']} ({results['machine']['cpu_threads']} torch thread(s)), "
        f"torch {results['machine']['torch']}, scout-core {results['version']}.",
        "",
        "| benchmark | figure | goal |",
        "|---|---|---|",
    ]
    for r in sig:
        size = f"{r['bytes'] // 2**20} MiB {r['dtype']}"
        lines.append(f"| signature fold, {size} | {r['fold_vs_sum']}x of `torch.sum` "
                     f"({r['fold_gb_s']} vs {r['sum_gb_s']} GB/s) | >= {r['goal_fold_vs_sum']}x |")
        lines.append(f"| full signature incl. non-finite gate, {size} | {r['signature_vs_sum']}x of `torch.sum` | - |")
    world = f"{topo['world_size']:,} ranks"
    goal = f"< {topo['goal_s']:.0f} s"
    lines += [
        f"| `sign_many`, {many['surfaces']} surfaces of 16 KiB, one transfer "
        f"| {many['sign_many_us_per_surface']} us per surface | - |",
        f"| peer groups at {world} | {topo['peer_groups_s'] * 1e3:.1f} ms ({topo['groups']} groups) | {goal} |",
        f"| FSDP + TP groups at {world} | {topo['fsdp_and_tp_groups_s'] * 1e3:.1f} ms | {goal} |",
        f"| cross-group intersection at {world} | {topo['intersection_s'] * 1e3:.1f} ms | - |",
        f"| exact C3, N=16 / N=1024 | {cons['exact_n16_us']} us / {cons['exact_n1024_us']} us | - |",
        f"| statistical C3, N=16 / N=1024 | {cons['statistical_n16_us']} us / {cons['statistical_n1024_us']} us | - |",
    ]
    return "\n".join(lines)


def update_readme(path: Path, table: str) -> None:
    text = path.read_text()
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path} lacks the {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results.json")
    parser.add_argument("--readme", help="rewrite the benchmark block of this README")
    parser.add_argument("--mib", type=int, default=64, help="tensor size for the fold benchmark")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=2)
    table = markdown(results)
    print(table)
    if args.readme:
        update_readme(Path(args.readme), table)


if __name__ == "__main__":
    main()
