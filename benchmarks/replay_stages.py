"""Where a replay check's fixed cost goes: the replay bench's 16-rank DDP job, every stage of a check and every
Python collective timed on every rank, check by check.

A measurement tool, not a benchmark with a goal: it wraps the engine's methods from outside (nothing in
``scout_core`` knows it runs).

Per stage it reports, over the checks after the start-up ones that time the scratch all-reduce: the median of
the slowest rank's time and of the ranks' mean, the time spent inside collectives (waiting for the slowest peer
included), and beside them the A/B cost of each kind of check (a plain copy of the model stepped alternately with
the watched one, as in the replay bench).

    python benchmarks/replay_stages.py [--world 16] [--interval 2] [--periods 32] [--probe-runs] [--out F]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import torch

_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier")


def _stage_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, stage name): the methods a check runs, outermost first."""
    from scout_core.replay import capture, layer, recipe, timing
    from scout_core.replay.engine import ReplayEngine
    from scout_core.replay.guard import DiagnosisGuard
    from scout_core.replay.protocol import CheckProtocol
    from scout_core.replay.trust import Trust

    return [
        (ReplayEngine, "boundary", "boundary"),
        (CheckProtocol, "agree_inputs", "agree_inputs"),
        (CheckProtocol, "_call_metadata", "  call_metadata"),
        (CheckProtocol, "_reserve_scratch", "  reserve_scratch"),
        (DiagnosisGuard, "agree_and_ask", "  agree_and_ask"),
        (CheckProtocol, "broadcast", "call broadcast"),  # not "broadcast": that name counts collectives
        (recipe.RecipeRunner, "replay_due", "replay_due"),
        (recipe.RecipeRunner, "replay", "  replay (passes, signing)"),
        (layer, "_signed", "    signing"),
        (recipe.RecipeRunner, "_timed", "  timed collective"),
        (Trust, "vetting_surfaces", "vetting_surfaces"),
        (CheckProtocol, "exchange", "exchange"),
        (CheckProtocol, "replica_exchange", "replica_exchange"),
        (ReplayEngine, "_verdicts", "verdicts"),
        (capture.LayerCapture, "_pre", "capture (in the step)"),
        (capture.LayerCapture, "_post", "capture (in the step)"),
        (timing.CommTiming, "scratch_all_reduce", "    scratch all-reduce"),
    ]


def _instrument(record: dict[str, float]) -> None:
    """Wrap every stage and collective so that its wall time adds to ``record`` (this rank, this check)."""
    import torch.distributed as dist

    def timed(fn: Any, name: str) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record[name] = record.get(name, 0.0) + time.perf_counter() - start
                if name in _COLLECTIVES:
                    record["collectives (count)"] = record.get("collectives (count)", 0) + 1
                    record[f"{name} (count)"] = record.get(f"{name} (count)", 0) + 1
        return wrapper

    for owner, attr, name in _stage_targets():
        setattr(owner, attr, timed(getattr(owner, attr), name))
    for name in _COLLECTIVES:
        setattr(dist, name, timed(getattr(dist, name), name))


def _probe_runs(runs: list[list[float]]) -> None:
    """Replace the timed scratch all-reduce by the shipped one's untimed one-element all-reduce and three
    recorded runs (``runs``, one row per check): the spread of one run, the faster of two (shipped) and of three
    read from one job."""
    import torch.distributed as dist

    from scout_core.replay import timing

    def probed(self: Any, layer: torch.nn.Module, group: Any, scratch: torch.Tensor, repeats: int = 3) -> float:
        dist.all_reduce(scratch.view(-1)[:1], group=group)
        row = []
        for _ in range(3):
            start = time.perf_counter()
            dist.all_reduce(scratch, group=group)
            row.append(time.perf_counter() - start)
        runs.append(row)
        return min(row)

    timing.CommTiming.scratch_all_reduce = probed


