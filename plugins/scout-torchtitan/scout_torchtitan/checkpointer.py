"""``ScoutCheckpointManager``: TorchTitan's DCP checkpoint manager, with SCOUT attached to the Trainer it serves.

TorchTitan builds its checkpoint manager once the model parts, optimizers, LR schedulers and data loader exist,
and hands it the Trainer itself (``states["train_state"]``). That makes the manager the one place from which
both forms of the toggle install SCOUT on a built Trainer:

* ``ScoutTrainer`` (``--module scout_torchtitan ... --scout.enable``) swaps its checkpoint config for this one;
* ``--override.imports scout_torchtitan.override.scout`` does the same for an unchanged ``--module``/``--config``.

What it adds to the Trainer, through TorchTitan's own components:

* SCOUT itself (:func:`scout_torchtitan.attach.attach`), closed before the manager closes;
* CUDA-graph capture of forward and backward switched off, with a warning (module hooks would be silent);
* the data loader's batches through SCOUT's progress marks, and checkpoint saves and loads marked as I/O;
* with TorchTitan's checkpoints and SCOUT's certification both on, every TorchTitan checkpoint labelled
  latest / candidate / verified / rejected in ``scout-labels.json`` beside them, and on restart TorchTitan loads
  the step the retrieval policy chose (:mod:`scout_core.checkpoint.durable`) instead of its newest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager

from scout_torchtitan.config import ScoutSection

__all__ = ["ScoutCheckpointManager", "with_scout_checkpointer"]

log = logging.getLogger("scout_torchtitan")


class ScoutCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        scout: ScoutSection = field(default_factory=lambda: ScoutSection(enable=True))
        """The SCOUT configuration this manager attaches with."""

    def __init__(self, config: Config, *, states: dict[str, Any], **kwargs: Any) -> None:
        self.scout: Any = None
        self.labels: Any = None
        super().__init__(config, states=states, **kwargs)
        trainer = states.get("train_state")
        if trainer is None or not hasattr(trainer, "parallel_dims"):
            raise TypeError("scout_torchtitan.ScoutCheckpointManager is built by TorchTitan's Trainer, which passes "
                            "itself as states['train_state']; it got no Trainer")
        if not trainer.config.training.disable_cuda_graphs:
            # A captured CUDA graph replays kernels without running Python: module hooks (SCOUT's capture of the
            # sampled layer's inputs, its progress marks) would be silent after the capture.
            log.warning("scout_torchtitan: CUDA-graph capture of forward and backward is disabled "
                        "(--training.disable_cuda_graphs): SCOUT observes modules through hooks")
            trainer.config.training.disable_cuda_graphs = True
        from scout_torchtitan.attach import attach

        self.scout = attach(trainer, config.scout)
        _mark_batches(trainer, self.scout)
        if self.enable:
            self.labels = self.scout.label_framework_checkpoints(self.folder)

    # -- TorchTitan's hooks, marked and labelled ---------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        with self.scout.checkpoint_io("write"):
            wrote = super()._save(curr_step, last_step)
        if wrote and self.labels is not None:
            try:
                self.labels.saved(curr_step, self._create_checkpoint_id(curr_step),
                                  self.scout.checkpoint.certifier)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                self.scout.guard.report(curr_step, "checkpoint", exc, "labelling TorchTitan's checkpoint")
        return wrote

    def _load(self, step: int = -1) -> bool:
        chosen = self._restart_step(step)
        if chosen is None:
            return False
        with self.scout.checkpoint_io("read"):
            return super()._load(chosen)

    def _restart_step(self, asked: int) -> int | None:
        """The step TorchTitan loads: its own choice when SCOUT labelled nothing (a fresh job, an initial load)
        or the user named one, else the retrieval policy's among the labelled checkpoints still on disk."""
        labels = self.labels
        if labels is None or not labels.entries:
            return asked
        if asked != -1:
            log.warning("scout_torchtitan: --checkpoint.load_step %d asked for: SCOUT's labels are not used", asked)
            return asked
        done = lambda s: os.path.isfile(os.path.join(self._create_checkpoint_id(s), ".metadata"))  # noqa: E731
        # Rank 0 chooses for everyone: every rank must load the same step, whatever its view of the files.
        box = [labels.choose(exists=done) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.scout.groups.world_control)
        choice = box[0]
        if choice.step is None:
            log.error("scout_torchtitan: no TorchTitan checkpoint is safe to load (%s): training starts afresh",
                      choice.reason)
        else:
            log.warning("scout_torchtitan: restarting from TorchTitan checkpoint step %d (%s: %s)",
                        choice.step, choice.label, choice.reason)
        labels.restarted_from(choice.step)
        return choice.step

    def close(self) -> None:
        # Public close (not the _close hook): SCOUT is attached even when TorchTitan's checkpointing is off.
        scout, self.scout = getattr(self, "scout", None), None
        if scout is not None:
            scout.close()
        super().close()


def _mark_batches(trainer: Any, scout: Any) -> None:
    """TorchTitan's batches through SCOUT's data-loader marks (the Trainer's own ``batch_generator``)."""
    batches = trainer.batch_generator

    def marked(data_iterable: Iterable[Any]) -> Iterator[Any]:
        return batches(scout.wrap_dataloader(data_iterable))

    trainer.batch_generator = marked


def with_scout_checkpointer(checkpoint: Any, section: ScoutSection) -> ScoutCheckpointManager.Config:
    """``checkpoint`` (TorchTitan's checkpoint config) as a :class:`ScoutCheckpointManager` config carrying
    ``section``; every TorchTitan setting kept."""
    if isinstance(checkpoint, ScoutCheckpointManager.Config):
        return dataclasses.replace(checkpoint, scout=section)
    if type(checkpoint) is not CheckpointManager.Config:
        raise TypeError(f"scout_torchtitan attaches through TorchTitan's DCP CheckpointManager; this job's checkpoint "
                        f"config is {type(checkpoint).__qualname__}, which it does not support yet")
    values = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint) if f.init}
    return ScoutCheckpointManager.Config(**values, scout=section)
