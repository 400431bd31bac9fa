"""``ScoutCallback``: SCOUT in a PyTorch Lightning job through Lightning's callback API.

``lightning.Trainer(..., callbacks=[ScoutCallback("scout.yaml")])`` is the whole integration. On Lightning's events:

* ``setup`` (fit; the process group is up, no checkpoint read yet): unless the user named a ``ckpt_path``, the
  restart plan, which makes the file ``"last"`` resolved to hold the checkpoint SCOUT chose after a verdict stop
  (:mod:`scout_lightning.checkpoints`). The path Lightning resolved and the user's argument are not among a
  callback's arguments: the callback reads them from the trainer's ``_run`` and ``fit`` that called it;
* ``on_train_start`` (the strategy wrapped the model, the optimizers exist, a checkpoint was loaded): SCOUT attached
  to the LightningModule's model and the trainer's torch optimizers, a loaded checkpoint SCOUT labelled rejected
  refused, the step count set to the trainer's global step, and ``ModelCheckpoint``'s saves labelled;
* ``on_train_end``: SCOUT closed, a normal end; ``on_exception``: closed as after a failure.

Lightning's automatic optimization runs the training step and its backward inside ``optimizer.step(closure)``;
SCOUT's step boundary hooks the torch optimizer's step, whose pre-step hooks would then run before the step's
forward. The callback runs the closure first and then the optimizer's step without it, which is what torch's
optimizers do inside their step (one call under ``enable_grad``), the same operations in the same order: the
boundary and the optimizer check see the step's gradients. Only torch's own optimizers (``torch.optim``, LBFGS
excepted: it calls its closure more than once) are known to do that; others are refused.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from scout_core.adapter import torch_adapter
from scout_core.config import ConfigError, ScoutConfig, resolve
from scout_core.plugin_support import InstanceAttribute
from scout_core.report import Incident
from scout_core.runtime import ScoutHandle, enable_with
from scout_lightning.checkpoints import (
    adopt_start,
    continue_after_load,
    label_saves,
    plan_restart,
    refuse_rejected_load,
)

__all__ = ["ScoutCallback"]

log = logging.getLogger("scout_lightning")


class ScoutCallback(Callback):
    """SCOUT for a ``lightning.Trainer``: pass it in ``callbacks=[...]``.

    ``config``: SCOUT's configuration, a YAML file's path or a :class:`ScoutConfig` (None: the shipped defaults),
    ``overrides`` dotted ``key=value`` on top. ``on_incident`` runs in the observer process for each hang verdict
    (see :func:`scout_core.enable`). The configuration is read when the callback is built."""

    def __init__(self, config: ScoutConfig | str | os.PathLike[str] | None = None, *, overrides: Sequence[str] = (),
                 on_incident: Callable[[Incident], None] | str | None = None) -> None:
        self.config = resolve(config, overrides)
        if self.config.checkpoint.enabled:
            raise ConfigError("scout_lightning: checkpoint.enabled: SCOUT's in-memory snapshots do not hold "
                              "Lightning's own state (loops, callbacks, data position); certification labels "
                              'ModelCheckpoint\'s files and ckpt_path="last" loads the one SCOUT chose. Set it to '
                              "false")
        self.on_incident = on_incident
        self.handle: ScoutHandle | None = None
        self.restart_plan: dict[str, Any] | None = None
        """What the restart plan chose at setup (None: no plan, Lightning's own choice)."""
        self._undo: list[Callable[[], None]] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.restart_plan = plan_restart(trainer, *_ckpt_paths())

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            log.warning("scout_lightning: SCOUT is not attached: this job runs one process (SCOUT compares peers)")
            return
        loaded = os.fspath(trainer.ckpt_path) if trainer.ckpt_path else None
        if loaded:
            refuse_rejected_load(loaded, allowed=self.config.checkpoint.load_rejected)
        refused = _unsupported(trainer)
        if refused is not None:
            raise ConfigError(f"scout_lightning: SCOUT does not diagnose {refused} yet; remove the callback for this "
                              "job")
        adopt_start(trainer, loaded, int(trainer.global_step))  # before the labels are read for this run
        optimizers = list(trainer.optimizers)
        self._undo = [_closure_first(opt) for opt in optimizers]
        adapter = _adapter(trainer, pl_module, optimizers)
        adapter.name = "lightning"
        try:
            self.handle = enable_with(adapter, config=self.config, on_incident=self.on_incident)
        except BaseException:
            self._close()
            raise
        self._undo.append(label_saves(self.handle, trainer))
        plan = self.restart_plan or {}
        if plan.get("step") is not None:  # the plan's copy was loaded: its labels are the labelled folder's
            continue_after_load(self.handle, plan["folder"], int(trainer.global_step))
        elif loaded:
            continue_after_load(self.handle, os.path.dirname(os.path.realpath(loaded)), int(trainer.global_step))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(failed=True)

    def _close(self, *, failed: bool | None = None) -> None:
        handle, self.handle = self.handle, None
        undo, self._undo = self._undo, []
        try:
            if handle is not None:
                handle.close(failed=failed)
        finally:
            for put_back in reversed(undo):
                put_back()


def _adapter(trainer: Any, pl_module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> Any:
    """scout_core's adapter over what Lightning built. The repeated layers, embedding and head are found in the
    model inside the LightningModule; under the DDP strategy SCOUT is handed Lightning's DDP wrapper itself, whose
    gradient reduction it then observes (a rank that never reaches the step's reduction is told apart from its
    peers waiting in it: without it a hang of one rank before its forward looked like every rank waiting at once)."""
    found = torch_adapter(_model_of(pl_module), optimizers)
    wrapped = trainer.strategy.model
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return found
    return torch_adapter(wrapped, optimizers, layers=found.layers, embedding=found.embedding, output=found.output)


def _model_of(pl_module: nn.Module) -> nn.Module:
    """The model inside the LightningModule that SCOUT looks into: the module's child holding all its parameters
    (``self.model = GPT2LMHeadModel(...)``, beside a parameter-free loss module), followed down while one does;
    else the module itself."""
    module = pl_module
    total = sum(1 for _ in module.parameters())
    while True:
        holders = [c for c in module.children() if sum(1 for _ in c.parameters()) == total]
        if len(holders) != 1 or total == 0:
            return module
        module = holders[0]


def _ckpt_paths() -> tuple[str | None, Any]:
    """The checkpoint path Lightning resolved for this run (``"last"`` to a ``last*.ckpt``) and the user's own
    ``ckpt_path`` argument, read from the frames of the trainer's ``_run`` and ``fit`` that called the callback's
    ``setup`` (a callback's arguments carry neither)."""
    from lightning.pytorch import Trainer

    resolved, asked = None, None
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer):
            if frame.f_code.co_name == "_run":
                path = frame.f_locals.get("ckpt_path")
                resolved = os.fspath(path) if path else None
            elif frame.f_code.co_name == "fit":
                asked = frame.f_locals.get("ckpt_path")
                break
        frame = frame.f_back
    return resolved, asked


def _unsupported(trainer: Any) -> str | None:
    """A strategy or optimizer SCOUT cannot diagnose under Lightning (None: DDP, FSDP2). Strategies are allowed by
    name, not by base class: DeepSpeedStrategy is a DDPStrategy whose optimizer state is partitioned (scout-deepspeed
    handles DeepSpeed). ModelParallelStrategy (FSDP2, ``fully_shard`` in ``configure_model``) only data parallel and
    saving whole checkpoints: its distributed checkpoints are folders, which the restart does not steer."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    if type(strategy) is ModelParallelStrategy:
        mesh = strategy.device_mesh
        if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            return "tensor parallelism (ModelParallelStrategy's tensor_parallel_size above 1)"
        if strategy._save_distributed_checkpoint:
            return ("ModelParallelStrategy's distributed checkpoints (folders SCOUT's restart does not steer): give "
                    "it save_distributed_checkpoint=False")
    elif type(strategy) is not DDPStrategy:
        return (f"Lightning's {type(strategy).__name__} (DDPStrategy and ModelParallelStrategy are supported; for "
                "DeepSpeed use scout-deepspeed)")
    for opt in trainer.optimizers:
        if isinstance(opt, torch.optim.LBFGS) or not type(opt).__module__.startswith("torch.optim"):
            return (f"the optimizer {type(opt).__qualname__} ({type(opt).__module__}): the callback runs Lightning's "
                    "closure before the step, as torch's own optimizers (LBFGS excepted) do inside it")
    return None


def _closure_first(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Make ``optimizer.step(closure)`` run the closure, then the step without it (see the module's docstring);
    returns what puts the optimizer's own step back."""
    step = optimizer.step

    @functools.wraps(step)
    def closure_first(closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if closure is None:
            return step(None, *args, **kwargs)
        with torch.enable_grad():
            loss = closure()
        step(None, *args, **kwargs)
        return loss

    # An instance attribute already there (an LR scheduler's wrapper of step) is what remove() puts back.
    return InstanceAttribute(optimizer, "step", closure_first).remove
