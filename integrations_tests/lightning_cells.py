"""Lightning cells: a real ``lightning.Trainer`` with SCOUT switched on by ``callbacks=[ScoutCallback(...)]``.

Each rank runs what a Lightning script with the one-line change runs: Lightning's demo ``LightningTransformer``
(``nn.Transformer``, SGD) on random tokens, the DDP strategy on CPU ranks over gloo, SCOUT at its shipped settings
unless the cell's ``scout`` overrides say otherwise. Faults (``faults`` in configs/cells.yaml) act inside an encoder
layer's ``forward``, in training and in SCOUT's replay alike: ``layers.<i>.output`` corrupts encoder layer i's
output, ``layers.<i>.forward`` (``freeze``) stops the rank there. Steps are Lightning's optimizer steps, from 1.
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
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, prepare_parent

__all__ = ["lightning_cell"]


def _prepare() -> None:
    """Import Lightning and the plugin in the parent, once: forked ranks start with them loaded."""
    prepare_parent()
    import lightning  # noqa: F401

    import scout_lightning.callback  # noqa: F401


def _install_faults(layers: nn.ModuleList, injector: Injector, rank: int, step: Any) -> None:
    """Faults inside the encoder layers' computation, in training and in replay alike: ``layers.<i>.output`` corrupts
    the feed-forward output the layer adds to its residual (``linear2``: under FSDP2 replay calls the layer's class
    ``forward``, and its submodules as in training), ``layers.<i>.forward`` freezes the rank as the layer starts."""
    for i, layer in enumerate(layers):
        def forward(*args: Any, _inner: Any = layer.forward, i: int = i, **kwargs: Any) -> Any:
            injector.freeze(f"layers.{i}.forward", rank=rank, step=step())
            return _inner(*args, **kwargs)

        def feed_forward(*args: Any, _inner: Any = layer.linear2.forward, i: int = i, **kwargs: Any) -> Any:
            out = _inner(*args, **kwargs)
            with torch.no_grad():
                injector.corrupt(f"layers.{i}.output", out, rank=rank, step=step())
            return out

        layer.forward = forward
        layer.linear2.forward = feed_forward


def _lightning_rank(ctx: RankContext) -> dict[str, Any]:
    from lightning.pytorch import Callback

    from scout_lightning.tryout import blocks, build_module, trainer

    a = ctx.args
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), NODE_RANK="0", WORLD_SIZE=str(ctx.world_size),
                      LOCAL_WORLD_SIZE=str(ctx.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ctx.master_port))
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // a['ranks_per_machine']}"
    init_gloo(ctx, timeout_s=120)
    module = build_module(fsdp=a["fsdp"])
    injector = Injector(a["faults"], seed=a["seed"])
    live: dict[str, Any] = {"step": 0, "handle": None, "loaded": []}
    _install_faults(blocks(module), injector, ctx.rank, lambda: live["step"])
    scout = None
    if a["scout"] is not None:
        from scout_lightning import ScoutCallback

        scout = ScoutCallback(overrides=a["scout"])

    sigs: dict[int, list[int]] = {}
    sigs_path = os.path.join(a["workdir"], f"sigs-{a['phase']}-r{ctx.rank}.json")

    class Watch(Callback):
        """The cell's view: the step being run, the state loaded and saved (bitwise), SCOUT's handle."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            live["handle"] = scout.handle if scout is not None else None
            if trainer.ckpt_path:
                live["loaded"] = [int(trainer.global_step), *_signature(pl_module, trainer.optimizers)]

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
            sigs[int(trainer.global_step)] = _signature(pl_module, trainer.optimizers)
            with open(sigs_path, "w") as fh:
                json.dump(sigs, fh)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            live["step"] = trainer.global_step + 1

    callbacks = [Watch()] if scout is None else [scout, Watch()]
    run = trainer(Path(a["workdir"]), a["steps"], callbacks, save_every=a["save_every"], accumulation=a["gas"],
                  fsdp=a["fsdp"])
    run.fit(module, ckpt_path="last" if a["phase"] == "b" else None)
    handle = live["handle"]
    checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle is not None else []
    dist.barrier()
    from torch.distributed.fsdp import FSDPModule

    return {"checks": checks, "steps": int(run.global_step), "final": _signature(module, run.optimizers),
            "loaded": live.get("loaded", []), "fsdp2": isinstance(module.model, FSDPModule)}


def _signature(module: nn.Module, optimizers: Any) -> list[int]:
    """A bitwise signature of the training state: the parameters and the optimizers' state."""
    def whole(t: torch.Tensor) -> torch.Tensor:  # FSDP2's shards gathered (every rank calls this, in step)
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

    state = [whole(p) for p in module.parameters()]
    for opt in optimizers:
        state += [whole(v) for p in module.parameters() for _k, v in sorted(opt.state.get(p, {}).items())
                  if isinstance(v, torch.Tensor)]
    return [s.signature for s in sign_many(state)]


def lightning_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    _prepare()
    p = spec.params
    hang = bool(p.get("hang", False))
    recovery = bool(p.get("recovery", False))  # a stop, then a restart through ckpt_path="last"
    scout = [f"report.jsonl_path={os.path.join(workdir, 'incidents.jsonl')}", f"report.run_id={spec.name}",
             "report.log_level=ERROR", *(["actions.on_verdict=stop"] if recovery else []), *p.get("scout", [])]
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 60)), "scout": scout,
            "gas": int(p.get("gas", 1)), "save_every": int(p.get("save_every", 0)), "fsdp": bool(p.get("fsdp", False)),
            "ranks_per_machine": int(p.get("ranks_per_machine", 8)), "workdir": workdir, "phase": "a"}
    run = run_job(_lightning_rank, spec, world_size, workdir, args, hang=hang, stop=recovery)
    loop_problems(_lightning_rank, spec, world_size, workdir, args, run, hang=hang, recovery=recovery,
                  folder=os.path.join(workdir, "checkpoints"), prefix="epoch=0-step=")
    return cell_report(spec, world_size, run, hang=hang)
