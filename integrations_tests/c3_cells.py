"""Foundation cells: C3 on signatures and cross-process-group timing localization.

Each cell forks real gloo ranks, injects a real fault through the Injector,
lets SCOUT's own code (signatures, C3 exchange, topology intersection, the
JSON-lines sink) reach a verdict, and then compares the incident records on
disk with what was injected: exact ranks, kind, scope, surface and host.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from scout_core.consensus import C3Status, StatisticalRule, c3_exchange
from scout_core.report import Incident, IncidentKind, IncidentScope, JsonlSink, Reporter, read_incidents
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, launch
from scout_core.topology import GroupTiming, axis_groups, hosts_by_group, localize_slow_groups

# Surfaces signed in one exchange: mixed dtypes, odd byte lengths included.
SURFACES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "hidden.output": ((64, 48), torch.float32),
    "hidden.grad_input": ((33, 17), torch.bfloat16),
    "hidden.grad_weight": ((48, 48), torch.float16),
    "optimizer.update": ((4099,), torch.float32),
}


def _surface_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, (shape, dtype) in SURFACES.items()}


def _reporter(ctx: RankContext) -> Reporter:
    return Reporter([JsonlSink(ctx.args["jsonl"], fsync=True)], run_id=ctx.args["run_id"], rank=ctx.rank)


def _designated_reporter(peer_ranks: tuple[int, ...], flagged: tuple[int, ...]) -> int:
    """The lowest-ranked healthy peer writes the record, so it appears once."""
    return min(r for r in peer_ranks if r not in flagged)


def _sdc_rank(ctx: RankContext) -> dict[str, Any]:
    init_gloo(ctx)
    injector = Injector(ctx.args["faults"], seed=ctx.args["seed"])
    reporter = _reporter(ctx)
    step = 0
    tensors = _surface_tensors(ctx.args["seed"])
    for name, tensor in tensors.items():
        injector.corrupt(name, tensor, rank=ctx.rank, step=step)
    t0 = time.monotonic()
    signed = sign_many(list(tensors.values()))
    results = c3_exchange([(s.signature, s.nonfinite) for s in signed], surfaces=list(tensors))
    elapsed = time.monotonic() - t0
    for res in results:
        if res.status is C3Status.AGREE:
            continue
        if res.status is C3Status.ATTRIBUTED:
            reporter_rank = _designated_reporter(res.peer_ranks, res.outlier_ranks)
            if ctx.rank == reporter_rank:
                reporter.emit(Incident(
                    kind=IncidentKind.SDC, scope=IncidentScope.RANK, ranks=list(res.outlier_ranks),
                    hosts=[ctx.args["hosts"][r] for r in res.outlier_ranks],
                    devices=["cpu" for _ in res.outlier_ranks], step=step, surface=res.surface,
                    evidence=res.to_dict(), time_to_verdict_s=elapsed,
                    reason=f"signature differs from the strict majority of {res.group_size} replicas",
                ))
        else:  # inconclusive: group-scoped, never a rank
            if ctx.rank == min(res.peer_ranks):
                reporter.emit(Incident(
                    kind=IncidentKind.SDC, scope=IncidentScope.PEER_GROUP, ranks=list(res.peer_ranks),
                    step=step, surface=res.surface, evidence=res.to_dict(), time_to_verdict_s=elapsed,
                    reason="replicas disagree without a strict majority",
                ))
    dist.barrier()
    return {"results": [r.to_dict() for r in results], "injected": len(injector.log)}


def _hosts(world_size: int, ranks_per_host: int) -> dict[int, str]:
    return {r: f"node{r // ranks_per_host}" for r in range(world_size)}


def _check_same_everywhere(values: list[Any]) -> str:
    first = values[0]["results"]
    bad = [i for i, v in enumerate(values) if v["results"] != first]
    return f"ranks {bad} derived different C3 results than rank 0" if bad else ""


def _expected_incidents(spec: CellSpec) -> list[dict[str, Any]]:
    """What a correct SCOUT must report for the injected faults (one per surface)."""
    by_surface: dict[str, set[int]] = {}
    for f in spec.faults:
        by_surface.setdefault(f.surface, set()).add(f.rank)
    return [{"kind": "sdc", "scope": "rank", "ranks": sorted(r), "surface": s} for s, r in sorted(by_surface.items())]


def _launch_and_read(spec: CellSpec, world_size: int, workdir: str, worker, args: dict[str, Any]):
    jsonl = os.path.join(workdir, "incidents.jsonl")
    args = {"jsonl": jsonl, "run_id": spec.name, "faults": list(spec.faults), "seed": spec.seed, **args}
    result = launch(worker, world_size, timeout_s=spec.timeout_s, args=args)
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    return result, incidents


def sdc_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    """Sign four surfaces on every rank; C3 must name exactly the injected rank per surface."""
    hosts = _hosts(world_size, int(spec.params.get("ranks_per_host", 8)))
    result, incidents = _launch_and_read(spec, world_size, workdir, _sdc_rank, {"hosts": hosts})
    reported = [i.to_dict() for i in incidents]
    problems = []
    if not result.ok:
        problems.append(result.failures())
    else:
        problems.append(_check_same_everywhere(result.values()))
        injected_count = sum(v["injected"] for v in result.values())
        if injected_count != len(spec.faults):
            problems.append(f"{injected_count} injections applied, {len(spec.faults)} configured")
    got = sorted(
        ({"kind": i.kind.value, "scope": i.scope.value, "ranks": sorted(i.ranks), "surface": i.surface}
         for i in incidents),
        key=lambda d: d["surface"],
    )
    want = _expected_incidents(spec)
    if got != want:
        problems.append(f"reported {got}, expected {want}")
    problems = [p for p in problems if p]
    ttv = max((i.time_to_verdict_s or 0.0 for i in incidents), default=None)
    return CellReport(
        name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
        injected=fault_dicts(spec.faults), reported=reported, details="\n".join(problems), time_to_verdict_s=ttv,
    )


# --- topology-fig3: cross-process-group intersection on real collectives -------------------

FIG3_ORDER = ("t", "d", "s", "p", "c", "e")  # two TP slices of a 4x2 DP-FSDP mesh


def _fig3_shape(world_size: int) -> dict[str, int]:
    if world_size % 4:
        raise ValueError(f"topology-fig3 needs a world size divisible by 4 (t=2, s=2), got {world_size}")
    return {"t": 2, "d": world_size // 4, "s": 2}


def _timed_collective(injector: Injector, surface: str, group: dist.ProcessGroup, rank: int, step: int) -> float:
    payload = torch.ones(4096)
    dist.barrier()  # every group starts together so waits are attributable
    start = time.perf_counter()
    injector.delay(surface, rank=rank, step=step)  # a slow endpoint inside this rank's collective
    dist.all_reduce(payload, group=group)
    return time.perf_counter() - start


def _fig3_rank(ctx: RankContext) -> dict[str, Any]:
    init_gloo(ctx)
    shape = _fig3_shape(ctx.world_size)
    fsdp_groups = axis_groups(shape, "s", FIG3_ORDER)
    tp_groups = axis_groups(shape, "t", FIG3_ORDER)
    host_of = hosts_by_group(tp_groups, prefix="node")  # each TP group lives inside one machine
    my_fsdp, _ = dist.new_subgroups_by_enumeration(fsdp_groups)
    my_tp, _ = dist.new_subgroups_by_enumeration(tp_groups)
    injector = Injector(ctx.args["faults"], seed=ctx.args["seed"])
    rule = StatisticalRule(**ctx.args["rule"])
    reporter = _reporter(ctx)
    verdicts = []
    for step in range(int(ctx.args["rounds"])):
        t_fsdp = _timed_collective(injector, "fsdp.all_reduce", my_fsdp, ctx.rank, step)
        t_tp = _timed_collective(injector, "tp.all_reduce", my_tp, ctx.rank, step)
        t0 = time.monotonic()
        timings: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(timings, (t_fsdp, t_tp))
        observations = []
        for dim, groups, col in (("fsdp", fsdp_groups, 0), ("tp", tp_groups, 1)):
            # A synchronized collective finishes with its slowest member: group time = max.
            group_times = [max(timings[r][col] for r in g) for g in groups]
            res = rule(group_times, peer_ranks=list(range(len(groups))), surface=f"{dim}.all_reduce")
            observations += [GroupTiming(dim, g, bool(b)) for g, b in zip(groups, res.bitmap)]
        loc = localize_slow_groups(observations, host_of)
        verdicts.append({"scope": loc.scope, "ranks": list(loc.ranks), "hosts": list(loc.hosts),
                         "reason": loc.reason, "elapsed": time.monotonic() - t0,
                         "slow_groups": [list(g) for _, g in loc.slow_groups]})
    # Confirmation: the same machine in every round (a straggler must recur).
    last = verdicts[-1]
    confirmed = last["scope"] != "none" and all(
        (v["scope"], v["ranks"], v["hosts"]) == (last["scope"], last["ranks"], last["hosts"]) for v in verdicts)
    if confirmed and ctx.rank == 0:
        scope = {"machine": IncidentScope.MACHINE, "peer_group": IncidentScope.PEER_GROUP,
                 "job": IncidentScope.JOB}[last["scope"]]
        reporter.emit(Incident(
            kind=IncidentKind.STRAGGLER, scope=scope, ranks=last["ranks"], hosts=last["hosts"],
            devices=["cpu"] * len(last["ranks"]), step=int(ctx.args["rounds"]) - 1, surface="fsdp+tp.all_reduce",
            evidence={"rounds": verdicts}, time_to_verdict_s=sum(v["elapsed"] for v in verdicts),
            reason=last["reason"],
        ))
    dist.barrier()
    return {"results": verdicts, "host_of": host_of}


def fig3_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    """A slow endpoint on one rank slows its FSDP and TP groups; SCOUT must name its machine."""
    params = spec.params
    result, incidents = _launch_and_read(spec, world_size, workdir, _fig3_rank, {
        "rounds": int(params.get("rounds", 2)),
        "rule": dict(params.get("rule", {})),
    })
    problems = []
    if not result.ok:
        problems.append(result.failures())
    target_ranks = sorted({f.rank for f in spec.faults})
    if result.ok:
        host_of = result.values()[0]["host_of"]
        expected = [{"kind": "straggler", "scope": "machine", "ranks": target_ranks,
                     "hosts": sorted({host_of[r] for r in target_ranks})}] if target_ranks else []
    else:
        expected = []
    got = [{"kind": i.kind.value, "scope": i.scope.value, "ranks": sorted(i.ranks), "hosts": sorted(i.hosts)}
           for i in incidents]
    if result.ok and got != expected:
        problems.append(f"reported {got}, expected {expected}; rounds: {result.values()[0]['results']}")
    ttv = max((i.time_to_verdict_s or 0.0 for i in incidents), default=None)
    return CellReport(
        name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
        injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents],
        details="\n".join(problems), time_to_verdict_s=ttv,
    )
