"""Certified-recovery cells: the product's own detection, decision and restart path, end to end.

Phase A trains the tiny model (DDP, FSDP2 or HSDP) with SCOUT switched on by
configuration alone (``scout_core.enable``: replay every step, certified
snapshots, ``actions.on_verdict: stop``). Faults are injected inside the model
(a bit flip in a block's output, a slow block, a frozen rank, a dead machine),
so SCOUT's replay engine, observer and coordinator must find them: nothing in
this file detects, decides or restores. After every step each rank records the
signatures of its live state (parameters, AdamW state, RNG, caller state) as
the reference for a bitwise restore.

Phase B is a fresh set of processes with freshly initialized (different)
weights. It calls ``handle.resume()`` and compares the restored state with the
reference of the generation the product chose.

Settings that differ from the shipped defaults, and why: every recipe is replayed
every step (cadence 1, not 20) so a 10-step cell reaches its verdicts, and
certification is ``last_check_only`` (shipped: ``coverage``) so that these cells,
which prove the restart's mechanisms (the stop, the decision, a bitwise restore, a
peer's replica, a kill while persisting), have verified generations within 10 steps;
the hang observer's silence threshold and gather timeout are 5 s (shipped: 60 s and
10 s) so a hang cell ends in seconds. The consensus rule is the shipped one. The
shipped certification rule is held at the shipped defaults by
:mod:`integrations_tests.recovery_defaults_cells`. Most cells
flush after every step so that generations are exact; ``ddp-recovery-sdc-async``
does not, as a real training loop does not.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

import scout_core
from integrations_tests.models import batches, build, install_block_faults, start_rank
from scout_core.checkpoint.coordinator import read_records
from scout_core.checkpoint.memory import default_memory_root
from scout_core.checkpoint.snapshot import local_tensor
from scout_core.config import load
from scout_core.report import read_incidents
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, launch

STOP_CODE = 75


def machine_of(rank: int, world: int) -> str:
    return f"node{rank // max(1, world // 2)}"  # two simulated machines


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


class _Tokens:
    """Caller state (stands for a data-loader position): snapshots must carry and restore it."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def _config(a: dict[str, Any]) -> Any:
    if a.get("defaults"):  # the shipped defaults but for what a recovery run must say (recovery_defaults_cells)
        return load(None, [
            "checkpoint.enabled=true", f"checkpoint.directory={a['store']}", "actions.on_verdict=stop",
            f"actions.exit_code={STOP_CODE}", f"report.jsonl_path={a['incidents']}", f"report.run_id={a['run_id']}",
            "report.log_level=ERROR", *a["overrides"]])
    return load(None, [
        "replay.cadence.embedding=1", "replay.cadence.hidden=1", "replay.cadence.output=1",
        "replay.cadence.optimizer=1", "replay.optimizer_slice_elems=256",
        "observer.silence_threshold_s=5.0", "observer.gather_timeout_s=5.0",
        "checkpoint.enabled=true", f"checkpoint.directory={a['store']}",
        f"checkpoint.certify={a['certify']}", f"checkpoint.replicate_to_peer={a['replicate']}",
        "actions.on_verdict=stop", f"actions.exit_code={STOP_CODE}",
        f"report.jsonl_path={a['incidents']}", f"report.run_id={a['run_id']}", "report.log_level=ERROR",
        *a["overrides"],
    ])


def _phase_a(ctx: RankContext) -> dict[str, Any]:
    os.environ[HOSTNAME_ENV] = machine_of(ctx.rank, ctx.world_size)
    a, injector, par, opt = start_rank(ctx, timeout_s=600)
    state: dict[str, Any] = {"step": 0}
    install_block_faults(par, injector, ctx.rank, state)
    def slow(*_: Any) -> None:  # a slow device is slow in every layer
        injector.delay("compute", rank=ctx.rank, step=state["step"])

    for block in par.inner.layers:
        block.fc.register_forward_hook(slow)
    par.inner.layers[1].register_forward_pre_hook(
        lambda *_: injector.freeze("layers.1.forward", rank=ctx.rank, step=state["step"]))
    tokens = _Tokens()
    handle = scout_core.enable(par.model, opt, config=_config(a), mesh=par.mesh, state={"tokens": tokens})
    _install_persist_kill(handle, injector, ctx.rank)

    def freeze_in_replay(*_: Any) -> None:  # a device that hangs while SCOUT replays on it
        if handle.replay.replaying:
            injector.freeze("replay.forward", rank=ctx.rank, step=state["step"])

    for block in par.inner.layers:
        block.fc.register_forward_hook(freeze_in_replay)
    loss_fn = torch.nn.MSELoss()
    try:
        for step, (x, y) in enumerate(handle.wrap_dataloader(batches(ctx.rank, a["steps"], seed=a["seed"])), start=1):
            state["step"] = step
            if step == a["kill_step"]:
                dist.barrier()  # generation step-1 is complete everywhere before the machine dies
                injector.kill("machine", rank=ctx.rank, step=step)
            loss_fn(par.model(x), y).backward()
            opt.step()  # SCOUT's boundary runs in the step hook
            opt.zero_grad()
            tokens.seen += x.shape[0]  # after the step, like a scheduler: the snapshot still gets it
            # The state a snapshot of this step must hold; on a verdict ScoutStop comes at the next fetch.
            if a.get("ref_every", 1):
                with open(os.path.join(a["workdir"], f"ref-r{ctx.rank}-s{step}.json"), "w") as fh:
                    json.dump(state_signatures(par, opt, tokens.state_dict()), fh)
            if a["flush"]:  # each generation complete before the next (exact expectations)
                handle.flush()
    finally:
        handle.close()
    return {"steps": a["steps"]}


