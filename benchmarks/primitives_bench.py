"""Micro-benchmarks of the core's pure parts: signature throughput, peer-group formation, C3 rules.

Each figure is a ratio against a baseline measured in the same process on the same data, or a time with
its goal beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from scout_core.consensus import exact, statistical
from scout_core.signature import fold, sign_many, signature
from scout_core.topology import GroupTiming, axis_groups, localize_slow_groups, peer_groups


def best(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed warm-up call."""
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
    # The baseline is a float32 sum over the same number of bytes for every dtype: a bf16 or fp64 sum is slower
    # per byte and would flatter the ratio; the fold reads bytes, whatever their dtype.
    base = torch.randn(mib * 2**20 // 4, device=device)
    t_sum = best(lambda: torch.sum(base), repeats, sync)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        numel = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
        x = torch.randn(numel, device=device).to(dtype)
        t_fold = best(lambda x=x: fold(x), repeats, sync)
        t_sig = best(lambda x=x: signature(x), repeats, sync)
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
    t_many = best(lambda: sign_many(small), repeats, sync)
    per_surface_us = round(t_many / len(small) * 1e6, 1)
    rows.append({"dtype": "float32", "surfaces": len(small), "sign_many_us_per_surface": per_surface_us})
    return rows


def bench_topology(repeats: int) -> dict:
    shape = {"d": 1250, "t": 8, "p": 10}  # 100,000 ranks
    world = 1250 * 8 * 10
    t_peer = best(lambda: peer_groups(shape), repeats, lambda: None)
    fig_order = ("t", "d", "s", "p", "c", "e")
    big = {"t": 8, "d": 1250, "s": 10}
    t_axes = best(lambda: (axis_groups(big, "s", fig_order), axis_groups(big, "t", fig_order)), repeats, lambda: None)
    fsdp = axis_groups(big, "s", fig_order)
    tp = axis_groups(big, "t", fig_order)
    host_of = {r: f"node{i}" for i, g in enumerate(tp) for r in g}
    culprit = 4242
    obs = [GroupTiming("fsdp", g, culprit in g) for g in fsdp] + [GroupTiming("tp", g, culprit in g) for g in tp]
    t_loc = best(lambda: localize_slow_groups(obs, host_of), repeats, lambda: None)
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
        out[f"exact_n{n}_us"] = round(best(lambda sigs=sigs: exact(sigs), repeats, lambda: None) * 1e6, 1)
        t_stat = best(lambda times=times: statistical(times), repeats, lambda: None)
        out[f"statistical_n{n}_us"] = round(t_stat * 1e6, 1)
    return out
