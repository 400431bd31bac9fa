"""Hang-path benchmarks on real jobs: step overhead under real DDP and FSDP2, and stall-to-verdict time.

* **Overhead.** Two-rank gloo jobs train the same model three ways, interleaved
  (plain, ``scout_core.enable()`` with only the observer on, and plain under
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, PyTorch's built-in collective checker);
  each job reports its median step time, and each repeat's ratio is taken
  against the plain job of the same repeat.
* **Stall to verdict.** Two-rank DDP jobs whose healthy steps take 0.1 s, 1 s
  and 10 s run with the shipped observer defaults; after the warm-up and two
  more steps rank 1 stops. The figure is the time from the stop to the record.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch

from scout_core.launcher import RankContext, init_gloo, launch
from scout_core.report import read_incidents

ARMS = ("plain", "scout", "detail")


def _model(layout: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(8))
    inner = torch.nn.Sequential(*blocks)
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(inner), inner
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block)
    fully_shard(inner)
    return inner, inner


def _overhead_job(ctx: RankContext) -> float:
    a = ctx.args
    if a["arm"] == "detail":
        import torch.distributed as dist

        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    init_gloo(ctx)
    model, inner = _model(a["layout"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handle = None
    if a["arm"] == "scout":
        import scout_core
        from scout_core.config import load

        cfg = load(None, ["replay.enabled=false", "report.log_level=ERROR"])  # the hang path alone
        handle = scout_core.enable(model, opt, config=cfg, layers=list(inner))
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(ctx.rank))
    times = []
    for step in range(a["warmup"] + a["steps"]):
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step >= a["warmup"]:
            times.append(time.perf_counter() - start)
    if handle is not None:
        handle.close()
    return statistics.median(times)


def bench_real_overhead(repeats: int = 5, steps: int = 40) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": repeats, "steps_per_job": steps, "world_size": 2, "goal_ratio": 0.005}
    for layout in ("ddp", "fsdp2"):
        ratios: dict[str, list[float]] = {"scout": [], "detail": []}
        failures: dict[str, str] = {}
        plain_ms = []
        for rep in range(repeats):
            order = ARMS[rep % 3:] + ARMS[: rep % 3]  # rotate which arm runs first
            step_s = {}
            for arm in order:
                if arm in failures:
                    continue
                result = launch(_overhead_job, 2, timeout_s=600,
                                args={"arm": arm, "layout": layout, "warmup": 8, "steps": steps})
                if not result.ok:
                    if arm == "plain":
                        raise RuntimeError(result.failures())
                    # Recorded, not raised: TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on gloo (SIGSEGV).
                    failures[arm] = result.failures().splitlines()[0]
                    continue
                step_s[arm] = max(result.values())  # the job runs at its slowest rank's pace
            plain_ms.append(step_s["plain"] * 1e3)
            for arm in ("scout", "detail"):
                if arm in step_s:
                    ratios[arm].append(step_s[arm] / step_s["plain"] - 1)
        out[layout] = {"plain_step_ms": round(statistics.median(plain_ms), 2), "failed": failures}
        for arm, r in ratios.items():
            if r:
                out[layout][f"{arm}_overhead_median"] = round(statistics.median(r), 4)
                out[layout][f"{arm}_overhead_range"] = [round(min(r), 4), round(max(r), 4)]
    return out


def _stall_job(ctx: RankContext) -> None:
    import scout_core
    from scout_core.config import load

    a = ctx.args
    init_gloo(ctx, timeout_s=600)
    model, inner = _model("ddp")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = load(None, ["replay.enabled=false", f"report.jsonl_path={a['jsonl']}", "report.log_level=ERROR",
                      "report.run_id=stall"])  # shipped observer defaults
    scout_core.enable(model, opt, config=cfg, layers=list(inner))
    x = torch.randn(4, 512)
    for step in range(1000):
        if step == a["stall_step"] and ctx.rank == 1:
            with open(a["marker"], "w") as fh:
                fh.write(repr(time.time()))
            while True:
                time.sleep(3600)  # the training thread stops; the process lives
        model(x).square().mean().backward()
        time.sleep(a["step_s"])  # the rest of a healthy step of step_s seconds
        opt.step()
        opt.zero_grad()


def bench_stall_to_verdict(step_seconds: tuple[float, ...] = (0.1, 1.0, 10.0)) -> dict[str, Any]:
    rows = []
    for step_s in step_seconds:
        with tempfile.TemporaryDirectory() as tmp:
            jsonl, marker = os.path.join(tmp, "incidents.jsonl"), os.path.join(tmp, "stalled")
            seen: dict[str, float] = {}

            def verdict(jsonl: str = jsonl, seen: dict[str, float] = seen) -> bool:
                if os.path.exists(jsonl) and list(read_incidents(jsonl)):
                    seen.setdefault("t", time.time())
                    return True
                return False

            launch(_stall_job, 3, timeout_s=300 + 10 * step_s, stop_when=verdict, poll_s=0.05,
                   args={"step_s": step_s, "stall_step": 4, "jsonl": jsonl, "marker": marker})
            incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
            with open(marker) as fh:
                t_stall = float(fh.read())
            rows.append({"step_s": step_s, "stall_to_verdict_s": round(seen["t"] - t_stall, 2) if "t" in seen else None,
                         "threshold_s": incidents[0].evidence.get("threshold_s") if incidents else None,
                         "verdict": [(i.kind.value, i.ranks, i.evidence.get("class")) for i in incidents]})
    return {"rows": rows, "goal_s_for_1s_steps": 10.0}
