"""Runtime cells: SCOUT's own failures never break training.

``replay-error-isolated``: a 16-rank job with every SCOUT feature on, in which
one rank's replay raises at one check (an injected software fault inside the
replayed block, only while SCOUT replays). Every peer must skip that check
together (no hang), exactly one ``diagnosis_error`` record must name that
rank, later checks must run again, and the trained parameters must be bitwise
equal to the same job trained without SCOUT.

``*-scratch-oom-isolated``: the same, for a rank that runs out of memory while
reserving what the check's collectives will allocate (the unshard under FSDP2,
HSDP's timed reduce-scatter): the failure must come before any collective.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import scout_core
from integrations_tests.models import batches, start_rank
from scout_core.config import load
from scout_core.report import read_incidents
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.inject import InjectedFault
from scout_core.testing.launcher import RankContext, launch


def _fail_scratch_allocation(injector: Any, rank: int, state: dict[str, int]) -> None:
    """Surface ``replay.scratch``: this rank runs out of device memory reserving what a check's collectives
    need (FSDP2's unshard, the timed all-reduce, HSDP's reduce-scatter), as a rank short of memory would."""
    import scout_core.replay.recipe as recipe_module

    real = recipe_module.reserve

    def reserve(*args: Any, **kwargs: Any) -> Any:
        try:
            injector.fail("replay.scratch", rank=rank, step=state["step"])
        except InjectedFault as exc:
            raise torch.OutOfMemoryError(f"out of memory reserving replay scratch ({exc})") from None
        return real(*args, **kwargs)

    recipe_module.reserve = reserve


def _rank(ctx: RankContext) -> dict[str, Any]:
    a, injector, par, opt = start_rank(ctx)
    state = {"step": 0}
    handle = None
    if a["scout"]:
        cfg = load(None, [
            "replay.cadence.embedding=1", "replay.cadence.hidden=1", "replay.cadence.output=1",
            "replay.cadence.optimizer=1", "replay.optimizer_slice_elems=256", "observer.silence_threshold_s=30",
            "checkpoint.enabled=true", f"checkpoint.directory={a['workdir']}/store",
            # In the cell's folder, not /dev/shm: a run that crashes by design (the negative tests) leaves
            # its snapshots behind, and they must not pile up in a CI machine's RAM.
            f"checkpoint.memory_dir={a['workdir']}/memory",
            f"report.jsonl_path={a['jsonl']}", "report.log_level=ERROR",
        ])
        handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh)

        def software_fault(*_: Any) -> None:  # a bug that fires only inside SCOUT's replay
            if handle.replay.replaying:
                injector.fail("replay.compute", rank=ctx.rank, step=state["step"])

        for block in par.inner.layers:
            block.fc.register_forward_hook(software_fault)
        _fail_scratch_allocation(injector, ctx.rank, state)
    loss_fn = torch.nn.MSELoss()
    for step, (x, y) in enumerate(batches(ctx.rank, a["steps"], seed=a["seed"]), start=1):
        state["step"] = step
        loss_fn(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in par.model.parameters()]
    final = [s.signature for s in sign_many([p.detach() for p in local] + [torch.get_rng_state()])]
    history = []
    if handle is not None:
        history = [(r.step, r.skipped, len(r.surfaces)) for r in handle.replay.history]
        handle.close(discard_snapshots=True)
    return {"final": final, "history": history}


def replay_error_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    jsonl = os.path.join(workdir, "incidents.jsonl")
    args = {"faults": list(spec.faults), "seed": spec.seed, "layout": p.get("layout", "ddp"),
            "steps": int(p.get("steps", 6)), "jsonl": jsonl, "workdir": workdir}
    start = time.monotonic()
    problems = []
    with_scout = launch(_rank, world_size, timeout_s=spec.timeout_s, args={**args, "scout": True})
    without = launch(_rank, world_size, timeout_s=spec.timeout_s, args={**args, "scout": False})
    if not with_scout.ok:
        problems.append("with SCOUT (a hang or crash): " + with_scout.failures())
    if not without.ok:
        problems.append("without SCOUT: " + without.failures())
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    fault_step = spec.faults[0].schedule.start
    got = [(i.kind.value, i.scope.value, i.ranks, i.step) for i in incidents]
    want = [("diagnosis_error", "rank", [f.rank for f in spec.faults], fault_step)]
    if got != want:
        why = "; ".join(f"r{i.ranks} step {i.step} {i.surface}: {i.evidence.get('message', '')[:200]}"
                        for i in incidents)
        problems.append(f"records {got}, expected exactly {want} ({why})")
    if with_scout.ok and without.ok:
        differ = [r for r, (a, b) in enumerate(zip(with_scout.values(), without.values())) if a["final"] != b["final"]]
        if differ:
            problems.append(f"training is not bitwise equal to the run without SCOUT on ranks {differ}")
        for r, v in enumerate(with_scout.values()):
            skipped = [s for s, why, _ in v["history"] if why]
            checked = [s for s, why, n in v["history"] if not why and n]
            if skipped != [fault_step]:
                problems.append(f"rank {r} skipped checks at steps {skipped}, expected only {fault_step}")
            if len(checked) != args["steps"] - 1:
                problems.append(f"rank {r} ran checks at steps {checked}: every other step must be checked")
    return CellReport(name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
                      injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents],
                      details="\n".join(problems), wall_s=time.monotonic() - start)
