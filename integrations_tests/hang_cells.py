"""Hang-localization cells: real 16-rank training jobs that stop for a real reason.

Each rank trains the tiny model under DDP, FSDP2 or HSDP with
``scout_core.enable()`` and no change to its loop beyond the data-loader and
checkpoint boundaries SCOUT marks. The injector then freezes a rank, changes a
collective's metadata, skips a collective, stalls input or a checkpoint write,
or holds a collective inside the transport. The trainers stay blocked; the
observers must write the verdict. The cell compares the records on disk with
``params.expect``: exact kind, scope, ranks and hang class, and checks that the
user callback ran in the observers. A clean cell trains to the end and must
report nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import scout_core
from integrations_tests.models import batches, build
from scout_core.cells import CellReport, CellSpec, fault_dicts
from scout_core.config import load
from scout_core.inject import Injector
from scout_core.launcher import RankContext, init_gloo, launch
from scout_core.report import JsonlSink, read_incidents

# Collectives the injector can hold inside the "transport" (innermost wrapper).
_HOLDABLE = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast")


def _train_rank(ctx: RankContext) -> dict[str, Any]:
    init_gloo(ctx, timeout_s=600)  # the observers must speak long before gloo would time out
    a = ctx.args
    injector = Injector(a["faults"], seed=a["seed"])
    state = {"step": 0}
    for name in _HOLDABLE:  # before enable(): SCOUT's hooks wrap these, so intent is published first
        setattr(dist, name, injector.wrap_collective(getattr(dist, name), name, rank=ctx.rank,
                                                     step=lambda: state["step"]))
    par = build(a["layout"], seed=a["seed"])
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
    metrics_group = dist.new_group(list(range(ctx.world_size)))
    cfg = load(None, [
        f"observer.silence_threshold_s={a['threshold_s']}",
        f"observer.gather_timeout_s={a['gather_timeout_s']}",
        f"report.jsonl_path={a['jsonl']}",
        f"report.run_id={a['run_id']}",
        "report.log_level=ERROR",
    ])
    callbacks = JsonlSink(os.path.join(a["workdir"], f"callback-r{ctx.rank}.jsonl"), fsync=False)
    handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh, on_incident=callbacks.emit)
    with open(os.path.join(a["workdir"], f"startup-r{ctx.rank}.txt"), "w") as fh:
        fh.write(repr(handle.observer_startup_s))  # hung ranks never return it
    par.inner.layers[1].register_forward_pre_hook(
        lambda *_: injector.freeze("layers.1.forward", rank=ctx.rank, step=state["step"]))

    def data():
        for step, batch in enumerate(batches(ctx.rank, a["steps"], seed=a["seed"])):
            injector.delay("dataloader", rank=ctx.rank, step=step)
            yield batch

    loss_fn = torch.nn.MSELoss()
    for step, (x, y) in enumerate(handle.wrap_dataloader(data())):
        state["step"] = step
        loss = loss_fn(par.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric, op = loss.detach().reshape(1), dist.ReduceOp.SUM
        if not injector.skip("metrics.all_reduce", rank=ctx.rank, step=step):
            metric, op = injector.mismatch("metrics.all_reduce", metric, op, rank=ctx.rank, step=step)
            dist.all_reduce(metric, op=op, group=metrics_group)
        if (step + 1) % a["checkpoint_every"] == 0:
            with handle.checkpoint_io("write"):
                injector.delay("checkpoint.write", rank=ctx.rank, step=step)
                shard = {k: v.detach().clone() for k, v in par.inner.state_dict().items()}
                torch.save(shard, os.path.join(a["workdir"], f"ckpt-r{ctx.rank}.pt"))
    dist.barrier()
    handle.close()
    return {"steps": state["step"] + 1}


class _RecordsSettled:
    """Stop condition: records exist and none arrived for ``settle_s`` (duplicates would show)."""

    def __init__(self, path: str, settle_s: float) -> None:
        self.path, self.settle_s = path, settle_s
        self.count, self.since = 0, None

    def __call__(self) -> bool:
        n = len(list(read_incidents(self.path))) if os.path.exists(self.path) else 0
        now = time.monotonic()
        if n != self.count:
            self.count, self.since = n, now
        return n > 0 and now - self.since >= self.settle_s


def hang_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    jsonl = os.path.join(workdir, "incidents.jsonl")
    expect = [dict(e) for e in p.get("expect", [])]
    args = {
        "faults": list(spec.faults), "seed": spec.seed, "layout": p.get("layout", "ddp"),
        "steps": int(p.get("steps", 30)), "threshold_s": float(p.get("threshold_s", 2.0)),
        "gather_timeout_s": float(p.get("gather_timeout_s", 4.0)),
        "checkpoint_every": int(p.get("checkpoint_every", 4)),
        "jsonl": jsonl, "run_id": spec.name, "workdir": workdir,
    }
    stop = _RecordsSettled(jsonl, settle_s=float(p.get("settle_s", 1.5))) if expect else None
    result = launch(_train_rank, world_size, timeout_s=spec.timeout_s, args=args, stop_when=stop)
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    problems = []
    if expect:
        if not result.stopped:
            problems.append("the job was expected to hang and be diagnosed, but: "
                            + (result.failures() or "it finished"))
    elif not result.ok:
        problems.append(result.failures())
    got = [{"kind": i.kind.value, "scope": i.scope.value, "ranks": sorted(i.ranks), "class": i.evidence.get("class")}
           for i in incidents]
    want = [{**e, "ranks": sorted(e["ranks"])} for e in expect]
    if sorted(got, key=repr) != sorted(want, key=repr):
        seen = "; ".join(f"{i.reason} [coordinates {i.evidence.get('coordinates')}, pending "
                         f"{i.evidence.get('pending')}, stall {i.evidence.get('stall_s')} s]" for i in incidents)
        problems.append(f"reported {got}, expected {want}; evidence: {seen}")
    if expect:
        calls = [f for f in os.listdir(workdir) if f.startswith("callback-r")]
        if len(calls) < world_size - sum(len(e["ranks"]) for e in expect if e.get("class") == "lost"):
            problems.append(f"user callback ran in {len(calls)} observers only")
    startups = []
    for name in os.listdir(workdir):
        if name.startswith("startup-r"):
            with open(os.path.join(workdir, name)) as fh:
                startups.append(float(fh.read()))
    if len(startups) != world_size:
        problems.append(f"{len(startups)} of {world_size} observers started")
    metrics = {"observer_startup_max_s": round(max(startups), 4)} if startups else {}
    return CellReport(
        name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
        injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents], details="\n".join(problems),
        time_to_verdict_s=max((i.time_to_verdict_s or 0.0 for i in incidents), default=None), metrics=metrics,
    )
