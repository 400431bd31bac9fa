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
* with TorchTitan's checkpoints on, every TorchTitan checkpoint labelled latest / candidate / verified /
  rejected by SCOUT's certification in ``scout-labels.json`` beside them; on restart TorchTitan loads the step
  the retrieval policy chose (:mod:`scout_core.checkpoint.durable`) instead of its newest, the newer step
  folders are set aside in ``scout-set-aside/``, and SCOUT's step count and certification go on from there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.tools import filesystem

from scout_torchtitan.config import ScoutSection

__all__ = ["SET_ASIDE", "ScoutCheckpointManager", "with_scout_checkpointer"]

SET_ASIDE = "scout-set-aside"
"""Where a restart moves the step folders newer than the one it loads (inside TorchTitan's checkpoint folder)."""

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
        self.trainer = trainer
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
            if filesystem.is_remote(self.folder):
                log.warning("scout_torchtitan: checkpoint folder %s is remote: its checkpoints are not labelled "
                            "(the labels need a shared POSIX folder) and a restart loads TorchTitan's choice",
                            self.folder)
            else:
                self.labels = self.scout.label_framework_checkpoints(self.folder)

    # -- TorchTitan's hooks, marked and labelled ---------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        with self.scout.checkpoint_io("write"):
            wrote = super()._save(curr_step, last_step)
        if wrote and self.labels is not None:
            try:
                self.labels.saved(curr_step, self._create_checkpoint_id(curr_step), self.scout.certifier)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                self.scout.guard.report(curr_step, "checkpoint", exc, "labelling TorchTitan's checkpoint")
        return wrote

    def _load(self, step: int = -1) -> bool:
        plan = self._restart_plan(step) if self.labels is not None else None
        with self.scout.checkpoint_io("read"):
            loaded = super()._load(step if plan is None else plan["load"])
        if loaded:
            # SCOUT's step count, replay schedule and certification go on from the loaded step, not from 0.
            verified = plan["verified"] if plan is not None else None
            self.scout.continue_from(self.trainer.step, verified=verified)
        return loaded

    def _restart_plan(self, asked: int) -> dict[str, Any] | None:
        """Rank 0 decides for every rank (their views of the files may differ) and broadcasts: which step
        TorchTitan loads, with every step folder newer than it set aside (so that no later restart, purge or
        fallback can reach them); None: no labels, TorchTitan's own choice."""
        plan: dict[str, Any] | None = None
        if dist.get_rank() == 0:
            try:
                plan = self._plan(asked)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                log.error("scout_torchtitan: choosing the restart step failed (%s: %s): TorchTitan's own choice "
                          "is loaded, unchecked by SCOUT", type(exc).__name__, exc)
                plan = {"error": f"{type(exc).__name__}: {exc}"}
        box = [plan]
        dist.broadcast_object_list(box, src=0, group=self.scout.groups.world_control)
        plan = box[0]
        if plan is None or "error" in plan:
            return None
        self.labels.entries = {int(k): v for k, v in plan["entries"].items()}  # rank 0's, after the restart
        self.labels.stopped_for = None
        return plan

    def _plan(self, asked: int) -> dict[str, Any] | None:
        labels = self.labels
        if not labels.entries:
            return None  # nothing SCOUT labelled: a fresh job, or one whose unsafe checkpoints are set aside
        if asked != -1:
            load, why = asked, f"--checkpoint.load_step {asked} asked for"
        else:
            choice = labels.choose(exists=self._complete)
            load, why = choice.step, f"{choice.label}: {choice.reason}"
        steps = [s for s in self._step_folders() if load is None or s > load]
        if load is None:  # nothing is safe: every labelled checkpoint goes, and the unlabelled ones after them
            first = min(labels.entries)
            steps = [s for s in self._step_folders() if s >= first]
        verified = max((s for s, e in labels.entries.items()
                        if e["label"] == "verified" and (load is None or s <= load)), default=None)
        aside = [self._set_aside(s) for s in sorted(steps)]
        labels.restarted_from(load, set_aside=aside)
        if load is None:
            log.error("scout_torchtitan: no TorchTitan checkpoint is safe to load (%s); %d set aside in %s: TorchTitan "
                      "starts from what is left (its initial load, if configured)", why, len(aside), SET_ASIDE)
        else:
            log.warning("scout_torchtitan: restarting from TorchTitan checkpoint step %d (%s); %d newer set aside "
                        "in %s", load, why, len(aside), SET_ASIDE)
        return {"load": -1 if load is None else load, "verified": verified,
                "entries": {str(k): v for k, v in labels.entries.items()}}

    def _complete(self, step: int) -> bool:
        return os.path.isfile(os.path.join(self._create_checkpoint_id(step), ".metadata"))

    def _step_folders(self) -> list[int]:
        if not os.path.isdir(self.folder):
            return []
        return sorted(int(m.group(1)) for m in (re.fullmatch(r"step-(\d+)", n) for n in os.listdir(self.folder)) if m)

    def _set_aside(self, step: int) -> str:
        """Move ``step-N`` into ``scout-set-aside/`` (kept for forensics; TorchTitan no longer sees it)."""
        target_dir = os.path.join(self.folder, SET_ASIDE)
        os.makedirs(target_dir, exist_ok=True)
        target = os.path.join(target_dir, f"step-{step}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        os.replace(self._create_checkpoint_id(step), target)
        for folder in (target_dir, self.folder):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return target

    def close(self) -> None:
        # Public close (not the _close hook): SCOUT is attached even when TorchTitan's checkpointing is off.
        scout, self.scout = getattr(self, "scout", None), None
        try:
            if scout is not None:
                scout.close()  # may raise ScoutStop (a pending stop): TorchTitan's own close runs regardless
        finally:
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
