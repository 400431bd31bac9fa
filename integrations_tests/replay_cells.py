"""In-situ replay cells: real faults in a real 16-rank job (DDP, FSDP2, HSDP), localized by replay.

Each rank trains the tiny model with SCOUT switched on by ``scout_core.enable``
alone (replay cadence 1 for every recipe, variants {0.1x, x, 10x}, the shipped
consensus defaults unless a cell says otherwise); the sampled layer rotates
over the three blocks. Faults
are injected through hooks on the model, so they hit training and replay alike,
as a defective unit would. The cell compares the incident records with
``params.expect``: every named rank, the kinds, and the surfaces that must appear.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import scout_core
from integrations_tests.expect import record_problems
from integrations_tests.models import batches, install_block_faults, install_optimizer_kernel_fault, start_rank
from scout_core.config import ConsensusConfig, load
from scout_core.config_schema import ReplayCadence, ReplayConfig
from scout_core.replay.timing import BASELINE_ROUNDS
from scout_core.report import read_incidents
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, launch


def _install_faults(par: Any, injector: Injector, rank: int, state: dict) -> None:
    """Faults live inside the blocks (on ``fc``) and in torch's optimizer kernel, so they act in training and in
    replay alike, whichever way replay calls the block (FSDP2 replay bypasses the block's own hooks)."""
    inner = par.inner
    fc = inner.layers[1].fc
    install_block_faults(par, injector, rank, state)

    def weight_fault(*_: Any) -> None:
        # A stuck value in this rank's copy of the weight as its compute reads it: the replica under
        # DDP, the unsharded buffer after every all-gather under FSDP2 / HSDP.
        with torch.no_grad():
            injector.corrupt("layers.1.weight", fc.weight, rank=rank, step=state["step"])

    def slow(_m: Any, _a: Any, _out: Any) -> None:
        injector.delay("compute", rank=rank, step=state["step"])

    fc.register_forward_pre_hook(weight_fault)
    for block in inner.layers:
        block.fc.register_forward_hook(slow)
        _slow_by_a_factor(block, injector, rank, state)

    install_optimizer_kernel_fault(injector, rank, state)

    real_gather = dist.all_gather_single

    def gather_received(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # ``collective.received``: this rank's memory or link corrupts what it receives in an all-gather (FSDP2's
        # unshard), in the part its mate at the next shard position sent; the sender's shard is intact.
        work = real_gather(output, input, *args, **kwargs)
        if injector.corrupts("collective.received", rank=rank, step=state["step"]):
            if work is not None:
                work.wait()
            group = kwargs.get("group", args[0] if args else None)
            n = dist.get_world_size(group)
            part = output.numel() // n
            received = output.view(-1).narrow(0, (dist.get_rank(group) + 1) % n * part, part)
            injector.corrupt("collective.received", received, rank=rank, step=state["step"])
        return work

    dist.all_gather_single = gather_received

    def slowed(real: Any) -> Any:
        def slow_collective(*args: Any, **kwargs: Any) -> Any:  # a slow endpoint inside this rank's collectives
            injector.delay("collective", rank=rank, step=state["step"])
            return real(*args, **kwargs)

        return slow_collective

    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "broadcast"):
        setattr(dist, name, slowed(getattr(dist, name)))


def _slow_by_a_factor(block: torch.nn.Module, injector: Injector, rank: int, state: dict) -> None:
    """``slow`` faults: the whole block's forward and its whole backward each take ``factor`` times their own
    CPU time (real extra work after the real work, in training and in replay alike). The clocks run between
    the block's no-op entry and exit points: forward from entering to leaving, backward from the output's
    gradient arriving to the input's gradient being complete (the residual's sum included). Backward is
    timed with tensor hooks, not module backward hooks, which would make the block return a view."""
    started: dict[str, float] = {}

    def stop(which: str) -> None:
        if which in started:
            injector.slow("compute", rank=rank, step=state["step"], compute_s=time.thread_time() - started.pop(which))

    def on_enter(_m: Any, args: tuple) -> None:
        started["forward"] = time.thread_time()
        x = args[0]
        if x.requires_grad:
            x.register_hook(lambda _g: stop("backward"))

    def on_exit(_m: Any, _a: Any, out: torch.Tensor) -> None:
        stop("forward")
        if out.requires_grad:
            out.register_hook(lambda _g: started.__setitem__("backward", time.thread_time()))

    block.enter.register_forward_pre_hook(on_enter)
    block.exit.register_forward_hook(on_exit)


def _replay_rank(ctx: RankContext) -> dict[str, Any]:
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // 8}"
    a, injector, par, opt = start_rank(ctx)
    state: dict[str, Any] = {"step": 0}
    _install_faults(par, injector, ctx.rank, state)
    if ctx.rank == a["other_env_rank"]:  # this rank runs another torch build than its peers
        from scout_core.replay import trust

        real = trust.environment_fingerprint
        trust.environment_fingerprint = lambda device: real(device).replace("torch=", "torch=0.0-other+")
    others = 1 if a["all_recipes"] else 0  # the defaults cells time the hidden recipe only (their cost is CPU)
    # ``shipped``: every replay and consensus setting as shipped (cadence 20, one layer per check in rotation, the
    # whole slice); the hang observer stays off (these cells test replay; hang cells run it).
    cadences = [] if a["shipped"] else [
        f"replay.cadence.embedding={others}", "replay.cadence.hidden=1", f"replay.cadence.output={others}",
        f"replay.cadence.optimizer={others}", "replay.optimizer_slice_elems=256"]
    cfg = load(None, [*cadences, "observer.enabled=false",
                      f"report.jsonl_path={a['jsonl']}", f"report.run_id={a['run_id']}", "report.log_level=ERROR",
                      *[f"consensus.{k}={v}" for k, v in a["rule"].items()]])
    handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh)
    engine = state["engine"] = handle.replay
    loss_fn = torch.nn.MSELoss()
    # Replicas see different data; under HSDP the shard ranks of one replica see the same batch.
    data_rank = ctx.rank // (ctx.world_size // a["replicas"]) if a["layout"] == "hsdp" else ctx.rank
    for step, (x, y) in enumerate(batches(data_rank, a["steps"], seed=a["seed"], batch=a["batch"]), start=1):
        state["step"] = step
        loss_fn(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    final = [s.signature for s in sign_many([p.detach() for p in par.model.parameters()])]
    checks = [(r.step, r.source) for r in engine.history] if engine else []
    compared = sorted({r.surface for res in engine.history for r in res.surfaces}) if engine else []
    handle.close()
    # Each round's compute times by rank: what a failing timing cell is read with.
    times = [(r.step, r.timing.status.value,
              {p: None if t is None else round(t, 6) for p, t in zip(r.timing.peer_ranks, r.timing.evidence)})
             for r in engine.history if r.timing is not None] if engine else []
    # The compute noise floor in force in each flagged round (consensus.NoiseFloor), where it was finite.
    floors = {r.step: round(r.noise_floor, 4) for r in engine.history
              if r.noise_floor is not None and math.isfinite(r.noise_floor)} if engine else {}
    # Each round's communication time of the peer group (its median) and C3 status: what a failing
    # communication cell, or a clean cell that found a slow group, is read with.
    comm = [(r.step, r.comm_timing.status.value, r.comm_timing.reference, r.group_slowdown)
            for r in engine.history if r.comm_timing is not None] if engine else []
    return {"final": final, "checks": checks, "compared": compared, "compute_s": times, "floors": floors,
            "comm_s": comm,
            "rng": sign_many([torch.get_rng_state()])[0].signature}


SHIPPED_CADENCE = ReplayCadence().hidden
"""The shipped replay cadence: a ``shipped`` cell checks once every 20 steps."""


def replay_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    jsonl = os.path.join(workdir, "incidents.jsonl")
    args = {"faults": list(spec.faults), "seed": spec.seed, "layout": p.get("layout", "ddp"),
            "steps": int(p.get("steps", 9)), "rule": dict(p.get("rule", {})),
            "hidden": int(p.get("hidden", 32)), "batch": int(p.get("batch", 8)),
            "all_recipes": bool(p.get("all_recipes", True)), "replicas": int(p.get("replicas", 4)),
            "other_env_rank": p.get("other_env_rank"), "shipped": bool(p.get("shipped", False)),
            "jsonl": jsonl, "run_id": spec.name}
    start = time.monotonic()
    result = launch(_replay_rank, world_size, timeout_s=spec.timeout_s, args=args)
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    problems = []
    if not result.ok:
        problems.append(result.failures())
    expect = p.get("expect", {})
    problems += record_problems(incidents, expect)
    if result.ok:
        checks = result.values()[0]["checks"]
        expected = args["steps"] // SHIPPED_CADENCE if args["shipped"] else args["steps"]
        if len(checks) != expected:
            problems.append(f"{len(checks)} checks ran, expected {expected}")
        if "timing_peers" in expect:  # how many ranks each compute time was compared with
            watched = expect.get("ranks") or [0]
            sizes = sorted({len(t) for _, _, t in result.values()[watched[0]]["compute_s"]})
            if sizes != [expect["timing_peers"]]:
                problems.append(f"compute times compared among {sizes} ranks, expected {expect['timing_peers']}")
        compared = result.values()[0]["compared"]
        for recipe in expect.get("recipes", []):
            if not any(c.startswith(recipe) for c in compared):
                problems.append(f"no {recipe} surface was compared; compared: {compared[:8]}...")
    metrics: dict[str, float] = {}
    if result.ok and expect.get("ranks"):
        watched = expect["ranks"]
        rounds = result.values()[watched[0]]["compute_s"]  # its own peer group holds its times
        metrics = _timing_metrics(rounds, watched[0])
        metrics.update({f"floor.step{step}": f for step, f in result.values()[watched[0]]["floors"].items()})
        if problems:
            problems.append(_timing_summary(rounds, watched, watched[0]))
    if result.ok and "group_slow_from" in expect:
        problems += _group_slowdown_problems(incidents, result.values()[0]["comm_s"], expect["group_slow_from"],
                                             sparse=expect.get("comm_timing_sparse", False))
    if result.ok and problems and (expect.get("scope") == "peer_group" or
                                   any(i.scope == "peer_group" for i in incidents)):
        problems.append(_comm_summary(result.values()[0]["comm_s"]))
    return CellReport(name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
                      injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents],
                      details="\n".join(problems), wall_s=time.monotonic() - start, metrics=metrics)


