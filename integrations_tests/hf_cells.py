"""Hugging Face cells: a real ``transformers.Trainer`` (or a script on Accelerate) with SCOUT switched on the way its
users switch it on.

Trainer cells: each rank runs what a Trainer script with the one-line change runs, ``Trainer(...,
callbacks=[scout_hf.ScoutCallback(...)])`` on transformers' own GPT-2 or Llama built from a small config (nothing
downloaded), random token data, the Trainer's DDP path (``fsdp: true``: its FSDP2 path) on CPU ranks over gloo,
SCOUT at its shipped settings unless the cell's ``scout`` overrides say otherwise. Accelerate cells
(``accelerate: true``): a training loop of the user's own on ``Accelerator`` (FSDP2 through its plugin), SCOUT
attached by ``scout_hf.attach(accelerator, model, optimizer)`` after ``prepare``.

Faults (``faults`` in configs/cells.yaml) act inside a block's ``forward``, in training and in SCOUT's replay alike:
``layers.<i>.output`` corrupts block i's output, ``layers.<i>.forward`` (``freeze``) stops the rank there. Steps
are the Trainer's optimizer steps, counted from 1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from integrations_tests.training_jobs import cell_report, loop_problems, run_job
from scout_core.adapter import find_inner_optimizers
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, prepare_parent

__all__ = ["hf_cell"]


def _prepare() -> None:
    """Import transformers, accelerate and the plugin in the parent, once: forked ranks start with them loaded."""
    prepare_parent()
    import accelerate  # noqa: F401
    import transformers.trainer  # noqa: F401  (transformers imports lazily: each rank would import the trainer)
    from accelerate.utils import is_deepspeed_available

    if is_deepspeed_available():  # Accelerate imports DeepSpeed where it is installed, in every rank's unwrap_model
        import deepspeed  # noqa: F401

    import scout_hf.callback  # noqa: F401


def _install_faults(model: nn.Module, injector: Injector, rank: int, step: Any) -> None:
    """Faults inside each block's computation, in training and in replay alike: ``layers.<i>.output`` corrupts what
    the block's MLP adds to its output (a defective unit in the block's feed-forward: under FSDP2 replay calls the
    block's class ``forward``, and its submodules as in training), ``layers.<i>.forward`` freezes the rank as the
    block starts."""
    from scout_hf.tryout import blocks, feed_forward

    for i, block in enumerate(blocks(model)):
        def forward(*args: Any, _inner: Any = block.forward, i: int = i, **kwargs: Any) -> Any:
            injector.freeze(f"layers.{i}.forward", rank=rank, step=step())
            return _inner(*args, **kwargs)

        part = feed_forward(block)

        def mlp(*args: Any, _inner: Any = part.forward, i: int = i, **kwargs: Any) -> Any:
            out = _inner(*args, **kwargs)
            with torch.no_grad():
                injector.corrupt(f"layers.{i}.output", out, rank=rank, step=step())
            return out

        block.forward = forward
        part.forward = mlp


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _signature(model: nn.Module, optimizer: Any) -> list[int]:
    """A bitwise signature of the training state: the model's parameters (whole) and the optimizer's state."""
    tensors = [_full(p) for p in model.parameters()]
    for opt in find_inner_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                tensors += [_full(v) for _k, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return [s.signature for s in sign_many(tensors)]


def _trainer_rank(ctx: RankContext) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback

    from scout_hf.tryout import RandomTokens, build_model, trainer_arguments

    a = ctx.args
    _join(ctx)
    model = build_model(a["model"], layers=a["layers"])
    injector = Injector(a["faults"], seed=a["seed"])
    live: dict[str, Any] = {"step": 0, "loaded": [], "sigs": {}, "handle": None}
    _install_faults(model, injector, ctx.rank, lambda: live["step"])
    sigs_path = os.path.join(a["workdir"], f"sigs-{a['phase']}-r{ctx.rank}.json")
    scout = None
    if a["scout"] is not None:
        from scout_hf import ScoutCallback

        scout = ScoutCallback(overrides=a["scout"])

    class Watch(TrainerCallback):
        """The cell's view: the step being run, the state loaded and saved (bitwise), SCOUT's handle."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kwargs: Any) -> None:
            live["handle"] = scout.handle if scout is not None else None
            if state.global_step > 0:
                live["loaded"] = [int(state.global_step), *_signature(model, optimizer)]

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            live["step"] = state.global_step + 1

        def on_save(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
            live["sigs"][int(state.global_step)] = _signature(model, optimizer)
            with open(sigs_path, "w") as fh:
                json.dump(live["sigs"], fh)

    callbacks = [Watch()] if scout is None else [scout, Watch()]
    targs = trainer_arguments(Path(a["workdir"]), a["steps"], fsdp=a["fsdp"], accumulation=a["gas"],
                              save_steps=a["save_steps"])
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if a["phase"] == "b" else None)
    handle = live["handle"]
    checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle is not None else []
    final = _signature(trainer.model, trainer.optimizer)
    dist.barrier()
    return {"checks": checks, "steps": int(trainer.state.global_step), "final": final, "loaded": live["loaded"],
            "fsdp2": _is_fsdp2(trainer.model_wrapped)}