def _rank(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from replay_bench import arms_in_order, ddp_model, warm_up

    from scout_core.config import ReplayCadence, ReplayConfig
    from scout_core.replay.engine import ReplayEngine
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx, timeout_s=900)
    torch.set_num_threads(1)
    a = ctx.args
    depth, width, interval = a["depth"], a["width"], a["interval"]

    record: dict[str, float] = {}
    runs: list[list[float]] = []
    if a["probe_runs"]:
        _probe_runs(runs)
    _instrument(record)  # before the engine exists: its capture hooks are bound at construction
    data = torch.randn(a["batch"], width, generator=torch.Generator().manual_seed(ctx.rank))
    plain, plain_opt = ddp_model(depth, width)
    watched, watched_opt = ddp_model(depth, width)
    cfg = ReplayConfig(cadence=ReplayCadence(embedding=0, hidden=1, output=0, optimizer=0))
    engine = ReplayEngine(list(watched.module), watched_opt, config=cfg)

    def period(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(interval):
            model(data).square().mean().backward()
            opt.step()
            opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    warm_up(engine, watched, watched_opt, data, depth, interval)  # start-up checks are not reported
    period(plain, plain_opt)
    runs.clear()
    checks, costs, steps = [], [], []
    for i in range(a["periods"]):
        arms = [("a", plain, plain_opt), ("b", watched, watched_opt)]
        times = {}
        for name, model, opt in arms_in_order(arms, i):
            record.clear()
            times[name] = period(model, opt)
            if name == "b":
                for key in ("barrier", "barrier (count)"):  # the period's own two barriers are not the check's
                    record.pop(key, None)
                record["collectives (count)"] = record.get("collectives (count)", 0) - 2
                checks.append(dict(record))
        costs.append(times["b"] - times["a"])
        steps.append(times["a"] / interval)
    engine.close()
    return {"checks": checks, "costs": costs, "step_s": statistics.median(steps), "runs": runs}


def _spread(per_rank: list[list[list[float]]]) -> dict[str, Any]:
    """Per estimator (one run, the faster of two, of three): the group median per check over its median over the
    checks; the share of checks above 1.5x (the communication ratio floor) and its largest."""
    out = {}
    for name, pick in (("one run", lambda r: r[0]), ("min of 2", lambda r: min(r[:2])), ("min of 3", min)):
        medians = [statistics.median(pick(rank[c]) for rank in per_rank) for c in range(len(per_rank[0]))]
        base = statistics.median(medians)
        ratios = sorted(m / base for m in medians)
        out[name] = {"median_ms": round(base * 1e3, 1), "max_ratio": round(ratios[-1], 2),
                     "p90_ratio": round(ratios[int(0.9 * (len(ratios) - 1))], 2),
                     "over_1.5x": sum(r > 1.5 for r in ratios), "checks": len(ratios)}
    return out


def bench_replay_stages(*, world: int = 16, interval: int = 2, periods: int = 32, depth: int = 6, width: int = 256,
                        batch: int = 256, probe_runs: bool = False) -> dict[str, Any]:
    """Per stage, the median over the checks of the slowest rank's and the ranks' mean milliseconds, beside a
    check's A/B cost and the step; with ``probe_runs``, the spread of one, two and three timed runs."""
    from scout_core.testing.launcher import launch

    args = {"world": world, "interval": interval, "periods": periods, "depth": depth, "width": width,
            "batch": batch, "probe_runs": probe_runs}
    result = launch(_rank, world, timeout_s=1800, args=args)
    if not result.ok:
        raise RuntimeError(result.failures())
    ranks = result.values()
    order = [n for _, _, n in _stage_targets()]
    names = sorted({k for r in ranks for c in r["checks"] for k in c},
                   key=lambda k: (order.index(k) if k in order else len(order), k))
    # The stages of a check that times the scratch all-reduce (every ``replay.comm_timing_every``-th): the whole
    # breakdown of one kind of check, not a median across two kinds. Beside it, each kind's A/B cost.
    comm = [any(k.strip() == "scratch all-reduce" for r in ranks for k in r["checks"][c])
            for c in range(len(ranks[0]["checks"]))]
    timed = [c for c, t in enumerate(comm) if t]
    if not timed:
        raise RuntimeError(f"none of the {len(comm)} checks timed the scratch all-reduce: measure more periods")
    n_checks = len(timed)
    rows = {}
    for name in names:
        per_check = [[r["checks"][c].get(name, 0.0) for r in ranks] for c in timed]
        scale = 1 if name.endswith("(count)") else 1e3  # a count, not seconds
        rows[name.strip()] = {"max_ms": round(statistics.median(max(v) for v in per_check) * scale, 1),
                              "mean_ms": round(statistics.median(statistics.fmean(v) for v in per_check) * scale, 1),
                              "depth": (len(name) - len(name.lstrip())) // 2}
    out = {**args, "checks": n_checks, "step_ms": round(ranks[0]["step_s"] * 1e3, 1),
           "check_cost_ms": round(statistics.median(c for r in ranks for c in r["costs"]) * 1e3, 1), "stages": rows}
    for kind, picked in (("timed", True), ("untimed", False)):
        costs = [r["costs"][c] for r in ranks for c, t in enumerate(comm) if t is picked]
        out[f"check_cost_ms_{kind}"] = round(statistics.median(costs) * 1e3, 1) if costs else None
        out[f"checks_{kind}"] = len(costs) // len(ranks)
    if probe_runs:
        out["runs"] = _spread([r["runs"] for r in ranks])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=16)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--periods", type=int, default=32)
    p.add_argument("--probe-runs", action="store_true", help="record three aligned runs of the timed all-reduce")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = bench_replay_stages(world=a.world, interval=a.interval, periods=a.periods, probe_runs=a.probe_runs)
    width = max(len(n) + 2 * row["depth"] for n, row in out["stages"].items())
    print(f"{a.world} ranks, I={a.interval}, step {out['step_ms']} ms; a check's A/B cost {out['check_cost_ms']} ms: "
          f"{out['check_cost_ms_timed']} ms in {out['checks_timed']} checks that time the scratch all-reduce, "
          f"{out['check_cost_ms_untimed']} ms in {out['checks_untimed']} that do not")
    print(f"{'stage'.ljust(width)}  slowest rank  rank mean   (median over the {out['checks']} checks that time it)")
    for name, row in out["stages"].items():
        print(f"{('  ' * row['depth'] + name).ljust(width)}  {row['max_ms']:>10.1f}  {row['mean_ms']:>9.1f}")
    if a.probe_runs:
        print(json.dumps(out["runs"], indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