def _timing_metrics(rounds: list, watched: int) -> dict[str, float]:
    """Per timing round: the watched rank's compute time over the median (``ratio.step<n>``) and the
    round's spread, MAD over median (``spread.step<n>``): what a sensitivity measurement is made of."""
    out = {}
    for step, _status, times in rounds:
        values = [t for t in times.values() if t is not None]
        if not values or times.get(watched) is None:
            continue
        med = statistics.median(values)
        out[f"ratio.step{step}"] = round(times[watched] / med, 4)
        out[f"spread.step{step}"] = round(statistics.median(abs(v - med) for v in values) / med, 4)
    return out


def _group_slowdown_problems(incidents: list, rounds: list, first_slow: int, *, sparse: bool) -> list[str]:
    """A group slowed from step ``first_slow`` is confirmed at its third measured slow round, once, or one
    measured round earlier only where the measured round before the fault could have read slow by itself (its
    group time beyond ``consensus.comm_min_ratio`` times the median of the rounds before it, the least the
    temporal check asks), which the streak then counts. A round that timed no collective
    (``replay.comm_timing_every``) is no measurement: the first slow round is the first measured one from
    ``first_slow``, and from there every round is measured (the streak makes every check time it). ``sparse``:
    the timed collective is the scratch all-reduce (an unshard's all-gather is timed in every round)."""
    steps = sorted(i.step for i in incidents if i.scope == "peer_group")
    measured = [(step, med) for step, _, med, _ in rounds if med is not None]
    slow = [step for step, _ in measured if step >= first_slow]
    allowed = slow[2:3]  # empty where the cell ended before a third measured round: then nothing is allowed
    earlier = [med for step, med in measured if step < first_slow]
    if len(earlier) > 1 and earlier[-1] > ConsensusConfig().comm_min_ratio * statistics.median(earlier[:-1]):
        allowed = slow[1:2] + allowed
    problems = []
    if len(steps) != 1 or steps[0] not in allowed:
        problems.append(f"group slowdown recorded at steps {steps}, expected once at "
                        f"{' or '.join(map(str, allowed)) or 'a third measured slow round'} (slow from step "
                        f"{first_slow})")
    # At the shipped replay.comm_timing_every some round after the history's 10 times nothing, and none does
    # from the first slow reading on (every check times it while the streak runs).
    gaps = [step for step, _, med, _ in rounds if med is None]
    if sparse and not [step for step in gaps if step > BASELINE_ROUNDS]:
        problems.append(f"every round timed the scratch all-reduce (replay.comm_timing_every "
                        f"{ReplayConfig().comm_timing_every} asks for every second once the history is learned)")
    if slow and [step for step in gaps if slow[0] < step <= (steps or [slow[-1]])[0]]:
        problems.append(f"rounds {gaps} timed nothing after the first slow reading at step {slow[0]}: a slow "
                        "streak times every check")
    return problems


