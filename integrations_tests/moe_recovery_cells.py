"""MoE recovery cells: certification waits for a whole recipe cycle of the expert recipe, and the emergency
sweep replays every expert on every catalog shape.

``moe-recovery-two-cycle``: one MoE layer with one local expert per EP position (4 experts over EP 4, DP 4)
and a shape catalog with two representatives (31 and 32 rows): one recipe cycle is two checks, and with the
dense recipe off the expert cycle is the whole of certification's coverage. Phase A trains with checkpoints
on; a step's snapshot becomes the candidate, is promoted once the next cycle is clean, and an expert SDC on
rank 9 after that stops the job (exit 75). Phase B starts from other weights and ``resume()`` must restore the
verified generation bitwise (weights and optimizer state on every rank).

``moe-recovery-sweep`` (``experts: 8``, ``crash_after``): two local experts, so a cycle is four checks (the
coverage: the two dense layers take two). At
the last step a stuck value appears in rank 9's *second* expert while that step's check replays the first:
the snapshot of that step holds corruption no check saw, and the job dies (every rank exits 3, no verdict).
The restart knows nothing of a fault; the emergency sweep restores the latest state, replays every expert on
every catalog shape, finds rank 9 and restores the verified generation instead.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch

import scout_core
from integrations_tests.moe_cells import start_moe_rank
from integrations_tests.moe_model import MoEConfig, build_model, sync_grads
from integrations_tests.recovery_cells import STOP_CODE
from scout_core.checkpoint.coordinator import read_records
from scout_core.checkpoint.memory import default_memory_root
from scout_core.checkpoint.snapshot import local_tensor
from scout_core.config import load
from scout_core.moe.catalog import MoESpec, build_catalog
from scout_core.moe.replay import MoEBinding
from scout_core.report import read_incidents
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.launcher import RankContext, init_gloo, launch

__all__ = ["moe_recovery_cell"]

CRASH_CODE = 3


def _model(a: dict[str, Any]) -> MoEConfig:
    return MoEConfig(depth=1, experts=a["experts"], capacity=8)


def _enable(model: Any, opt: torch.optim.Optimizer, a: dict[str, Any], world: int, rank: int) -> Any:
    ep = _model(a).ep
    binding = MoEBinding(layers=[b.moe for b in model.layers], names=["layers.0.moe"],
                         expert_peer_groups=[list(range(p, world, ep)) for p in range(ep)], ep_position=rank % ep)
    cfg = load(None, [f"replay.cadence.hidden={a['hidden']}", "replay.cadence.expert=1", "replay.cadence.embedding=0",
                      "replay.cadence.output=0", "replay.cadence.optimizer=0", "observer.enabled=false",
                      f"replay.moe_catalog={a['catalog']}", "checkpoint.enabled=true",
                      f"checkpoint.directory={a['store']}", "actions.on_verdict=stop",
                      f"actions.exit_code={STOP_CODE}", f"report.jsonl_path={a['jsonl']}",
                      f"report.run_id={a['run_id']}", "report.log_level=ERROR"])
    dense = [m for b in model.layers for m in (b.attn, b.moe.router)]
    return scout_core.enable(model, opt, config=cfg, layers=dense, moe=binding)


def _signatures(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    out = {f"param:{n}": sign_many([local_tensor(p.detach())])[0].signature for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt:{i}:{k}"] = sign_many([local_tensor(v)])[0].signature
    return out


def _phase_a(ctx: RankContext) -> dict[str, Any]:
    a = ctx.args
    cfg = _model(a)
    model, dp_group, state, opt = start_moe_rank(ctx, cfg)
    handle = _enable(model, opt, a, ctx.world_size, ctx.rank)
    gen = torch.Generator().manual_seed(1000 * a["seed"] + ctx.rank)

    def data() -> Any:
        for _ in range(a["steps"]):
            yield torch.randn(2, 12, cfg.dim_in, generator=gen), torch.randn(2, 12, cfg.dim_out, generator=gen)

    try:
        for step, (x, y) in enumerate(handle.wrap_dataloader(data()), start=1):
            state["step"] = step
            torch.nn.functional.mse_loss(model(x), y).backward()
            sync_grads(model, dp_group)
            opt.step()  # the boundary: replay, certification, and on a verdict the stop at the next fetch
            opt.zero_grad()
            with open(os.path.join(a["workdir"], f"ref-r{ctx.rank}-s{step}.json"), "w") as fh:
                json.dump(_signatures(model, opt), fh)
            handle.flush()  # each generation complete before the next (exact expectations)
            if step == a["crash_after"]:
                os._exit(CRASH_CODE)  # the job dies (no verdict, no close): only its snapshots are left
    finally:
        handle.close()
    return {"steps": a["steps"]}


def _phase_b(ctx: RankContext) -> dict[str, Any]:
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // 8}"
    init_gloo(ctx, timeout_s=120)
    a = ctx.args
    model, _, _ = build_model(_model(a), seed=a["seed"] + 17)  # other weights: the restore must overwrite them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = _enable(model, opt, a, ctx.world_size, ctx.rank)
    try:
        result = handle.resume()
        got = _signatures(model, opt)
    finally:
        handle.close(discard_snapshots=True)
    want = {}
    if result.step is not None:
        with open(os.path.join(a["workdir"], f"ref-r{ctx.rank}-s{result.step}.json")) as fh:
            want = json.load(fh)
    return {"source": result.source, "generation": result.step, "reason": result.reason,
            "mismatched": [k for k in want if want[k] != got.get(k)]}


def moe_recovery_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    catalog = os.path.join(workdir, "catalog.json")
    crash_after = p.get("crash_after")
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 10)), "catalog": catalog,
            "store": os.path.join(workdir, "store"), "jsonl": os.path.join(workdir, "incidents.jsonl"),
            "workdir": workdir, "run_id": spec.name, "experts": int(p.get("experts", 4)),
            "hidden": int(p.get("hidden_every", 1)),
            "crash_after": crash_after}
    model = _model(args)
    build_catalog(MoESpec(layers=("layers.0.moe",), hidden=model.hidden, ffn=model.ffn, experts=model.experts,
                          ep_size=model.ep, capacity=model.ep * model.capacity)).save(catalog)
    expect = p["expect"]
    problems: list[str] = []
    start = time.monotonic()
    memory_root = default_memory_root(args["store"])
    b_result = None
    try:
        a_result = launch(_phase_a, world_size, timeout_s=spec.timeout_s, args=args)
        codes = sorted({o.exitcode for o in a_result.outcomes})
        want_code = STOP_CODE if crash_after is None else CRASH_CODE
        if codes != [want_code]:
            problems.append(f"phase A should end every trainer with exit {want_code}: exits {codes}\n"
                            + a_result.failures())
        b_result = launch(_phase_b, world_size, timeout_s=spec.timeout_s, args=args)
        if not b_result.ok:
            problems.append("phase B: " + b_result.failures())
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
    incidents = list(read_incidents(args["jsonl"])) if os.path.exists(args["jsonl"]) else []
    got_inc = sorted({(i.kind.value, i.scope.value, tuple(sorted(i.ranks))) for i in incidents})
    want_inc = sorted({(i["kind"], i["scope"], tuple(i["ranks"])) for i in expect["incidents"]})
    if got_inc != want_inc:
        problems.append(f"incidents {got_inc}, expected {want_inc}")
    decisions = [d for d in read_records(os.path.join(args["store"], "decisions.jsonl"))
                 if d.get("record") == "decision"]
    if crash_after is None and (not decisions
                                or decisions[0].get("incident", {}).get("ranks") != expect["incidents"][0]["ranks"]):
        problems.append(f"the stop decision should carry the expert verdict: {decisions[:1]}")
    if crash_after is not None and [(d.get("failure"), d.get("sweep_clean")) for d in decisions] != [("other", False)]:
        problems.append(f"the crashed job took no decision and the restart's sweep should have found SDC: {decisions}")
    if "reason" in expect and b_result is not None and b_result.ok:
        reasons = {v["reason"] for v in b_result.values()}
        if not all(expect["reason"] in r for r in reasons):
            problems.append(f"resume reasons {sorted(reasons)}, expected one containing {expect['reason']!r}")
    if b_result is not None and b_result.ok:
        values = b_result.values()
        got = {(v["source"], v["generation"]) for v in values}
        if got != {(expect["source"], expect["generation"])}:
            problems.append(f"restored {sorted(got)}, expected {(expect['source'], expect['generation'])}")
        bad = {r: v["mismatched"][:3] for r, v in enumerate(values) if v["mismatched"]}
        if bad:
            problems.append(f"restore not bitwise on ranks {bad}")
    return CellReport(name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
                      injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents],
                      details="\n".join(problems), wall_s=time.monotonic() - start)