def _accelerate_rank(ctx: RankContext) -> dict[str, Any]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    import scout_hf
    from scout_hf.tryout import RandomTokens, build_model

    a = ctx.args
    _join(ctx)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True) if a["fsdp"] else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=a["gas"])
    model = build_model(a["model"], layers=a["layers"])
    model.config.use_cache = False  # training: no KV cache in the blocks' calls (what the Trainer sets too)
    injector = Injector(a["faults"], seed=a["seed"])
    step = {"n": 1}
    _install_faults(model, injector, ctx.rank, lambda: step["n"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(RandomTokens(), batch_size=2)
    model.train()  # (a model transformers builds from a config starts in eval mode)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    handle = None
    if a["scout"] is not None:
        handle = scout_hf.attach(accelerator, model, optimizer, overrides=a["scout"])
    batches = iter(loader)
    while step["n"] <= a["steps"]:
        with accelerator.accumulate(model):
            loss = model(**next(batches)).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step["n"] += 1
    checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle is not None else []
    final = _signature(model, optimizer)
    if handle is not None:
        handle.close()
    dist.barrier()
    return {"checks": checks, "steps": step["n"] - 1, "final": final, "loaded": [], "fsdp2": _is_fsdp2(model)}


def _is_fsdp2(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _join(ctx: RankContext) -> None:
    """The environment torchrun gives a worker (Accelerate reads it), then the job's gloo group; Accelerate's FSDP
    path on these CPU ranks where the cell asks for FSDP2 (:mod:`scout_hf.cpu`)."""
    if ctx.args["fsdp"]:
        from scout_hf.cpu import fsdp_on_cpu

        fsdp_on_cpu()
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size),
                      LOCAL_WORLD_SIZE=str(ctx.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ctx.master_port))
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // ctx.args['ranks_per_machine']}"
    init_gloo(ctx, timeout_s=120)


def hf_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    _prepare()
    p = spec.params
    hang = bool(p.get("hang", False))
    recovery = bool(p.get("recovery", False))  # a stop, then a restart through resume_from_checkpoint=True
    stop = recovery or bool(p.get("stop", False))
    scout = [f"report.jsonl_path={os.path.join(workdir, 'incidents.jsonl')}", f"report.run_id={spec.name}",
             "report.log_level=ERROR", *(["actions.on_verdict=stop"] if stop else []), *p.get("scout", [])]
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 60)), "scout": scout,
            "model": p.get("model", "gpt2"), "layers": int(p.get("layers", 4)), "fsdp": bool(p.get("fsdp", False)),
            "gas": int(p.get("gas", 1)), "save_steps": int(p.get("save_steps", 0)),
            "ranks_per_machine": int(p.get("ranks_per_machine", 8)), "workdir": workdir, "phase": "a"}
    rank = _accelerate_rank if p.get("accelerate") else _trainer_rank
    run = run_job(rank, spec, world_size, workdir, args, hang=hang, stop=stop)
    loop_problems(rank, spec, world_size, workdir, args, run, hang=hang, recovery=recovery,
                  folder=os.path.join(workdir, "trainer"), prefix="checkpoint-")
    return cell_report(spec, world_size, run, hang=hang)
