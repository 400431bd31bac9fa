"""``ScoutCallback``: SCOUT in a ``transformers.Trainer`` job through the Trainer's callback API.

``Trainer(..., callbacks=[ScoutCallback("scout.yaml")])`` is the whole integration. The callback acts on the
Trainer's own events:

* ``on_init_end`` (the Trainer is built, the process group is up, ``train()`` not yet called): the restart plan,
  which steers ``resume_from_checkpoint=True`` to the checkpoint SCOUT chose (:mod:`scout_hf.checkpoints`). A
  callback added later (``trainer.add_callback``) misses this event: the Trainer then resumes from its newest
  folder, and the callback refuses at train begin only a folder SCOUT labelled rejected.
* ``on_train_begin`` (the model prepared, the optimizer and LR scheduler built, a checkpoint loaded): SCOUT attached
  to the Trainer's wrapped model and optimizer (:func:`scout_hf.prepared.attach_prepared`), certification of the
  ``checkpoint-N`` folders started, and SCOUT's step count set to the Trainer's global step after a resume.
  The Trainer's accelerator, wrapped model and the path it resumed from are not among a callback's arguments: the
  callback takes them from the Trainer whose ``train()`` called it (the caller's frame, once per ``train()``).
* ``on_step_end`` with ``control.should_save``, then ``on_save``: the save marked as checkpoint I/O, then labelled.
* ``on_train_end``: SCOUT closed, a normal end (a relaunch goes on from the newest checkpoint not rejected). A run
  that raises never gets here: SCOUT closes at interpreter exit as after a failure.

SCOUT's step boundary is the optimizer step itself (Accelerate calls the torch optimizer only at the end of a
gradient accumulation), so replay and certification follow the Trainer's ``global_step``. SCOUT's own in-memory
snapshots (``checkpoint.enabled``) are refused: they would not hold the Trainer's state (its data position, RNG,
scaler); certification labels the Trainer's checkpoints instead.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from scout_core.config import ConfigError, ScoutConfig, resolve
from scout_core.report import Incident
from scout_core.runtime import ScoutHandle
from scout_hf.checkpoints import TrainerCheckpoints, plan_restart, refuse_rejected_load
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
        """What the restart plan chose at the Trainer's construction (None: no labels, the Trainer's own choice)."""

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.restart_plan = plan_restart(args.output_dir)
        if args.save_total_limit and args.save_strategy != "no":
            log.warning("scout_hf: save_total_limit=%d: the Trainer deletes older checkpoint folders, the newest "
                        "verified one too; a restart after an SDC verdict then goes back further, or to the start",
                        args.save_total_limit)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.handle is not None:  # a second train() on the same Trainer: the first one's SCOUT ended with it
            self._close()
        trainer, resumed = _calling_trainer()
        step = int(state.global_step)
        if resumed and step > 0:
            refuse_rejected_load(resumed, step, allowed=self.config.checkpoint.load_rejected)
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
        if resumed:
            self.checkpoints.resumed(resumed, step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpoints is not None and control.should_save:
            self.checkpoints.saving()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpoints is not None:
            self.checkpoints.saved(int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        handle, self.handle, self.checkpoints = self.handle, None, None
        if handle is not None:
            handle.close()


def _calling_trainer() -> tuple[Trainer | None, str | None]:
    """The Trainer whose training loop called this event, and the checkpoint folder it resumed from (None: a fresh
    start), read from the loop's frame: a callback's arguments carry neither."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and frame.f_code.co_name == "_inner_training_loop":
            resumed = frame.f_locals.get("resume_from_checkpoint")
            return owner, resumed if isinstance(resumed, (str, os.PathLike)) else None
        frame = frame.f_back
    return None, None
