"""``ScoutTrainer``: TorchTitan's ``Trainer`` with a ``scout`` config section.

With ``--scout.enable`` off it is TorchTitan's Trainer: nothing of SCOUT is installed. On, SCOUT is attached
once the Trainer has built its model parts, optimizers and meshes (:func:`scout_torchtitan.attach.attach`),
and closed before the Trainer closes. Through TorchTitan's own components:

* the data loader's batches pass through SCOUT's progress marks (a rank waiting for data is seen as such by the
  hang observer, and the end of a fetch is where a training step ends for SCOUT);
* checkpoint saves and loads are marked as checkpoint I/O (a long write is not a hang);
* with SCOUT's certification on (``--scout.checkpoint.enabled``) and TorchTitan's checkpoints on, each
  TorchTitan checkpoint is labelled latest / candidate / verified / rejected in ``scout-labels.json`` beside
  them (:mod:`scout_core.checkpoint.durable`), and a restart loads the step the retrieval policy chose instead
  of TorchTitan's newest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torchtitan.trainer import Trainer

from scout_torchtitan.compat import ensure_set_timeout
from scout_torchtitan.config import ScoutSection

__all__ = ["ScoutTrainer"]

log = logging.getLogger("scout_torchtitan")


class ScoutTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        scout: ScoutSection = field(default_factory=ScoutSection)
        """SCOUT: ``--scout.enable`` switches it on; every other key is scout_core's schema."""

    def __init__(self, config: Config) -> None:
        self.scout: Any = None
        self.checkpoint_labels: Any = None
        ensure_set_timeout()  # TorchTitan 0.3 on torch 2.13 stops after step 1 without it (compat.py)
        if config.scout.enable and not config.training.disable_cuda_graphs:
            # A captured CUDA graph replays kernels without running Python: module hooks (SCOUT's capture of
            # the sampled layer's inputs, its progress marks) would be silent after the capture.
            log.warning("scout_torchtitan: CUDA-graph capture of forward and backward is disabled "
                        "(--training.disable_cuda_graphs): SCOUT observes modules through hooks")
            config.training.disable_cuda_graphs = True
        super().__init__(config)
        if config.scout.enable:
            from scout_torchtitan.attach import attach

            self.scout = attach(self)
            self._wrap_checkpointer()

    # -- TorchTitan's data loader and checkpointer, marked and labelled -------------------------------------

    def batch_generator(self, data_iterable: Iterable[Any]) -> Iterator[Any]:
        if self.scout is not None:
            data_iterable = self.scout.wrap_dataloader(data_iterable)
        return super().batch_generator(data_iterable)

    def _wrap_checkpointer(self) -> None:
        ckpt = self.checkpointer
        if not getattr(ckpt, "enable", False):
            return
        if hasattr(ckpt, "folder"):
            self.checkpoint_labels = self.scout.label_framework_checkpoints(ckpt.folder)
        save, load, scout = ckpt.save, ckpt.load, self.scout

        def save_marked(curr_step: int, last_step: bool = False) -> bool:
            with scout.checkpoint_io("write"):
                wrote = save(curr_step, last_step)
            if wrote and self.checkpoint_labels is not None:
                self._label_saved(curr_step)
            return wrote

        def load_chosen(step: int = -1) -> bool:
            chosen = self._restart_step(step)
            if chosen is None:
                return False
            with scout.checkpoint_io("read"):
                return load(step=chosen)

        ckpt.save, ckpt.load = save_marked, load_chosen

    def _label_saved(self, step: int) -> None:
        try:
            cert = self.scout.checkpoint.certifier
            self.checkpoint_labels.saved(step, self.checkpointer._create_checkpoint_id(step), cert)
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.scout.guard.report(step, "checkpoint", exc, "labelling TorchTitan's checkpoint")

    def _restart_step(self, asked: int) -> int | None:
        """The step TorchTitan loads: what the user asked for on a fresh job, else the retrieval policy's
        choice among the labelled checkpoints that still exist (None: load nothing)."""
        labels = self.checkpoint_labels
        if labels is None or not labels.entries:
            return asked  # nothing SCOUT labelled: TorchTitan's own choice (an initial load, say)
        if asked != -1:
            log.warning("scout_torchtitan: --checkpoint.load_step %d asked for; SCOUT's labels are ignored", asked)
            return asked
        exists = lambda s: os.path.isfile(os.path.join(self.checkpointer._create_checkpoint_id(s), ".metadata"))  # noqa: E731
        # Rank 0 chooses for everyone: every rank must load the same step, whatever its view of the files.
        box = [labels.choose(exists=exists) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.scout.groups.world_control)
        choice = box[0]
        if choice.step is None:
            log.error("scout_torchtitan: no TorchTitan checkpoint is safe to load (%s): training starts afresh",
                      choice.reason)
        else:
            log.warning("scout_torchtitan: restarting from TorchTitan checkpoint step %d (%s; %s)",
                        choice.step, choice.label, choice.reason)
        labels.restarted_from(choice.step)
        return choice.step

    def close(self) -> None:
        if self.scout is not None:
            self.scout.close()
            self.scout = None
        super().close()
