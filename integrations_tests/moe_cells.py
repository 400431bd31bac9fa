"""MoE cells: 16 ranks, EP 4 x DP 4, SCOUT switched on by ``scout_core.enable(..., moe=...)``.

The dense recipe replays attention and the router of each block among all 16 ranks (their weights are
replicated everywhere); the expert recipe replays one local expert per check among its 4 replicas, on the
representative shapes of a shape catalog built for the model by :func:`scout_core.moe.catalog.build_catalog`
(row counts 0..32 per expert: representatives 31 and 32, a recipe cycle of 2 layers x 2 experts x 2 shapes).

Faults (``faults`` in configs/cells.yaml), all on rank 9 unless a cell says otherwise:

* ``experts.weight``: a stuck value in local expert 0 of layer 0's up projection, as its compute reads it
  (``experts.<i>.weight``: the same in local expert i);
* ``experts.output``: local expert 0's output in layer 0 (``drift``: a nondeterministic expert kernel);
* ``router.output``: a corrupted router logit in layer 0;
* ``experts.row_tail``: a defect that only 15-row tail tiles of the tiled expert GEMM execute (every rank
  computes experts with :class:`~scout_core.moe.paths.ReferenceGroupedGemm`): only row counts of 15 mod 16
  show it;
* ``experts.gemv``: with ``kernel: switching`` (:mod:`integrations_tests.moe_kernel`, a kernel SCOUT has no
  model of), a defect of its matrix-vector path, which only experts given 4 rows or fewer run;
* ``collective`` (``delay``): this rank's AllToAll and all-reduce calls wait first, as a slow endpoint would;
* ``compute`` (``delay``): every dense part (attention, router) burns CPU first, as a slow device would;
  ``compute.attention``: only attention does (a unit only one kind of kernel exercises);
* ``dataloader`` (``delay``): this rank's next batch arrives late (a stalled input pipeline);
* ``alltoall.send`` / ``alltoall.recv``: one value of every AllToAll transfer this rank sends / receives.

Each expert check also replays the AllToAll with one communication plan (scout_core.moe.alltoall).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

import integrations_tests.moe_kernel as moe_kernel
import scout_core
from integrations_tests.expect import record_problems
from integrations_tests.hang_cells import _RecordsSettled
from integrations_tests.moe_kernel import SwitchingExpertKernel
from integrations_tests.moe_model import MoEConfig, build_model, sync_grads
from scout_core.config import load
from scout_core.moe.catalog import KernelOpProfiler, MoESpec, build_catalog
from scout_core.moe.paths import ReferenceGroupedGemm
from scout_core.moe.replay import MoEBinding
from scout_core.report import read_incidents
from scout_core.runtime import HOSTNAME_ENV
from scout_core.testing.cells import CellReport, CellSpec, fault_dicts
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, launch

__all__ = ["moe_cell"]

MODEL = MoEConfig(capacity=8)  # per source rank: an expert receives 0..ep x 8 = 32 rows
SWITCHING = "integrations_tests.moe_kernel:expert"


def _install(model: Any, injector: Injector, rank: int, state: dict[str, Any], kernel: str = "reference") -> None:
    moe0 = model.layers[0].moe
    expert0 = moe0.experts[0]

    def weight_fault(*_: Any) -> None:
        with torch.no_grad():
            injector.corrupt("experts.weight", expert0.up, rank=rank, step=state["step"])

    def router_fault(_m: Any, _a: Any, out: torch.Tensor) -> None:
        with torch.no_grad():
            injector.corrupt("router.output", out, rank=rank, step=state["step"])

    def path_fault(role: str, tile: torch.Tensor) -> None:
        # A defect that only a 15-row tail tile executes (say, a masked store of its last row): only row
        # counts of 15 mod 16 show it; training here routes ~24 rows (a tail of ~8).
        if role == "row_tail" and tile.shape[0] == 15:
            with torch.no_grad():
                injector.corrupt("experts.row_tail", tile, rank=rank, step=state["step"])

    def slowed(real: Any) -> Any:
        def slow_collective(*args: Any, **kwargs: Any) -> Any:  # a slow endpoint: this rank's link
            injector.delay("collective", rank=rank, step=state["step"])
            return real(*args, **kwargs)
        return slow_collective

    def corrupting(real: Any) -> Any:
        def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                              input_split_sizes: Any = None, **kwargs: Any) -> Any:
            # A corrupting endpoint: one value of every transfer this rank sends (`alltoall.send`) or receives
            # (`alltoall.recv`); activations only, never the integer split counts.
            dense = input.is_floating_point() and input_split_sizes is not None
            if dense:
                _corrupt_each("alltoall.send", input, input_split_sizes)
            work = real(output, input, output_split_sizes, input_split_sizes, **kwargs)
            if dense:
                _corrupt_each("alltoall.recv", output, output_split_sizes)
            return work
        return all_to_all_single

    def _corrupt_each(surface: str, tensor: torch.Tensor, splits: Any) -> None:
        with torch.no_grad():
            for chunk in torch.split(tensor, list(splits)):
                if chunk.numel():
                    injector.corrupt(surface, chunk, rank=rank, step=state["step"])

    dist.all_to_all_single = corrupting(dist.all_to_all_single)
    for name in ("all_to_all_single", "all_reduce"):
        setattr(dist, name, slowed(getattr(dist, name)))
    expert0.register_forward_pre_hook(weight_fault)
    def output_fault(_m: Any, _a: Any, out: torch.Tensor) -> None:  # in place (a returned value replaces it)
        with torch.no_grad():
            injector.corrupt("experts.output", out, rank=rank, step=state["step"])

    expert0.register_forward_hook(output_fault)
    def other_weight_fault(ei: int, expert: Any) -> Any:
        def hook(*_: Any) -> None:  # (a pre-hook's return value would replace the expert's input)
            with torch.no_grad():
                injector.corrupt(f"experts.{ei}.weight", expert.up, rank=rank, step=state["step"])
        return hook

    for ei, expert in enumerate(moe0.experts[1:], start=1):  # `experts.<i>.weight`: the same in expert i
        expert.register_forward_pre_hook(other_weight_fault(ei, expert))
    for expert in model.layers[0].moe.experts:  # stop inside the expert: EP peers wait in the combine AllToAll
        expert.register_forward_pre_hook(lambda *_: injector.freeze("experts.forward", rank=rank, step=state["step"]))
    moe0.router.tap.register_forward_hook(router_fault)

    def slow_compute(*_: Any) -> None:  # a slow device: burned CPU in every dense part, in training and replay
        injector.delay("compute", rank=rank, step=state["step"])

    def slow_attention(*_: Any) -> None:
        injector.delay("compute.attention", rank=rank, step=state["step"])

    for block in model.layers:
        for dense in (block.attn.proj, block.moe.router.proj):
            dense.register_forward_hook(slow_compute)
        block.attn.proj.register_forward_hook(slow_attention)
    def gemv_fault(out: torch.Tensor) -> None:  # a defective matrix-vector kernel: only few-row shapes run it
        with torch.no_grad():
            injector.corrupt("experts.gemv", out, rank=rank, step=state["step"])

    for layer in model.layers:
        first = layer is model.layers[0]
        for expert in layer.moe.experts:
            expert.path_kernel = (SwitchingExpertKernel(fault=gemv_fault if first else None) if kernel == "switching"
                                  else ReferenceGroupedGemm(fault=path_fault if first else None))


def start_moe_rank(ctx: RankContext, cfg: MoEConfig) -> tuple[Any, Any, dict[str, Any], torch.optim.Optimizer]:
    """(model, expert-DP group, injector state, AdamW): gloo, the simulated machine, the faults installed."""
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // 8}"
    init_gloo(ctx, timeout_s=120)
    # FSDP2 warns that the root returns a view (the head's 3-D output); nothing modifies it in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    a = ctx.args
    injector = Injector(a["faults"], seed=a["seed"])
    model, _, dp_group = build_model(cfg, seed=a["seed"], dense=a.get("dense", "replicated"))
    state: dict[str, Any] = {"step": 0, "injector": injector}
    _install(model, injector, ctx.rank, state, a.get("kernel", "reference"))
    return model, dp_group, state, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _moe_rank(ctx: RankContext) -> dict[str, Any]:
    a = ctx.args
    model, dp_group, state, opt = start_moe_rank(ctx, MODEL)
    world, ep = ctx.world_size, MODEL.ep
    binding = MoEBinding(layers=[b.moe for b in model.layers], names=[f"layers.{i}.moe" for i in range(MODEL.depth)],
                         expert_peer_groups=[list(range(p, world, ep)) for p in range(ep)], ep_position=ctx.rank % ep,
                         ep_groups=[list(range(s, s + ep)) for s in range(0, world, ep)])
    dense = [m for b in model.layers for m in (b.attn, b.moe.router)]
    observer = (["observer.silence_threshold_s=2.0", "observer.gather_timeout_s=4.0"] if a["hang"]
                else [] if a["defaults"] else ["observer.enabled=false"])
    # Every recipe every step, or (defaults) the shipped cadences: optimizer, embedding and output recipes too.
    cadences = [] if a["defaults"] else ["replay.cadence.hidden=1", "replay.cadence.expert=1",
                                         "replay.cadence.embedding=0", "replay.cadence.output=0",
                                         "replay.cadence.optimizer=0"]
    cfg = load(None, [*cadences, *observer,
                      *([f"replay.moe_catalog={a['catalog']}"] if a["catalog"] else []), "checkpoint.enabled=false",
                      f"report.jsonl_path={a['jsonl']}", f"report.run_id={a['run_id']}", "report.log_level=ERROR",
                      *a["overrides"]])
    handle = scout_core.enable(model, opt, config=cfg, layers=dense, moe=binding)
    gen = torch.Generator().manual_seed(1000 * a["seed"] + ctx.rank)

    def data():  # the input pipeline SCOUT marks: a ``dataloader`` delay fault stalls this rank's fetch
        for step in range(1, a["steps"] + 1):
            state["injector"].delay("dataloader", rank=ctx.rank, step=step)
            yield torch.randn(2, 12, MODEL.dim_in, generator=gen), torch.randn(2, 12, MODEL.dim_out, generator=gen)

    for step, (x, y) in enumerate(handle.wrap_dataloader(data()), start=1):
        state["step"] = step
        torch.nn.functional.mse_loss(model(x), y).backward()
        sync_grads(model, dp_group)
        opt.step()
        opt.zero_grad()
    dist.barrier()
    checks = [(c.step, c.layer, c.expert, c.rows, c.source, c.skipped) for c in handle.experts.history]
    dense_checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history]
    every = handle.experts.every
    from torch.distributed.tensor import DTensor

    sharded = all(isinstance(p, DTensor) for b in model.layers for m in (b.attn, b.moe.router)
                  for p in m.parameters())
    handle.close()
    return {"expert_checks": checks, "dense_checks": dense_checks, "dense_sharded": sharded, "every": every}


def moe_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    jsonl = os.path.join(workdir, "incidents.jsonl")
    catalog = None
    if p.get("catalog", True):
        catalog = os.path.join(workdir, "catalog.json")
        # The switching kernel's paths are learnt by profiling its code; the reference kernel's are SCOUT's model.
        profiler = (KernelOpProfiler(moe_kernel.expert, kernel_name=SWITCHING)
                    if p.get("kernel") == "switching" else None)
        built = build_catalog(MoESpec(layers=tuple(f"layers.{i}.moe" for i in range(MODEL.depth)),
                                      hidden=MODEL.hidden, ffn=MODEL.ffn, experts=MODEL.experts, ep_size=MODEL.ep,
                                      capacity=MODEL.ep * MODEL.capacity), profiler)
        if "representatives" in p:  # a catalog that lost some representatives (the guard of the shape cell)
            for e in built.entries:
                e["representatives"] = [r for r in e["representatives"] if r in p["representatives"]]
        built.save(catalog)
    hang = bool(p.get("hang", False))
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 8)), "jsonl": jsonl,
            "run_id": spec.name, "catalog": catalog, "hang": hang, "dense": p.get("dense", "replicated"),
            "defaults": bool(p.get("defaults", False)), "overrides": list(p.get("overrides", [])),
            "kernel": p.get("kernel", "reference")}
    start = time.monotonic()
    # A hung job never returns: it stops once the observers' records have settled.
    stop = _RecordsSettled(jsonl, settle_s=1.5) if hang else None
    result = launch(_moe_rank, world_size, timeout_s=spec.timeout_s, args=args, stop_when=stop,
                    failure_grace_s=spec.timeout_s if hang else 5.0, keep_groups=hang)
    incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    problems = []
    if hang and not result.stopped:
        problems.append("the job was expected to hang and be diagnosed, but: " + (result.failures() or "it finished"))
    elif not hang and not result.ok:
        problems.append(result.failures())
    expect = p.get("expect", {})
    problems += record_problems(incidents, expect)
    if result.ok and not hang:
        value = result.values()[0]
        checks = value["expert_checks"]
        if len(checks) != args["steps"] // value["every"] or any(c[5] for c in checks):
            problems.append(f"expert checks {checks}, expected one every {value['every']} steps, none skipped")
        recipes = sorted({r for c in value["dense_checks"] for r in c[1]})
        if expect.get("recipes") and recipes != expect["recipes"]:
            problems.append(f"dense recipes {recipes}, expected {expect['recipes']}")
        skipped = [c for c in value["dense_checks"] if c[2]]
        if skipped or not value["dense_checks"]:
            problems.append(f"dense checks {value['dense_checks']}: expected some, none skipped")
        if value["dense_sharded"] != (args["dense"] == "fsdp2"):
            problems.append(f"dense parts sharded: {value['dense_sharded']}, expected dense={args['dense']}")
        rows = sorted({c[3] for c in checks})
        if expect.get("rows") and rows != expect["rows"]:
            problems.append(f"expert checks replayed rows {rows}, expected {expect['rows']}")
    return CellReport(name=spec.name, verdict="FAIL" if problems else "PASS", world_size=world_size,
                      injected=fault_dicts(spec.faults), reported=[i.to_dict() for i in incidents],
                      details="\n".join(problems), wall_s=time.monotonic() - start)
