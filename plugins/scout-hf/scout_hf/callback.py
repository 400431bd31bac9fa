"""``ScoutCallback``: SCOUT in a ``transformers.Trainer`` job through the Trainer's callback API.

``Trainer(..., callbacks=[ScoutCallback("scout.yaml")])`` is the whole integration. The callback acts on the
Trainer's own events:

* ``on_init_end`` (the Trainer is built, the process group is up, ``train()`` not yet called): the Trainer's
  ``train`` wrapped, so that ``train(resume_from_checkpoint=True)`` first makes the restart plan, which steers it
  to the checkpoint SCOUT chose (:mod:`scout_hf.checkpoints`); a fresh start or a folder the user names moves
  nothing. A callback added later (``trainer.add_callback``) misses this event: the Trainer then resumes from its
  newest folder, and the callback refuses at train begin only a folder SCOUT labelled rejected.
* ``on_train_begin`` (the model prepared, the optimizer and LR scheduler built, a checkpoint loaded): SCOUT attached
  to the Trainer's wrapped model and optimizer (:func:`scout_hf.prepared.attach_prepared`), certification of the
  ``checkpoint-N`` folders started, and SCOUT's step count set to the Trainer's global step after a resume.
  The Trainer's accelerator, wrapped model and the path it resumed from are not among a callback's arguments: the
  callback takes them from the Trainer whose ``train()`` called it (the caller's frame, once per ``train()``).
* every save (the Trainer's ``_save_checkpoint``, whatever its save strategy: steps, epoch, best) is checkpoint I/O
  for the hang observers; ``on_save``: the folder labelled.
* ``on_train_end``: SCOUT closed, a normal end (a relaunch goes on from the newest checkpoint not rejected). A run
  that raises never gets here: SCOUT closes at interpreter exit, or at the next ``train()``, as after a failure.

SCOUT's step boundary is the optimizer step itself (Accelerate calls the torch optimizer only at the end of a
gradient accumulation), so replay and certification follow the Trainer's ``global_step``. SCOUT's own in-memory
snapshots (``checkpoint.enabled``) are refused: they would not hold the Trainer's state (its data position, RNG,
scaler); certification labels the Trainer's checkpoints instead.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from scout_core.config import ConfigError, ScoutConfig, resolve
from scout_core.plugin_support import InstanceAttribute
from scout_core.report import Incident
from scout_core.runtime import ScoutHandle
from scout_hf.checkpoints import TrainerCheckpoints, adopt_start, plan_restart, refuse_rejected_load
from scout_hf.prepared import attach_prepared

__all__ = ["ScoutCallback"]

log = logging.getLogger("scout_hf")


class ScoutCallback(TrainerCallback):
    """SCOUT for a ``transformers.Trainer``: pass it in ``callbacks=[...]`` when the Trainer is built.

    ``config``: SCOUT's configuration, a YAML file's path or a :class:`ScoutConfig` (None: the shipped defaults),
    ``overrides`` dotted ``key=value`` on top (``["replay.cadence.hidden=10"]``). ``on_incident`` runs in the
    observer process for each hang verdict (see :func:`scout_core.enable`). The configuration is read when the
    callback is built: a wrong key fails the launch there, naming it."""

    def __init__(self, config: ScoutConfig | str | os.PathLike[str] | None = None, *, overrides: Sequence[str] = (),
                 on_incident: Callable[[Incident], None] | str | None = None) -> None:
        self.config = resolve(config, overrides)
        if self.config.checkpoint.enabled:
            raise ConfigError("scout_hf: checkpoint.enabled: SCOUT's in-memory snapshots do not hold the Trainer's "
                              "own state (data position, RNG, gradient scaler); certification labels the Trainer's "
                              "checkpoint-N folders and resume_from_checkpoint=True loads the one SCOUT chose. Set it "
                              "to false")
        self.on_incident = on_incident
        self.handle: ScoutHandle | None = None
        self.checkpoints: TrainerCheckpoints | None = None
        self.restart_plan: dict[str, Any] | None = None
        """What the restart plan chose for ``resume_from_checkpoint=True`` (None: no plan, the Trainer's own choice)."""
        self._undo: list[Callable[[], None]] = []

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer("__init__")[0]
        if trainer is not None:
            _plan_before_resume(self, trainer)
        if args.save_total_limit and args.save_strategy != "no":
            log.warning("scout_hf: save_total_limit=%d: the Trainer deletes older checkpoint folders, the newest "
                        "verified one too; a restart after an SDC verdict then goes back further, or to the start",
                        args.save_total_limit)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.handle is not None:  # the last train() raised (on_train_end closes otherwise): a failed end
            self._close(failed=True)
        trainer, resumed = _calling_trainer("_inner_training_loop")
        step = int(state.global_step)
        if resumed and step > 0:
            refuse_rejected_load(resumed, step, allowed=self.config.checkpoint.load_rejected)
        adopt_start(args.output_dir, resumed, step)  # before the labels are read for this run
        if trainer is not None:
            kind = str(trainer.accelerator.distributed_type.value)
            model = trainer.model_wrapped
            parallelism = getattr(trainer.accelerator, "parallelism_config", None)
        else:
            log.warning("scout_hf: ScoutCallback was not called from a transformers.Trainer's train(): SCOUT sees "
                        "the model it was handed, not the wrapper training uses")
            kind, parallelism = "MULTI_CPU", None
        self.handle = attach_prepared(kind, model, optimizer, config=self.config, on_incident=self.on_incident,
                                      parallelism=parallelism)
        if self.handle is None:
            return
        self.checkpoints = TrainerCheckpoints(self.handle, args.output_dir)
        if trainer is not None:
            self._undo.append(_saves_as_io(trainer, self.handle))
        if resumed:
            self.checkpoints.resumed(resumed, step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpoints is not None:
            self.checkpoints.saved(int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self, *, failed: bool | None = None) -> None:
        handle, self.handle, self.checkpoints = self.handle, None, None
        undo, self._undo = self._undo, []
        try:
            if handle is not None:
                handle.close(failed=failed)
        finally:
            for put_back in reversed(undo):
                put_back()


def _calling_trainer(method: str) -> tuple[Trainer | None, str | None]:
    """The Trainer whose ``method`` (``__init__``, ``_inner_training_loop``) called this event, and the checkpoint
    folder the loop resumed from (None: a fresh start), read from that frame: a callback's arguments carry
    neither."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and frame.f_code.co_name == method:
            resumed = frame.f_locals.get("resume_from_checkpoint")
            return owner, os.fspath(resumed) if isinstance(resumed, (str, os.PathLike)) else None
        frame = frame.f_back
    return None, None


def _plan_before_resume(callback: ScoutCallback, trainer: Trainer) -> None:
    """Wrap this Trainer's ``train`` so that ``resume_from_checkpoint=True`` (the Trainer's newest folder) first
    makes SCOUT's restart plan (every rank calls ``train``)."""
    train = trainer.train

    @functools.wraps(train)
    def planned_train(*args: Any, **kwargs: Any) -> Any:
        resume = kwargs["resume_from_checkpoint"] if "resume_from_checkpoint" in kwargs else (args[0] if args
                                                                                              else None)
        if resume is True:
            callback.restart_plan = plan_restart(trainer.args.output_dir)
        return train(*args, **kwargs)

    InstanceAttribute(trainer, "train", planned_train)


def _saves_as_io(trainer: Trainer, handle: ScoutHandle) -> Callable[[], None]:
    """Every save of this Trainer is checkpoint I/O for the hang observers (a save that takes minutes is not a
    stall); returns what puts the Trainer's own ``_save_checkpoint`` back."""
    save = trainer._save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with handle.checkpoint_io("write"):
            return save(*args, **kwargs)

    return InstanceAttribute(trainer, "_save_checkpoint", save_checkpoint).remove
