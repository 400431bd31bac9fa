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
from integrations_tests.cell_callbacks import CALLBACK_FILE_ENV, record_incident
from integrations_tests.models import batches, build
from scout_core.config import load
from scout_core.report import read_incidents
from scout_core.runtime import HOSTNAME_ENV
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, launch

# Collectives the injector can hold inside the "transport" (innermost wrapper).
_HOLDABLE = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast")


def _train_rank(ctx: RankContext) -> dict[str, Any]:
    init_gloo(ctx, timeout_s=600)  # the observers must speak long before gloo would time out
    a = ctx.args
    per_machine = ctx.world_size // a["machines"]
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // per_machine}"  # simulated machines of per_machine ranks
    injector = Injector(a["faults"], seed=a["seed"])
    state = {"step": 0}
    for name in _HOLDABLE:  # before enable(): SCOUT's hooks wrap these, so intent is published first
        setattr(dist, name, injector.wrap_collective(getattr(dist, name), name, rank=ctx.rank,
                                                     step=lambda: state["step"]))
    par = build(a["layout"], seed=a["seed"], bucket_cap_mb=a["bucket_cap_mb"])
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
    metrics_group = dist.new_group(list(range(ctx.world_size)))
    cfg = load(None, [
        *([f"observer.silence_threshold_s={a['threshold_s']}"] if a["threshold_s"] else []),
        *([f"observer.gather_timeout_s={a['gather_timeout_s']}"] if a["gather_timeout_s"] else []),
        *([f"observer.io_silence_s={a['io_silence_s']}"] if a["io_silence_s"] else []),
        f"report.jsonl_path={a['jsonl']}",
        f"report.run_id={a['run_id']}",
        "report.log_level=ERROR",
        *a["scout_set"],
    ])
    # A module-level callback: the observer, a fresh interpreter, imports it by path (and inherits this file's name)
    os.environ[CALLBACK_FILE_ENV] = os.path.join(a["workdir"], f"callback-r{ctx.rank}.jsonl")
    handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh, on_incident=record_incident)
    with open(os.path.join(a["workdir"], f"startup-r{ctx.rank}.txt"), "w") as fh:
        fh.write(repr(handle.observer_startup_s))  # hung ranks never return it
    par.inner.layers[1].register_forward_pre_hook(
        lambda *_: injector.freeze("layers.1.forward", rank=ctx.rank, step=state["step"]))
    # Late in backward: the head's gradient bucket is launched by then, layer 2's and the rest's are not.
    par.inner.layers[2].fc.weight.register_hook(
        lambda g: injector.freeze("backward.after_first_bucket", rank=ctx.rank, step=state["step"]))
    busy = a["busy"]

    def keep_working(seconds: float) -> None:
        """Evaluation forwards (each publishes its layers) for ``seconds``: working, not silent."""
        end = time.monotonic() + seconds
        with torch.no_grad():
            while time.monotonic() < end:
                par.inner(torch.zeros(2, 16))
                time.sleep(0.1)

    def data():
        for step, batch in enumerate(batches(ctx.rank, a["steps"], seed=a["seed"])):
            injector.delay("dataloader", rank=ctx.rank, step=step)
            yield batch

    loss_fn = torch.nn.MSELoss()
    lagged = None  # the previous step's asynchronous metrics reduction, waited one step late (async_metrics)
    for step, (x, y) in enumerate(handle.wrap_dataloader(data())):
        state["step"] = step
        if injector.armed("step.start", "kill", rank=ctx.rank, step=step):
            os.kill(handle.observer_pid, 9)  # trainer and observer: the whole rank is gone
            injector.kill("step.start", rank=ctx.rank, step=step)
        if busy and step == busy["step"] and ctx.rank in busy["ranks"]:
            keep_working(busy["seconds"])
        if a["rank0_extra"] and ctx.rank == 0:  # asymmetric work: evaluation and a checkpoint write
            keep_working(0.0)
            with torch.no_grad():
                par.inner(x)
            with handle.checkpoint_io("write"):
                torch.save(par.inner.head.state_dict(), os.path.join(a["workdir"], "eval-r0.pt"))
        time.sleep(a["slow_phase_s"])  # a slow phase on every rank, without marks
        loss = loss_fn(par.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric, op = loss.detach().reshape(1), dist.ReduceOp.SUM
        if not injector.skip("metrics.all_reduce", rank=ctx.rank, step=step):
            metric, op = injector.mismatch("metrics.all_reduce", metric, op, rank=ctx.rank, step=step)
            work = dist.all_reduce(metric, op=op, group=metrics_group, async_op=a["async_metrics"])
            if lagged is not None:
                lagged.wait()
            lagged = work
        if (step + 1) % a["checkpoint_every"] == 0:
            with handle.checkpoint_io("write"):
                injector.delay("checkpoint.write", rank=ctx.rank, step=step)
                shard = {k: v.detach().clone() for k, v in par.inner.state_dict().items()}
                torch.save(shard, os.path.join(a["workdir"], f"ckpt-r{ctx.rank}.pt"))
    if lagged is not None:
        lagged.wait()
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


def _stack_problems(incidents: list[Any], *, rank: int, frame: str) -> list[str]:
    """The named rank's stacks at the verdict, as its observer wrote them to the file the record names, show
    ``frame`` (the line of its training thread where the fault holds it)."""
    paths = [i.evidence.get("stack_files", {}).get(str(rank)) for i in incidents]
    path = next((p for p in paths if p), None)
    if path is None:
        return [f"no record names a stack file for rank {rank}"]
    text = open(path).read() if os.path.exists(path) else ""
    return [] if frame in text else [f"rank {rank}'s stacks at the verdict ({path}) do not show {frame!r}: "
                                     f"{text[:400] or 'no file'}"]


def hang_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    jsonl = os.path.join(workdir, "incidents.jsonl")
    expect = [dict(e) for e in p.get("expect", [])]
    args = {
        "faults": list(spec.faults), "seed": spec.seed, "layout": p.get("layout", "ddp"),
        "steps": int(p.get("steps", 30)),
        # None: the shipped default (observer.silence_threshold_s, observer.gather_timeout_s)
        "threshold_s": p.get("threshold_s", 2.0), "gather_timeout_s": p.get("gather_timeout_s", 4.0),
        "checkpoint_every": int(p.get("checkpoint_every", 4)), "machines": int(p.get("machines", 1)),
        "busy": p.get("busy"), "rank0_extra": bool(p.get("rank0_extra", False)),
        "async_metrics": bool(p.get("async_metrics", False)), "bucket_cap_mb": p.get("bucket_cap_mb"),
        "slow_phase_s": float(p.get("slow_phase_s", 0.0)), "io_silence_s": p.get("io_silence_s"),
        "jsonl": jsonl, "run_id": spec.name, "workdir": workdir, "scout_set": list(p.get("scout_set", [])),
    }
    finishes = bool(p.get("finishes", False))  # the stall resolves itself: the job must end normally
    stop = _RecordsSettled(jsonl, settle_s=float(p.get("settle_s", 1.5))) if expect and not finishes else None
    # Killed ranks make their gloo peers fail; their observers must have time to answer for them.
    result = launch(_train_rank, world_size, timeout_s=spec.timeout_s, args=args, stop_when=stop,
                    failure_grace_s=spec.timeout_s, keep_groups=stop is not None)
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    problems = []
    if expect and not finishes:
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
    if p.get("stack"):
        problems += _stack_problems(incidents, **p["stack"])
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
