"""Certified-recovery cells: a fault, a retrieval decision, and a bitwise restore in fresh processes.

Phase A trains the tiny model (DDP, FSDP2 or HSDP) with a check at every step
(the in-situ replay stand-in until the replay issue lands: every rank runs the
sampled layer on an input broadcast from a rotating source; exact C3 on the
output signature, statistical C3 on its compute time, a straggler confirmed
over two rounds) feeding the checkpoint coordinator. After every capture each
rank records the signatures of its live state (parameters, AdamW state, RNG,
caller-owned state) as the reference. The injected fault then ends phase A:
persistent SDC (decision in phase A: verified), a straggler (latest), or a
frozen rank that the hang observer names (the job is killed).

Phase B is a fresh set of processes. It reads the decision (for a hang it
decides itself: an emergency sweep of the recipe on the latest state, latest
only if clean), agrees on the generation across ranks, restores it into newly
built objects and compares the signatures with the reference: bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

import scout_core
from integrations_tests.models import batches, build, start_rank
from scout_core.cells import CellReport, CellSpec, fault_dicts
from scout_core.checkpoint.certify import BoundaryEvidence, Certifier, FailureKind, decide_retrieval
from scout_core.checkpoint.coordinator import (
    CheckpointCoordinator,
    agree_on_latest,
    load_latest,
    memory_dir_for,
    record_decision,
)
from scout_core.checkpoint.snapshot import SnapshotEngine, local_tensor, restore_state
from scout_core.checkpoint.store import DurableStore, agree_on_generation
from scout_core.config import load
from scout_core.consensus import C3Status, Confirmation, StatisticalRule, c3_exchange
from scout_core.inject import Injector
from scout_core.launcher import RankContext, init_gloo, launch
from scout_core.report import Incident, IncidentKind, IncidentScope, JsonlSink, Reporter, read_incidents
from scout_core.signature import sign_many

HIDDEN = 32


def _hosts(world: int) -> dict[int, str]:
    per = max(1, world // 2)  # two simulated machines
    return {r: f"node{r // per}" for r in range(world)}


def state_signatures(par: Any, opt: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    """Signatures of everything a bitwise resume must reproduce."""
    model = {k: local_tensor(v) for k, v in par.model.state_dict().items()}
    optim = []
    for p in (p for g in opt.param_groups for p in g["params"]):
        for _name, v in sorted(opt.state[p].items()):
            if isinstance(v, torch.Tensor):
                optim.append(local_tensor(v))
    names = sorted(model)
    sigs = sign_many([model[k] for k in names] + optim + [torch.get_rng_state()])
    return {"model": [s.signature for s in sigs[: len(names)]],
            "optim": [s.signature for s in sigs[len(names):-1]],
            "rng": sigs[-1].signature, "extra": json.dumps(extra, sort_keys=True)}


class _Check:
    """The per-step check: sampled layer on broadcast input; exact and statistical C3."""

    def __init__(self, par: Any, injector: Injector, rank: int, rule: StatisticalRule,
                 before_freeze: Any = None) -> None:
        self.layer = par.inner.layers[1]
        self.before_freeze = before_freeze
        self.in_check = False
        self.injector, self.rank, self.rule = injector, rank, rule
        self.confirm = Confirmation(rounds=2)
        self.step = 0
        self.t0 = 0.0
        self.elapsed = 0.0
        # Hook order: FSDP's (unshard / reshard) first, then the fault, then the timer.
        self.layer.register_forward_pre_hook(self._start)
        self.layer.register_forward_hook(self._fault)
        self.layer.register_forward_hook(self._stop)

    def _start(self, *_: Any) -> None:
        self.t0 = time.perf_counter()

    def _fault(self, _m: Any, _a: Any, out: torch.Tensor) -> None:
        if self.in_check and self.before_freeze is not None and any(
                f.surface == "check.forward" and f.rank == self.rank and f.schedule.active(self.step)
                for f in self.injector.faults):
            # Let in-flight persistence finish first, so the cell's expected generation is exact
            # (otherwise the newest generation every rank holds may be one older: the vote handles it).
            self.before_freeze()
        if self.in_check:
            self.injector.freeze("check.forward", rank=self.rank, step=self.step)
        self.injector.delay("layers.1.compute", rank=self.rank, step=self.step)
        with torch.no_grad():
            self.injector.corrupt("layers.1.output", out, rank=self.rank, step=self.step)

    def _stop(self, *_: Any) -> None:
        self.elapsed = time.perf_counter() - self.t0

    @torch.no_grad()
    def run(self, step: int) -> dict[str, Any]:
        world = dist.get_world_size()
        src = step % world  # rotate the source so one faulty source cannot poison every check
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1000 + step))
        dist.broadcast(x, src)
        self.in_check = True
        try:
            out = self.layer(x)
        finally:
            self.in_check = False
        (sdc,) = c3_exchange([sign_many([out])[0].signature], surfaces=["layers.1.output"])
        (timing,) = c3_exchange([self.elapsed], surfaces=["layers.1.compute"], rule=self.rule)
        confirmed = self.confirm.update(timing)
        return {"sdc": sdc, "timing": timing, "straggler": confirmed}


def _phase_a(ctx: RankContext) -> dict[str, Any]:
    a, injector, par, opt = start_rank(ctx, timeout_s=600)
    extra = {"tokens": 0}
    hosts = _hosts(ctx.world_size)
    reporter = Reporter([JsonlSink(a["incidents"])], run_id=a["run_id"], rank=ctx.rank)
    cfg = load(None, ["observer.silence_threshold_s=2.0", "observer.gather_timeout_s=4.0",
                      f"report.jsonl_path={a['incidents']}", f"report.run_id={a['run_id']}", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh)
    engine = SnapshotEngine([par.model], [opt], get_extra=lambda: dict(extra))
    store = DurableStore(a["store"], ctx.rank, ctx.world_size)
    coord = CheckpointCoordinator(engine, store, Certifier(recipes_per_cycle=a["recipes"], static=a["recipes"] == 1),
                                  run_id=a["run_id"], hosts=hosts, replicate=a["replicate"],
                                  decisions_path=a["decisions"])
    _install_persist_kill(coord, injector, ctx.rank)
    check = _Check(par, injector, ctx.rank, StatisticalRule(**a["rule"]), before_freeze=coord.flush)
    loss_fn = torch.nn.MSELoss()
    outcome: dict[str, Any] = {"stopped_at": None}
    for step, (x, y) in enumerate(handle.wrap_dataloader(batches(ctx.rank, a["steps"], seed=a["seed"])), start=1):
        check.step = step
        loss_fn(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        extra["tokens"] += x.shape[0]
        result = check.run(step)
        sdc, straggler = result["sdc"], result["straggler"]
        evidence = BoundaryEvidence(sdc=sdc.status is C3Status.ATTRIBUTED,
                                    inconclusive=sdc.status is C3Status.INCONCLUSIVE, straggler=bool(straggler))
        action = coord.on_boundary(step, evidence)
        if action.value.startswith("capture"):
            with open(os.path.join(a["workdir"], f"ref-r{ctx.rank}-s{step}.json"), "w") as fh:
                json.dump(state_signatures(par, opt, extra), fh)
        if evidence.sdc or straggler:
            kind = FailureKind.SDC if evidence.sdc else FailureKind.STRAGGLER
            ranks = list(sdc.outlier_ranks) if evidence.sdc else list(straggler)
            inc = Incident(kind=IncidentKind.SDC if evidence.sdc else IncidentKind.STRAGGLER,
                           scope=IncidentScope.RANK, ranks=ranks, hosts=[hosts[r] for r in ranks],
                           devices=["cpu"] * len(ranks), step=step,
                           surface="layers.1.output" if evidence.sdc else "layers.1.compute",
                           evidence=(sdc if evidence.sdc else result["timing"]).to_dict(),
                           reason="replayed output differs from the majority" if evidence.sdc
                           else "sampled-layer compute slower than peers in two consecutive rounds")
            if ctx.rank == min(r for r in range(ctx.world_size) if r not in ranks):
                reporter.emit(inc)
            coord.decide(kind, incident=inc.to_dict())
            outcome["stopped_at"] = step
            break
    coord.flush()
    dist.barrier()
    engine.close()
    handle.close()
    return outcome


def _install_persist_kill(coord: CheckpointCoordinator, injector: Injector, rank: int) -> None:
    """For recovery-kill-during-persist: SIGKILL this rank half-way through writing a shard."""
    real_write = coord.store.write

    def write(generation: int, state: dict[str, Any], role: str = "candidate") -> str:
        if injector.armed("checkpoint.persist", "kill", rank=rank, step=generation):
            import io

            shard = os.path.join(coord.store.root, f"gen-{generation:09d}", f"rank-{rank:05d}.pt")
            os.makedirs(os.path.dirname(shard), exist_ok=True)
            buf = io.BytesIO()
            torch.save(state, buf)
            with open(shard + f".tmp-{os.getpid()}", "wb") as fh:
                fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])  # half a shard, then the machine dies
            injector.kill("checkpoint.persist", rank=rank, step=generation)
        return real_write(generation, state, role)

    coord.store.write = write  # type: ignore[method-assign]


def _phase_b(ctx: RankContext) -> dict[str, Any]:
    init_gloo(ctx, timeout_s=300)
    a = ctx.args
    par = build(a["layout"], seed=a["seed"] + 17)  # different initial weights: the restore must overwrite them
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
    extra: dict[str, Any] = {}
    store = DurableStore(a["store"], ctx.rank, ctx.world_size)
    decisions = _read_decisions(a["decisions"])
    latest = agree_on_latest(a["run_id"])
    verified = agree_on_generation(store, "verified")
    if decisions:
        decision = decisions[-1]
    else:
        # The job died without a numerical verdict: the certifier is rebuilt from what every rank
        # holds (latest in memory, verified on disk) and the retrieval policy decides.
        certifier = Certifier(latest=latest, verified=verified)
        sweep = None
        if a["failure"] == FailureKind.OTHER:  # hang or crash: emergency sweep of the latest state
            check = _Check(par, Injector([], seed=0), ctx.rank, StatisticalRule(**a["rule"]))

            def sweep() -> bool:
                restore_state([par.model], [opt], load_latest(a["run_id"], ctx.rank, latest), set_extra=extra.update)
                return check.run(latest)["sdc"].status is C3Status.AGREE

        d = decide_retrieval(certifier, FailureKind(a["failure"]), sweep=sweep)
        decision = asdict(d)
        if ctx.rank == 0:
            record_decision(a["decisions"], d, certifier=certifier)
    gen = decision["generation"]
    if decision["source"] == "verified":
        if verified != gen:
            # A generation one rank cannot load intact is not selectable: fall back to the
            # newest verified generation every rank holds (the rank-consistency vote).
            gen = verified
        snap = store.load(gen)
    else:
        snap = load_latest(a["run_id"], ctx.rank, gen)
    restore_state([par.model], [opt], snap, set_extra=extra.update)
    got = state_signatures(par, opt, extra)
    with open(os.path.join(a["workdir"], f"ref-r{ctx.rank}-s{gen}.json")) as fh:
        want = json.load(fh)
    mismatched = [k for k in want if want[k] != got[k]]
    return {"decision": decision, "restored_generation": gen, "mismatched": mismatched,
            "committed": sorted(store.local_generations())}


def _read_decisions(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def recovery_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    run_id = f"{spec.name}-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
    args = {
        "faults": list(spec.faults), "seed": spec.seed, "layout": p.get("layout", "ddp"),
        "steps": int(p.get("steps", 10)), "recipes": int(p.get("recipes_per_cycle", 1)),
        "replicate": bool(p.get("replicate", p.get("layout", "ddp") != "ddp")),
        "rule": dict(p.get("rule", {"min_ratio": 2.0, "min_delta": 0.1})),
        "incidents": os.path.join(workdir, "incidents.jsonl"), "decisions": os.path.join(workdir, "decisions.jsonl"),
        "store": os.path.join(workdir, "store"), "workdir": workdir, "run_id": run_id,
        "failure": p.get("failure_after_crash", "other"),
    }
    expect = p["expect"]
    problems: list[str] = []
    try:
        stop = (lambda: os.path.exists(args["incidents"]) and len(list(read_incidents(args["incidents"]))) > 0) \
            if expect.get("ends") == "hang" else None
        a_result = launch(_phase_a, world_size, timeout_s=spec.timeout_s, args=args, stop_when=stop)
        if expect.get("ends") == "hang":
            if not a_result.stopped:
                problems.append("phase A should have hung and been diagnosed: " + a_result.failures())
        elif expect.get("ends") == "kill":
            if a_result.ok:
                problems.append("phase A should have lost a rank during persistence")
        elif not a_result.ok:
            problems.append("phase A: " + a_result.failures())
        b_result = launch(_phase_b, world_size, timeout_s=spec.timeout_s, args=args)
        if not b_result.ok:
            problems.append("phase B: " + b_result.failures())
    finally:
        shutil.rmtree(memory_dir_for(run_id), ignore_errors=True)
    incidents = list(read_incidents(args["incidents"])) if os.path.exists(args["incidents"]) else []
    got_inc = [{"kind": i.kind.value, "scope": i.scope.value, "ranks": sorted(i.ranks)} for i in incidents]
    if got_inc != expect.get("incidents", []):
        problems.append(f"incidents {got_inc}, expected {expect.get('incidents', [])}")
    decisions = _read_decisions(args["decisions"])
    if b_result.ok:
        values = b_result.values()
        restored = {v["restored_generation"] for v in values}
        want_dec = (expect["source"], expect["generation"])
        got_dec = (values[0]["decision"]["source"], values[0]["restored_generation"])
        if restored != {expect["generation"]} or got_dec != want_dec:
            problems.append(f"restored {sorted(restored)} via {got_dec[0]}, expected {want_dec}")
        if expect.get("reason") and expect["reason"] not in values[0]["decision"]["reason"]:
            problems.append(f"decision reason {values[0]['decision']['reason']!r} lacks {expect['reason']!r}")
        skipped = expect.get("vote_skips")
        if skipped is not None:
            holders = [r for r, v in enumerate(values) if skipped in v["committed"]]
            killed = {f.rank for f in spec.faults}
            if not holders or killed & set(holders):
                problems.append(f"generation {skipped} should be committed on some ranks but not on {sorted(killed)}; "
                                f"holders: {holders}")
        bad = {r: v["mismatched"] for r, v in enumerate(values) if v["mismatched"]}
        if bad:
            problems.append(f"restore not bitwise on ranks {bad}")
    return CellReport(
        name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
        injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents] + [
            {"kind": "decision", "scope": d.get("source", "?"), "ranks": [], "surface": str(d.get("generation")),
             "reason": d.get("reason", "")} for d in decisions],
        details="\n".join(problems),
    )