def _comm_summary(rounds: list) -> str:
    """Per round the peer group's communication time (its median across peers), the C3 status of the peers'
    times, and whether the group read slow against its own history."""
    cells = [f"{step}:{status[:2]}:{'-' if med is None else f'{med * 1e3:.1f}'}{'*' if slow else ''}"
             for step, status, med, slow in rounds]
    return "communication per round (rank 0's peer group; step:status:median ms, * slow vs history): " + " ".join(cells)


def _timing_summary(rounds: list, watched: list[int], viewer: int) -> str:
    """What a failing timing cell is read with: per round the C3 status, the median compute time, the
    slowest rank's and each watched rank's time as a multiple of the median, and the spread (MAD / median)."""
    lines = [f"replayed compute per round (rank {viewer}'s peer group): step status median spread slowest watched"]
    for step, status, times in rounds:
        values = [t for t in times.values() if t is not None]
        if not values:
            lines.append(f"  {step} {status} no measurement")
            continue
        med = statistics.median(values)
        mad = statistics.median(abs(v - med) for v in values)
        slowest = max(times, key=lambda r: -1.0 if times[r] is None else times[r])
        seen = " ".join(f"r{r}={times[r] / med:.3f}" for r in watched if times.get(r) is not None)
        lines.append(f"  {step} {status} {med * 1e3:.2f}ms {mad / med:.3f} "
                     f"r{slowest}={times[slowest] / med:.3f} {seen}")
    return "\n".join(lines)
