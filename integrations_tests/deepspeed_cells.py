"""DeepSpeed cells: real DeepSpeed training with SCOUT switched on by the ``"scout"`` section of its JSON config.

Each rank runs what a DeepSpeed training script with the one-line change runs: ``scout_deepspeed.initialize`` (a
drop-in for ``deepspeed.initialize``) on a Llama-shaped model from :mod:`integrations_tests.zoo` (keyword rotary
tables, ``None`` arguments, tuple block outputs, a dataclass model output) with torch's AdamW, the cell's ZeRO
stage, gradient accumulation and ``"scout"`` section, then DeepSpeed's own ``engine(...)``, ``engine.backward``,
``engine.step`` loop, on the CPU accelerator over gloo. The MoE cells put ``deepspeed.moe.layer.MoE`` in each block
(its params split into MoE groups for the optimizer, as DeepSpeed requires under ZeRO).

Faults (``faults`` in configs/cells.yaml) act inside a block's ``forward``, in training and in SCOUT's replay
alike: ``layers.<i>.output`` corrupts block i's output (``layers.any.output``: every block's);
``layers.<i>.experts.<e>.output`` one local expert's; ``layers.<i>.forward`` (``freeze``) stops the rank in block
i's forward; ``optimizer.update`` corrupts this rank's live update of one optimizer partition (``update_partition``,
default the first; under ZeRO-3 with several sub-groups, ``sub_group_size``, that sub-group's: DeepSpeed steps the
torch optimizer once per sub-group). Steps are optimizer steps, counted from 1. Every check due to replay the
optimizer must carry its evidence.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from integrations_tests.training_jobs import (
    bitwise_problems,
    cell_report,
    quiet_renamed_collectives,
    restart_problems,
    run_job,
)
from integrations_tests.zoo import HEADS, HIDDEN, VOCAB, LlamaBlock, LlamaLM, zoo_batches
from scout_core.adapter import find_inner_optimizers
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, prepare_parent

__all__ = ["deepspeed_cell"]

MICRO_BATCH = 2


def _prepare() -> None:
    """Import DeepSpeed in the parent, once, on its CPU accelerator: forked ranks start with it loaded. Its
    shared-memory collective op (for inference all-reduce only) would be compiled at start-up on every rank."""
    prepare_parent()
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed  # noqa: F401

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    # deepspeed.initialize's optimizer check imports the Muon optimizer, whose module calls torch.compile and so
    # imports inductor: seconds on every rank.
    importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")

    import scout_deepspeed.entry  # noqa: F401


class SwiGLU(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """A Llama block followed by DeepSpeed's MoE (top-1 gating over SwiGLU experts); returns ``(hidden, l_aux)``."""

    def __init__(self, ep_size: int, experts: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.attention = LlamaBlock(HIDDEN, HEADS, HEADS // 2)
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = MoE(HIDDEN, SwiGLU(HIDDEN), num_experts=experts, ep_size=ep_size, k=1, min_capacity=8)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.attention(hidden_states, attention_mask, position_ids, position_embeddings=position_embeddings)[0]
        out, l_aux, _counts = self.moe(self.norm(h))
        return h + out, l_aux


class MoELM(LlamaLM):
    """The zoo's Llama LM with MoE blocks; its loss adds the gates' auxiliary loss."""

    def __init__(self, ep_size: int, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(ep_size, experts) for _ in range(len(self.layers)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, output_hidden_states: bool = False) -> Any:
        h = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.size(1))[None].expand(input_ids.size(0), -1)
        cos, sin = self.rotary_emb(h, pos)
        aux = h.new_zeros(())
        for layer in self.layers:
            h, l_aux = layer(h, None, pos, position_embeddings=(cos, sin))
            aux = aux + l_aux
        logits = self.lm_head(self.norm(h))
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return loss + 0.01 * aux


def _model(a: dict[str, Any]) -> nn.Module:
    torch.manual_seed(1234 + a["seed"])  # every rank builds the same model
    if a["moe"]:
        return MoELM(a["ep_size"], a["experts"])
    return LlamaLM()


def _ds_config(a: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": a["gas"],
        "zero_optimization": {"stage": a["stage"]}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if a["stage"] == 3:
        # ZeRO-3 keeps parameters below this size whole on every rank (default 1e5 elements: every parameter of
        # this small model); 0 partitions every one of them, as a large model's are.
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
        if a["sub_group_size"]:
            config["zero_optimization"]["sub_group_size"] = a["sub_group_size"]
    if a["scout"] is not None:
        config["scout"] = a["scout"]
    return config


def _signature(engine: Any) -> list[int]:
    """A bitwise signature of this rank's training state: the optimizer's parameters (ZeRO's master partitions)
    and state, and the model's parameters where it holds them whole (below ZeRO-3)."""
    tensors = [p for p in engine.module.parameters() if p.numel() and not hasattr(p, "ds_id")]
    for opt in find_inner_optimizers(engine.optimizer):
        for p in _partitions(engine, opt):
            tensors += [p, *(v for _k, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor))]
    if not tensors:
        raise AssertionError("the bitwise signature found no training state to sign")
    return [s.signature for s in sign_many([t.detach() for t in tensors])]


def _partitions(engine: Any, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The master partitions ``opt`` steps. ZeRO-3 empties the torch optimizer's parameter groups between its
    steps (it puts one sub-group's flat partition there for each inner step): its flats are on the wrapper."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    return list(flats) if flats else [p for g in opt.param_groups for p in g["params"]]


def _install_update_fault(engine: Any, injector: Injector, rank: int, step: Any, partition: int) -> None:
    """``optimizer.update``: after the torch optimizer stepped partition ``partition``, corrupt its live update."""
    inner = find_inner_optimizers(engine.optimizer)[0]
    target = _partitions(engine, inner)[partition]

    def update_fault(opt: torch.optim.Optimizer, *_: Any) -> None:
        if any(p is target for g in opt.param_groups for p in g["params"]):
            with torch.no_grad():
                injector.corrupt("optimizer.update", target, rank=rank, step=step())

    inner.register_step_post_hook(update_fault)  # registered after SCOUT's pre-step hook took its slice


def _install_faults(model: nn.Module, injector: Injector, rank: int, step: Any) -> None:
    """Faults inside the blocks' and experts' own ``forward`` (a faulty unit computes wrongly in training and in
    replay alike; replay under ZeRO-3 sets module hooks aside, so a hook would not model it)."""
    for i, layer in enumerate(model.layers):
        moe = getattr(layer, "moe", None)
        for e, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts if moe is not None else []):
            def expert_forward(*args: Any, _inner: Any = expert.forward, i: int = i, e: int = e, **kwargs: Any) -> Any:
                out = _inner(*args, **kwargs)
                corrupted = out.detach().clone()
                if not injector.corrupt(f"layers.{i}.experts.{e}.output", corrupted, rank=rank, step=step()):
                    return out
                return out + (corrupted - out.detach())  # the corrupted value, training's gradient path

            expert.forward = expert_forward

        def block_forward(*args: Any, _inner: Any = layer.forward, i: int = i, **kwargs: Any) -> Any:
            injector.freeze(f"layers.{i}.forward", rank=rank, step=step())
            out = _inner(*args, **kwargs)
            with torch.no_grad():
                injector.corrupt(f"layers.{i}.output", out[0], rank=rank, step=step())
                injector.corrupt("layers.any.output", out[0], rank=rank, step=step())  # a faulty unit: every block
            return out

        layer.forward = block_forward


def _deepspeed_rank(ctx: RankContext) -> dict[str, Any]:
    a = ctx.args
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // a['ranks_per_machine']}"
    init_gloo(ctx, timeout_s=120)
    quiet_renamed_collectives()  # DeepSpeed's ZeRO gathers and reduce-scatters call the deprecated names
    import scout_deepspeed

    model = _model(a)
    params: Any = model.parameters()
    if a["moe"]:  # DeepSpeed's MoE under ZeRO: expert parameters in their own optimizer groups
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                        "name": "dense"})
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    engine, _, _, _ = scout_deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(a),
                                                 dist_init_required=False)
    folder = os.path.join(a["workdir"], "deepspeed")
    loaded: list[Any] = []
    if a["phase"] == "b":  # the restart: DeepSpeed loads what `latest` names (SCOUT's choice)
        path, _ = engine.load_checkpoint(folder)
        loaded = [int(engine.global_steps), *_signature(engine)] if path is not None else []
    injector = Injector(a["faults"], seed=a["seed"])
    _install_faults(engine.module, injector, ctx.rank, lambda: int(engine.global_steps) + 1)
    _install_update_fault(engine, injector, ctx.rank, lambda: int(engine.global_steps) + 1, a["update_partition"])
    data = zoo_batches(ctx.rank, a["steps"] * a["gas"], batch=MICRO_BATCH, seed=a["seed"])
    sigs: dict[int, list[int]] = {}
    for _ in range(int(engine.global_steps) * a["gas"]):  # the batches the loaded steps consumed
        next(data)
    while engine.global_steps < a["steps"]:
        ids, labels = next(data)
        out = engine(ids, labels=labels)
        engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
        engine.step()
        if a["save"] and engine.micro_steps % a["gas"] == 0:
            sigs[int(engine.global_steps)] = _signature(engine)  # the state this save writes, bitwise
            with open(os.path.join(a["workdir"], f"sigs-{a['phase']}-r{ctx.rank}.json"), "w") as fh:
                json.dump(sigs, fh)
            engine.save_checkpoint(folder)
    handle = scout_deepspeed.handle_of(engine)
    checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle is not None else []
    # A check due to replay the optimizer whose slice was never taken sends no optimizer evidence, and is no skip.
    silent_optimizer = [r.step for r in (handle.replay.history if handle is not None else [])
                        if "optimizer" in r.recipes and not r.skipped
                        and not any(c.surface.startswith("optimizer.") for c in r.surfaces)]
    alltoall = 0  # expert checks that replayed the AllToAll (its surfaces compared among the expert peers)
    if handle is not None and handle.experts is not None:
        checks += [(c.step, ["expert"], c.skipped) for c in handle.experts.history]
        alltoall = sum(any(r.surface.startswith("alltoall.") for r in c.surfaces) for c in handle.experts.history)
    final = _signature(engine)
    dist.barrier()
    engine.destroy()  # closes SCOUT
    return {"checks": checks, "steps": int(engine.global_steps), "final": final, "loaded": loaded,
            "alltoall_checks": alltoall, "silent_optimizer": silent_optimizer}