def _install_persist_kill(handle: Any, injector: Injector, rank: int) -> None:
    """recovery-kill-during-persist: SIGKILL this rank half-way through writing a durable shard."""
    store = handle.checkpoint.store
    real_write = store.write_file

    def write_file(generation: int, source: str, role: str = "candidate") -> str:
        if injector.armed("checkpoint.persist", "kill", rank=rank, step=generation):
            shard = os.path.join(store.root, f"gen-{generation:09d}", f"rank-{rank:05d}.pt")
            os.makedirs(os.path.dirname(shard), exist_ok=True)
            with open(source, "rb") as src, open(shard + f".tmp-{os.getpid()}", "wb") as fh:
                data = src.read()
                fh.write(data[: len(data) // 2])  # half a shard, then the machine dies
            injector.kill("checkpoint.persist", rank=rank, step=generation)
        return real_write(generation, source, role)

    store.write_file = write_file  # type: ignore[method-assign]


def _phase_b(ctx: RankContext) -> dict[str, Any]:
    os.environ[HOSTNAME_ENV] = machine_of(ctx.rank, ctx.world_size)
    init_gloo(ctx, timeout_s=300)
    a = ctx.args
    par = build(a["layout"], seed=a["seed"] + 17, bias=a.get("bias", True),  # other weights: the restore overwrites
                hsdp_replicas=a.get("replicas", 4), depth=a.get("depth", 3), norm_weight=a.get("norm_weight", True))
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-3)
    tokens = _Tokens()
    if a.get("defect_persists"):
        # A defective unit stays in its machine across a restart on the same machines: what the restart's
        # sweep replays on this rank meets it too (a persistent defect, active at any step).
        install_block_faults(par, Injector(a["faults"], seed=a["seed"]), ctx.rank, {"step": 1 << 30})
    handle = scout_core.enable(par.model, opt, config=_config(a), mesh=par.mesh, state={"tokens": tokens})
    committed = sorted(handle.checkpoint.store.local_generations())  # before resume prunes unsafe ones
    try:
        result = handle.resume(a["failure"])
        got = state_signatures(par, opt, tokens.state_dict())
        coord = handle.checkpoint
        # What a second restart could still find newer than what was restored (must be nothing).
        newer = [] if result.step is None else sorted(
            [s for _, o, s in coord.memory.slots().values() if s > result.step and o in (ctx.rank, *coord.sources)]
            + [g for g in coord.store.local_generations(check_bytes=False) if g > result.step])
    finally:
        handle.close(discard_snapshots=True)
    ref = os.path.join(a["workdir"], f"ref-r{ctx.rank}-s{result.step}.json")
    want = json.load(open(ref)) if result.step is not None and a.get("ref_every", 1) else {}
    return {"got": got, "source": result.source, "generation": result.step, "reason": result.reason,
            "from_memory": result.from_memory, "fetched": result.fetched,
            "mismatched": [k for k in want if want[k] != got[k]],
            "committed": committed, "newer": newer}


def recovery_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    layout = p.get("layout", "ddp")
    args = {
        "faults": list(spec.faults), "seed": spec.seed, "layout": layout, "steps": int(p.get("steps", 10)),
        "certify": p.get("certify", "last_check_only"), "replicate": bool(p.get("replicate", True)),
        "incidents": os.path.join(workdir, "incidents.jsonl"), "store": os.path.join(workdir, "store"),
        "workdir": workdir, "run_id": spec.name, "failure": p.get("failure_after_crash"),
        "overrides": list(p.get("overrides", [])),
        "kill_step": next((f.schedule.start for f in spec.faults if f.surface == "machine"), None),
        "flush": bool(p.get("flush_each_step", True)),
    }
    expect = p["expect"]
    problems: list[str] = []
    start = time.monotonic()
    memory_root = default_memory_root(args["store"])
    try:
        a_result = launch(_phase_a, world_size, timeout_s=spec.timeout_s, args=args)
        ends = expect.get("ends", "stop")
        codes = sorted({o.exitcode for o in a_result.outcomes})
        if ends == "stop" and codes != [STOP_CODE]:
            problems.append(f"phase A should stop every trainer with exit {STOP_CODE}: exits {codes}\n"
                            + a_result.failures())
        elif ends == "hang":
            # The observers terminate their trainers (SIGTERM); a trainer whose collective fails first
            # as its peers go may exit with an error instead. Only the frozen rank is left for the launcher.
            frozen = {f.rank for f in spec.faults}
            left = [o.rank for o in a_result.outcomes if o.rank not in frozen and o.error in (
                "killed at timeout", "killed after a peer failed")]
            if left or -15 not in codes:
                problems.append(f"phase A: the observers should have terminated the blocked trainers: exits "
                                f"{[o.exitcode for o in a_result.outcomes]}, left running: {left}")
        elif ends == "kill" and a_result.ok:
            problems.append("phase A should have lost a machine")
        for host in expect.get("lose_memory_of", []):  # the machine was replaced: its RAM is gone
            shutil.rmtree(os.path.join(memory_root, host), ignore_errors=True)
        b_result = launch(_phase_b, world_size, timeout_s=spec.timeout_s, args=args)
        if not b_result.ok:
            problems.append("phase B: " + b_result.failures())
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
    incidents = list(read_incidents(args["incidents"])) if os.path.exists(args["incidents"]) else []
    got_inc = sorted({(i.kind.value, i.scope.value, tuple(sorted(i.ranks))) for i in incidents})
    want_inc = sorted({(i["kind"], i["scope"], tuple(i["ranks"])) for i in expect.get("incidents", [])})
    if got_inc != want_inc:
        problems.append(f"incidents {got_inc}, expected {want_inc}")
    if b_result.ok:
        values = b_result.values()
        got = {(v["source"], v["generation"]) for v in values}
        at_most = expect.get("generation_at_most")
        if at_most is not None:  # persistence in the background may skip a busy boundary's capture
            if len(got) != 1 or next(iter(got))[0] != expect["source"] or not 1 <= (next(iter(got))[1] or 0) <= at_most:
                problems.append(f"restored {sorted(got)}, expected one {expect['source']} generation in 1..{at_most}")
        elif got != {(expect["source"], expect["generation"])}:
            problems.append(f"restored {sorted(got)}, expected {(expect['source'], expect['generation'])}")
        if expect.get("reason") and expect["reason"] not in values[0]["reason"]:
            problems.append(f"decision reason {values[0]['reason']!r} lacks {expect['reason']!r}")
        fetched = sorted(r for r, v in enumerate(values) if v["fetched"])
        if fetched != sorted(expect.get("fetched", [])):
            problems.append(f"ranks that fetched their shard from a peer replica: {fetched}, "
                            f"expected {expect.get('fetched', [])}")
        skipped = expect.get("vote_skips")
        if skipped is not None:
            holders = [r for r, v in enumerate(values) if skipped in v["committed"]]
            killed = {f.rank for f in spec.faults}
            if not holders or killed & set(holders):
                problems.append(f"generation {skipped} should be committed on some ranks but not on {sorted(killed)}; "
                                f"holders: {holders}")
        newer = {r: v["newer"] for r, v in enumerate(values) if v["newer"]}
        if newer and expect["source"] == "verified":
            problems.append(f"snapshots newer than the restored generation survive the resume: {newer}")
        bad = {r: v["mismatched"] for r, v in enumerate(values) if v["mismatched"]}
        if bad:
            problems.append(f"restore not bitwise on ranks {bad}")
    decisions = read_records(os.path.join(args["store"], "decisions.jsonl"))
    return recovery_report(spec, world_size, problems, incidents, decisions, start)


def recovery_report(spec: CellSpec, world_size: int, problems: list[str], incidents: list[Any],
                    decisions: list[dict[str, Any]], start: float) -> CellReport:
    """A recovery cell's report: its incident records and the product's retrieval decisions."""
    return CellReport(
        name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
        injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents] + [
            {"kind": d.get("record", "decision"), "scope": d.get("source", "?"), "ranks": [],
             "surface": str(d.get("generation")), "reason": d.get("reason", "")} for d in decisions],
        details="\n".join(problems), wall_s=time.monotonic() - start,
    )
