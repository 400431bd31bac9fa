"""What replay costs (paper section 6.1): in a 16-rank job, over the check interval, and in memory.

* :func:`bench_replay_curve`: 16 DDP ranks, each holding a plain copy of the model and one watched by a
  :class:`~scout_core.replay.engine.ReplayEngine` over the whole world (its broadcast and exchanges included),
  stepped alternately one check period at a time (A/B inside one job: separate processes on this shared
  machine differ more than the effect); the median ``B/A - 1`` per interval I beside the paper's model
  ``V / (I * N)``, written as JSON and drawn as a PNG.
* :func:`bench_replay_memory`: one check of a large layer, the peak growth of the process's resident memory
  during the check as a multiple of the sampled layer's parameter and activation bytes.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

import torch

INTERVALS = (1, 2, 5, 10, 20, 50, 100)


def _curve_rank(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from scout_core.config import ReplayCadence, ReplayConfig
    from scout_core.replay.engine import ReplayEngine
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx, timeout_s=900)
    torch.set_num_threads(1)
    a = ctx.args
    depth, width = a["depth"], a["width"]

    gen = torch.Generator().manual_seed(ctx.rank)
    data = torch.randn(a["batch"], width, generator=gen)
    out: dict[str, Any] = {"collective_ms": _collective_ms()}
    counted = _count_collectives()
    for interval in a["intervals"]:
        plain, plain_opt = ddp_model(depth, width)
        watched, watched_opt = ddp_model(depth, width)
        cfg = ReplayConfig(cadence=ReplayCadence(embedding=0, hidden=1, output=0, optimizer=0))
        engine = ReplayEngine(list(watched.module), watched_opt, config=cfg)

        def period(model: torch.nn.Module, opt: torch.optim.Optimizer, interval: int = interval) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(interval):  # one check period: exactly one replay for the watched copy
                model(data).square().mean().backward()
                opt.step()
                opt.zero_grad()
            dist.barrier()
            return time.perf_counter() - start

        twin, twin_opt = ddp_model(depth, width)  # a second plain copy: the A/A noise beside each A/B
        period(plain, plain_opt)
        period(twin, twin_opt)
        warm_up(engine, watched, watched_opt, data, depth, interval)
        warm = len(engine.history)
        ratios, noise, steps = [], [], []
        calls = 0
        for i in range(a["pairs"]):
            arms = [("a", plain, plain_opt), ("b", watched, watched_opt), ("a2", twin, twin_opt)]
            times = {}
            for name, model, opt in arms_in_order(arms, i):
                before = counted[0]
                times[name] = period(model, opt)
                calls += counted[0] - before - 2 if name == "b" else 0  # less the period's own two barriers
            ratios.append(times["b"] / times["a"] - 1)
            noise.append(times["a2"] / times["a"] - 1)
            steps.append(times["a"] / interval)
        engine.close()
        checks = len(engine.history) - warm
        out[str(interval)] = {"ratios": [round(r, 5) for r in ratios], "aa": [round(r, 5) for r in noise],
                              "checks": checks, "step_ms": round(statistics.median(steps) * 1e3, 2),
                              "collectives_per_check": round(calls / max(checks, 1), 2)}
    return out


def warm_up(engine: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor,
            depth: int, interval: int) -> None:
    """Run the watched copy at one check per step through a check's start-up costs, which are not its rate,
    then set the cadence to ``interval`` (a live change, as ``scout ctl`` makes it): the first rotation's
    checks are vetted (run twice), and the first ``BASELINE_ROUNDS`` time the scratch all-reduce on every
    check (the group's communication history is learned; after it, every ``replay.comm_timing_every``-th
    check does). A job checking every 100 steps spends 1,000 steps there."""
    from scout_core.replay.timing import BASELINE_ROUNDS

    assert engine.cfg.cadence.hidden == 1
    # Whole rotations: the timed checks shift by one each rotation (an even layer count), so a window that
    # starts a rotation times every second check; one that crosses a rotation's end times two in a row.
    for _ in range(-(-max(depth, BASELINE_ROUNDS + 1) // depth) * depth):
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(engine.timing.baseline) >= BASELINE_ROUNDS and engine.timing.slow_group_rounds == 0
    engine.cfg.cadence.hidden = interval
    engine.reschedule()


def arms_in_order(arms: list, i: int) -> list:
    """Pair ``i``'s arms, reversed every two pairs: checks alternate between timing the scratch all-reduce and
    not (``replay.comm_timing_every`` = 2), so each kind of check is measured in both orders."""
    return arms if (i // 2) % 2 else arms[::-1]


def ddp_model(depth: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The bench job's model: ``depth`` blocks of a ``width`` linear layer and GELU under DDP, with AdamW (the
    same weights on every call and rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                  for _ in range(depth)))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)


def _collective_ms(rounds: int = 40) -> float:
    """The latency of one small all-reduce over the whole job, median of ``rounds``: what each of a check's
    collectives costs before any byte moves (on this host, 16 ranks share 2 cores)."""
    import torch.distributed as dist

    flag, times = torch.zeros(1), []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        dist.all_reduce(flag)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def _count_collectives() -> list[int]:
    """Count this rank's calls of torch's Python collectives from now on (DDP's own reduction runs in C++ and
    is not among them): the number of collectives a check makes."""
    import torch.distributed as dist

    counted = [0]
    for name in ("all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter_tensor", "all_to_all_single"):
        original = getattr(dist, name)

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counted[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    return counted


def bench_replay_curve(*, world: int = 16, intervals: tuple[int, ...] = INTERVALS, pairs: int = 6,
                       depth: int = 6, width: int = 256, batch: int = 256, plot_path: str | None = None
                       ) -> dict[str, Any]:
    from scout_core.config import ReplayConfig
    from scout_core.testing.launcher import launch

    result = launch(_curve_rank, world, timeout_s=1800, args={"intervals": list(intervals), "pairs": pairs,
                                                              "depth": depth, "width": width, "batch": batch})
    if not result.ok:
        raise RuntimeError(result.failures())
    variants = len(ReplayConfig().input_variants)
    rank0 = result.values()[0]
    rows = []
    for interval in intervals:
        point = rank0[str(interval)]
        ratios, aa = point["ratios"], point["aa"]
        model = variants / (interval * depth)
        measured = statistics.median(ratios)
        rows.append({"interval": interval, "measured_ratio": round(measured, 5),
                     "min": min(ratios), "max": max(ratios), "checks": point["checks"],
                     "aa_median": round(statistics.median(aa), 5), "aa_range": [min(aa), max(aa)],
                     "model_ratio": round(model, 5), "step_ms": point["step_ms"],
                     "collectives_per_check": point["collectives_per_check"],
                     # What a check costs beyond the model's replayed passes, in milliseconds of the job's time.
                     "fixed_ms_per_check": round((measured - model) * interval * point["step_ms"], 1)})
    out = {"world_size": world, "layers": depth, "width": width, "batch": batch, "variants": variants,
           "pairs": pairs, "collective_ms": rank0["collective_ms"], "curve": rows}
    if plot_path:
        out["plot"] = plot_curve(out, plot_path)
    return out


def plot_curve(result: dict[str, Any], path: str) -> str:
    """The overhead-versus-interval curve as a PNG (matplotlib, from the ``bench`` extra); the path, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install -e '.[bench]')"
    xs = [r["interval"] for r in result["curve"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(xs, [100 * r["measured_ratio"] for r in result["curve"]], "o-", label="measured (median B/A - 1)")
    ax.fill_between(xs, [100 * r["min"] for r in result["curve"]], [100 * r["max"] for r in result["curve"]],
                    alpha=0.2, label="min .. max")
    ax.plot(xs, [100 * r["model_ratio"] for r in result["curve"]], "--", label="model V / (I * N)")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("check interval I (steps)")
    ax.set_ylabel("step-time overhead (%)")
    ax.set_title(f"replay overhead, {result['world_size']} ranks, N={result['layers']}, V={result['variants']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_rank(ctx: Any) -> dict[str, Any]:
    from scout_core.config import ReplayCadence, ReplayConfig
    from scout_core.replay.engine import ReplayEngine
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx)
    torch.set_num_threads(1)
    width, batch = ctx.args["width"], ctx.args["batch"]
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                 for _ in range(2))
    opt = torch.optim.SGD(layers.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step() -> None:
        h = x
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()  # the allocator's working set of training itself
    # Interval 2: step 1 runs without a check (the hooks' own working set), step 2 runs one.
    cfg = ReplayConfig(cadence=ReplayCadence(embedding=0, hidden=2, output=0, optimizer=0))
    engine = ReplayEngine(list(layers), opt, config=cfg)
    step()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0005)

    base = _rss_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step()  # a training step whose boundary runs one check (capture, 3 variants, signatures)
    stop.set()
    sampler.join()
    engine.close()
    layer = layers[0]
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    act_bytes = 2 * batch * width * x.element_size()  # the layer's input and output
    return {"width": width, "batch": batch, "param_bytes": param_bytes, "activation_bytes": act_bytes,
            "peak_growth_bytes": max(0, peak[0] - base), "checks": len(engine.history)}


def bench_replay_memory(*, width: int = 2048, batch: int = 512) -> dict[str, Any]:
    from scout_core.testing.launcher import launch

    result = launch(_memory_rank, 1, timeout_s=600, args={"width": width, "batch": batch})
    if not result.ok:
        raise RuntimeError(result.failures())
    r = result.values()[0]
    r["peak_over_layer"] = round(r["peak_growth_bytes"] / (r["param_bytes"] + r["activation_bytes"]), 2)
    return r
