"""What certified snapshots cost: training-thread blocking, restore and persist times, step time and memory.

The A/B runs the product path (``enable()``) with snapshots on and off in alternating 2-rank jobs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
from primitives_bench import best


def bench_checkpoint(repeats: int) -> dict:
    """Training-thread blocking of background snapshots as a ratio of step time; restore times."""

    from scout_core.checkpoint.snapshot import SnapshotEngine, restore_state
    from scout_core.checkpoint.store import DurableStore

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(64, 1024)

    def step():
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()

    def blocking_ratio(cadence: int, steps: int) -> float:
        engine = SnapshotEngine([model], [opt], get_extra=lambda: {"tokens": 0})
        start = time.perf_counter()
        for i in range(steps):
            step()
            if i % cadence == 0:
                engine.capture(i)
        engine.result()
        ratio = engine.blocking_s / (time.perf_counter() - start)
        engine.close()
        return ratio

    steps = 20 * max(1, repeats // 3)
    blocking_every = blocking_ratio(1, steps)
    blocking_cadence = blocking_ratio(20, 3 * steps)
    engine = SnapshotEngine([model], [opt], get_extra=lambda: {"tokens": 0})
    engine.capture(0)
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # params + 2 Adam moments
    snap = engine.result()
    fresh = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    t_mem = best(lambda: restore_state([fresh], [fresh_opt], snap), 3, lambda: None)
    root = tempfile.mkdtemp()
    store = DurableStore(root, 0, 1)
    t_write = best(lambda: store.write(1, snap), 3, lambda: None)
    t_disk = best(lambda: restore_state([fresh], [fresh_opt], store.load(1)), 3, lambda: None)
    engine.close()
    return {"state_mb": round(state_bytes / 2**20, 1), "steps": steps,
            "blocking_ratio_capture_every_step": round(blocking_every, 5),
            "blocking_ratio_at_cadence_20": round(blocking_cadence, 6), "goal_ratio": 0.01,
            "restore_from_memory_s": round(t_mem, 4), "persist_write_s": round(t_write, 4),
            "restore_from_disk_s": round(t_disk, 4)}


def _snapshot_rank(ctx: Any) -> dict:
    """One rank of the snapshot A/B: the product path (enable) with certified snapshots on or off, at the
    shipped settings (slots in the default RAM-backed folder, the shipped cadence and coverage rule)."""
    import scout_core
    from scout_core.config import load
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx)
    a = ctx.args
    torch.manual_seed(0)
    inner = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(8)])
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(64, 512)
    overrides = ["observer.enabled=false", "report.log_level=ERROR", "replay.cadence.embedding=0",
                 "replay.cadence.output=0", f"checkpoint.enabled={a['snapshots']}",
                 f"checkpoint.directory={a['dir']}"]
    handle = scout_core.enable(model, opt, config=load(None, overrides), layers=list(inner))  # 8 blocks
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + AdamW moments
    times, peak_rss, shm, durable = [], 0, 0, 0
    base_rss = _rss_bytes()
    for _ in range(a["steps"]):
        start = time.perf_counter()
        model(data).square().mean().backward()
        opt.step()  # replay (cadence 20) and, in B, certification, capture and background persistence
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        peak_rss = max(peak_rss, _rss_bytes() - base_rss)
    if handle.checkpoint is not None:
        handle.flush()
        durable = len(handle.checkpoint.store.local_generations())  # a row that claims a durable write shows one
        torch.distributed.barrier()  # every rank's slots written before counting the machine's folder
        memory = handle.checkpoint.memory  # the machine's folder: every local rank's slots
        shm = sum(os.path.getsize(os.path.join(memory.dir, n)) for n in memory.slots()) / memory.local_ranks
        torch.distributed.barrier()  # counted before any rank discards its slots
    handle.close(discard_snapshots=True)
    return {"step_s": sum(times[5:]) / len(times[5:]), "state_bytes": state_bytes, "rss_delta": peak_rss,
            "shm_bytes": shm, "durable_generations": durable}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_snapshot_ab(repeats: int, steps: int = 720) -> dict:
    """Step time with certified snapshots (capture, replica exchange, durable write: background included)
    against the same job without them, both through enable() with replay at the default cadence, and two jobs
    without them against each other (A/A: what separate jobs differ by anyway); plus the host memory
    snapshots take per rank, as a multiple of the rank's state. ``steps`` spans a coverage cycle, so each B
    job makes a durable write (counted)."""
    from scout_core.testing.launcher import launch

    ratios, noise, rss, shm, durable = [], [], [], [], []
    for rep in range(max(1, repeats)):
        runs = {}
        arms = (("a", False), ("b", True), ("a2", False))
        for arm, snapshots in (arms if rep % 2 == 0 else arms[::-1]):  # order alternates so drift hits both
            with tempfile.TemporaryDirectory() as d:
                res = launch(_snapshot_rank, 2, timeout_s=600,
                             args={"snapshots": snapshots, "steps": steps, "dir": d})
                if not res.ok:
                    raise RuntimeError(res.failures())
                runs[arm] = max(res.values(), key=lambda v: v["step_s"])  # the job runs at its slowest rank's pace
        ratios.append(runs["b"]["step_s"] / runs["a"]["step_s"] - 1.0)
        noise.append(runs["a2"]["step_s"] / runs["a"]["step_s"] - 1.0)
        rss.append((runs["b"]["rss_delta"] - runs["a"]["rss_delta"]) / runs["b"]["state_bytes"])
        shm.append(runs["b"]["shm_bytes"] / runs["b"]["state_bytes"])
        durable.append(runs["b"]["durable_generations"])
    return {"state_mb": round(runs["b"]["state_bytes"] / 2**20, 1), "steps": steps, "cadence": 20,
            "repeats": len(ratios), "plain_step_ms": round(runs["a"]["step_s"] * 1e3, 2),
            "overhead_median": round(statistics.median(ratios), 4), "overhead_min": round(min(ratios), 4),
            "overhead_max": round(max(ratios), 4), "aa_median": round(statistics.median(noise), 4),
            "aa_range": [round(min(noise), 4), round(max(noise), 4)], "goal_overhead": 0.01,
            "durable_generations_min": min(durable), "goal_peak_over_state": 3.0, "goal_at_rest_over_state": 2.0,
            "rss_peak_over_state": round(max(rss), 2), "shm_at_rest_over_state": round(max(shm), 2)}