def deepspeed_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    _prepare()
    p = spec.params
    hang = bool(p.get("hang", False))
    recovery = bool(p.get("recovery", False))  # a stop, then a restart that must load the chosen tag
    stop = recovery or bool(p.get("stop", False))
    scout: dict[str, Any] = {
        "enabled": True,
        "report": {"jsonl_path": os.path.join(workdir, "incidents.jsonl"), "run_id": spec.name, "log_level": "ERROR"},
        "replay": {"cadence": {"hidden": int(p.get("hidden_every", 1))}}}
    if stop:
        scout["actions"] = {"on_verdict": "stop"}
    for key, value in p.get("scout", {}).items():  # the cell's own section keys, dotted
        *outer, leaf = key.split(".")
        holder = scout
        for name in outer:
            holder = holder.setdefault(name, {})
        holder[leaf] = value
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 6)), "scout": scout,
            "stage": int(p.get("stage", 1)), "gas": int(p.get("gas", 1)), "moe": bool(p.get("moe", False)),
            "ep_size": int(p.get("ep_size", 1)), "experts": int(p.get("experts", 4)),
            "ranks_per_machine": int(p.get("ranks_per_machine", 8)), "workdir": workdir,
            "save": bool(p.get("save", recovery)), "phase": "a", "sub_group_size": int(p.get("sub_group_size", 0)),
            "update_partition": int(p.get("update_partition", 0))}
    run = run_job(_deepspeed_rank, spec, world_size, workdir, args, hang=hang, stop=stop)
    if run.result.ok and not hang and any(v["steps"] != args["steps"] for v in run.result.values()):
        run.problems.append(f"DeepSpeed trained {[v['steps'] for v in run.result.values()]} steps, expected "
                            f"{args['steps']}")
    silent = {r: v["silent_optimizer"] for r, v in enumerate(run.result.values()) if v and v.get("silent_optimizer")}
    if silent and run.result.ok and not hang:
        run.problems.append(f"optimizer checks without optimizer evidence (rank: steps): {silent}")
    if p.get("alltoall") and run.result.ok and not hang:  # expert parallelism: the token exchange replayed too
        missing = [r for r, v in enumerate(run.result.values()) if not (v or {}).get("alltoall_checks")]
        if missing:
            run.problems.append(f"no expert check replayed the AllToAll on ranks {missing}")
    if p.get("bitwise_without_scout") and run.result.ok and not run.problems:
        run.problems += bitwise_problems(_deepspeed_rank, spec, world_size, args, run)
    if recovery and not run.problems:
        run.problems += restart_problems(_deepspeed_rank, spec, world_size, workdir, args,
                                         folder=os.path.join(workdir, "deepspeed"),
                                         unit="step", prefix="global_step", counted="steps")
    return cell_report(spec, world_size, run, hang=hang)
