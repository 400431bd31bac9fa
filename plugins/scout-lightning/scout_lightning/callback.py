"""``ScoutCallback``: SCOUT in a PyTorch Lightning job through Lightning's callback API.

``lightning.Trainer(..., callbacks=[ScoutCallback("scout.yaml")])`` is the whole integration. On Lightning's events:

* ``setup`` (fit; the process group is up, no checkpoint read yet): the restart plan, which makes
  ``ckpt_path="last"`` load the checkpoint SCOUT chose (:mod:`scout_lightning.checkpoints`);
* ``on_train_start`` (the strategy wrapped the model, the optimizers exist, a checkpoint was loaded): SCOUT attached
  to the LightningModule's model and the trainer's torch optimizers, a loaded checkpoint SCOUT labelled rejected
  refused, the step count set to the trainer's global step, and ``ModelCheckpoint``'s saves labelled;
* ``on_train_end``: SCOUT closed, a normal end; ``on_exception``: closed as after a failure.

Lightning's automatic optimization runs the training step and its backward inside ``optimizer.step(closure)``;
SCOUT's step boundary hooks the torch optimizer's step, whose pre-step hooks would then run before the step's
forward. The callback runs the closure first and then the optimizer's step without it, which is what torch's
optimizers do inside their step (one call under ``enable_grad``), the same operations in the same order: the
boundary and the optimizer check see the step's gradients. An optimizer that calls its closure more than once
(LBFGS) is refused.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from scout_core.adapter import torch_adapter
from scout_core.config import ConfigError, ScoutConfig, resolve
from scout_core.report import Incident
from scout_core.runtime import ScoutHandle, enable_with
from scout_lightning.checkpoints import continue_after_load, label_saves, plan_restart, refuse_rejected_load

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
        self.restart_plans: list[Any] = []
        """What the restart plan chose at setup, per ModelCheckpoint folder."""
        self._undo: list[Callable[[], None]] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.restart_plans = plan_restart(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            log.warning("scout_lightning: SCOUT is not attached: this job runs one process (SCOUT compares peers)")
            return
        if trainer.ckpt_path:
            refuse_rejected_load(os.fspath(trainer.ckpt_path), allowed=self.config.checkpoint.load_rejected)
        refused = _unsupported(trainer)
        if refused is not None:
            raise ConfigError(f"scout_lightning: SCOUT does not diagnose {refused} yet; remove the callback for this "
                              "job")
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
        if trainer.ckpt_path:
            continue_after_load(self.handle, os.fspath(trainer.ckpt_path), int(trainer.global_step))

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
    gradient buckets it then observes (a rank that never reaches the step's all-reduce is told apart from its peers
    waiting in it: without them a hang of one rank before its forward looked like every rank waiting at once)."""
    found = torch_adapter(_model_of(pl_module), optimizers)
    wrapped = trainer.strategy.model
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return found
    return torch_adapter(wrapped, optimizers, layers=found.layers, embedding=found.embedding, output=found.output)


def _model_of(pl_module: nn.Module) -> nn.Module:
    """The model inside the LightningModule that SCOUT looks into: the module's only child holding all its
    parameters (``self.model = GPT2LMHeadModel(...)``), followed down while that holds; else the module itself."""
    module = pl_module
    total = sum(1 for _ in module.parameters())
    while True:
        holders = [c for c in module.children() if sum(1 for _ in c.parameters()) == total]
        if len(holders) != 1 or len(list(module.children())) != 1:
            return module
        module = holders[0]


def _unsupported(trainer: Any) -> str | None:
    """A strategy or optimizer SCOUT cannot diagnose under Lightning (None: DDP, FSDP2 without tensor parallelism)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        return "Lightning's FSDPStrategy (FSDP1); FSDP2 through ModelParallelStrategy is supported"
    if isinstance(strategy, ModelParallelStrategy):
        mesh = getattr(strategy, "device_mesh", None)
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            return "tensor parallelism (ModelParallelStrategy's tensor_parallel_size above 1)"
    for opt in trainer.optimizers:
        if isinstance(opt, torch.optim.LBFGS):
            return "LBFGS (it calls its closure more than once per step)"
    return None


def _closure_first(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Make ``optimizer.step(closure)`` run the closure, then the step without it (see the module's docstring);
    returns what puts the optimizer's own step back."""
    step = optimizer.step

    @functools.wraps(step)
    def closure_first(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is None:
            return step(**kwargs)
        with torch.enable_grad():
            loss = closure()
        step(**kwargs)
        return loss

    optimizer.step = closure_first  # type: ignore[method-assign]

    def restore() -> None:
        if vars(optimizer).get("step") is closure_first:
            del optimizer.step

    return restore
