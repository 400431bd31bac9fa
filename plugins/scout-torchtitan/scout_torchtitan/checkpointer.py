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

from scout_core.checkpoint.durable import RejectedCheckpointError, rejected_message
from scout_core.checkpoint.store import fsync_dir
from scout_core.config import CheckpointConfig
from scout_core.wire import broadcast_data
from scout_torchtitan.config import ScoutSection

__all__ = ["SET_ASIDE", "ScoutCheckpointManager", "evidence_of_sdc", "with_scout_checkpointer"]

SET_ASIDE = "scout-set-aside"
"""Where a restart moves the step folders newer than the one it loads (inside TorchTitan's checkpoint folder)."""

log = logging.getLogger("scout_torchtitan")


def evidence_of_sdc(decision: dict[str, Any] | None) -> bool:
    """SCOUT's restart found SDC in its own latest snapshot (its sweep was dirty), or the job stopped on SDC:
    TorchTitan's newer checkpoints hold the same suspect state, so only a verified one may load. A lost machine or
    a sweep that could not run is no evidence either way: the labels' own policy holds (the newest verified, else
    the newest not rejected, which the reason calls unproven)."""
    decision = decision or {}
    return decision.get("sweep_clean") is False or decision.get("failure") == "sdc"


class ScoutCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        scout: ScoutSection = field(default_factory=lambda: ScoutSection(enable=True))
        """The SCOUT configuration this manager attaches with."""

    def __init__(self, config: Config, *, states: dict[str, Any], **kwargs: Any) -> None:
        self.scout: Any = None
        self.labels: Any = None
        self._failure: str | None = None  # "sdc" once SCOUT restored a snapshot: only a verified one may replace it
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

        self.scout = attach(trainer, _job_local(config.scout, trainer.config.dump_folder, config.folder))
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

    def load(self, step: int = -1) -> bool:
        """With SCOUT's snapshots on (``--scout.checkpoint.enabled``), SCOUT's retrieval policy restores its own
        snapshot first (from memory when it can: the fast path), then TorchTitan loads a checkpoint of its own
        only if the one its labels choose is newer; otherwise TorchTitan's load, as below. Also runs when
        TorchTitan's own checkpointing is off: SCOUT's snapshots are then the only ones."""
        scout = self.scout
        if scout is None or scout.checkpoint is None or step != -1 or getattr(self, "load_only", False):
            return super().load(step)
        result = scout.resume()
        restored = result.step
        # A TorchTitan checkpoint may replace SCOUT's restored snapshot only if it is verified: SCOUT's restore is
        # certified, or swept clean, while an unverified TorchTitan checkpoint is neither. Nor may an unverified
        # one be loaded when SCOUT has evidence against the newest state (see evidence_of_sdc).
        self._failure = "sdc" if restored is not None or evidence_of_sdc(result.decision) else None
        if restored is not None:
            self.trainer.step = restored  # the Trainer's count (the data loader and LR schedulers came back with
            # the snapshot's caller state)
            if dist.get_rank() == 0:
                log.warning("scout_torchtitan: SCOUT restored its %s snapshot of step %d%s (%s)", result.source,
                            restored, " from memory" if result.from_memory else "", result.reason)
        if not self.enable:
            return restored is not None
        return self._load(step, restored=restored)

    def _load(self, step: int = -1, restored: int | None = None) -> bool:
        plan = self._restart_plan(step, restored) if self.labels is not None else None
        if restored is not None and (plan is None or plan["load"] is None):
            return True  # SCOUT's snapshot is the state: TorchTitan loads nothing over it
        with self.scout.checkpoint_io("read"):
            loaded = super()._load(step if plan is None else plan["load"])
        if loaded:
            # SCOUT's step count, replay schedule and certification go on from the loaded step, not from 0; the
            # restored state is as trusted as the newest verified checkpoint at or before it.
            at = int(self.trainer.step)
            # (A load-only job, evaluation, abandons nothing: SCOUT's snapshots of the run it reads stay.)
            self.scout.continue_from(at, verified=self.labels.verified_at(at) if self.labels is not None else None,
                                     abandon_newer=not self.load_only)
        return loaded

    def _restart_plan(self, asked: int, restored: int | None = None) -> dict[str, Any] | None:
        """Rank 0 decides for every rank (their views of the files may differ) and broadcasts the exact step
        TorchTitan loads (-1: none, its initial load; None: nothing over SCOUT's ``restored`` snapshot); None:
        TorchTitan's own choice (no labels, a load-only job).
        After an SDC stop a plan that cannot be made stops the job on every rank: loading TorchTitan's newest
        then would restore the state the verdict rejected."""
        plan: dict[str, Any] | None = None
        if dist.get_rank() == 0:
            try:
                plan = self._plan(asked, restored)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training, except to stop a bad load
                why = f"{type(exc).__name__}: {exc}"
                # Fatal only when TorchTitan's newest would be loaded: a restored SCOUT snapshot stays otherwise.
                plan = {"error": why, "fatal": self.labels.stopped_for == "sdc" and restored is None}
        plan = broadcast_data(plan, 0, self.scout.groups.world_control, what="checkpoint plan")
        if plan is not None and "rejected" in plan:
            if not self.scout.config.checkpoint.load_rejected:
                raise RejectedCheckpointError(plan["rejected"])
            log.warning("%s (checkpoint.load_rejected: loading it as asked)", plan["rejected"])
        if plan is not None and "error" in plan:
            if plan["fatal"]:
                raise RuntimeError(f"scout_torchtitan: the job stopped on an SDC verdict and the restart step cannot "
                                   f"be chosen ({plan['error']}): refusing to load TorchTitan's newest checkpoint")
            log.error("scout_torchtitan: choosing the restart step failed (%s): %s", plan["error"],
                      f"SCOUT's snapshot of step {restored} is kept" if restored is not None
                      else "TorchTitan's own choice is loaded, unchecked by SCOUT")
            return None
        if plan is not None:
            self.labels.entries = {int(k): v for k, v in plan["entries"].items()}  # rank 0's, after the restart
            self.labels.stopped_for = None
        return plan

    def _plan(self, asked: int, restored: int | None = None) -> dict[str, Any] | None:
        labels = self.labels
        if restored is not None:
            choice = labels.choose(self._failure, exists=self._complete) if labels.entries else None
            if choice is None or choice.step is None or choice.step <= restored:
                # SCOUT's snapshot is the newest safe state: every TorchTitan step folder after it leaves
                # TorchTitan's reach (a later save of the same step must not land on an abandoned one).
                aside = []
                try:
                    for step in sorted((s for s in self._step_folders() if s > restored), reverse=True):
                        aside.append(self._set_aside(step))
                finally:
                    labels.restarted_from(restored, set_aside=aside)
                if aside:
                    log.warning("scout_torchtitan: %d TorchTitan checkpoint(s) newer than SCOUT's snapshot of step "
                                "%d set aside in %s", len(aside), restored, SET_ASIDE)
                return {"load": None, "entries": {str(k): v for k, v in labels.entries.items()}}
            # A TorchTitan checkpoint the labels trust is newer than SCOUT's snapshot: it is loaded over it.
        if not labels.entries or self.load_only:
            return None  # nothing SCOUT labelled (a fresh job, or its unsafe checkpoints are set aside), or a job
            # that only reads this folder (evaluation): TorchTitan's own choice, nothing moved
        if asked != -1:
            if not self._complete(asked):
                raise FileNotFoundError(f"--checkpoint.load_step {asked}: no complete checkpoint at "
                                        f"{self._create_checkpoint_id(asked)}")
            rejected = rejected_message(labels, lambda step, _entry: step == asked,
                                        f"--checkpoint.load_step {asked}", who="scout_torchtitan")
            if rejected is not None and not self.scout.config.checkpoint.load_rejected:
                return {"rejected": rejected}  # refused on every rank, nothing moved or relabelled
            # The user's choice, nothing moved; the labels of the abandoned steps go (the new run overwrites them).
            labels.restarted_from(asked)
            log.warning("scout_torchtitan: --checkpoint.load_step %d asked for: loaded as asked", asked)
            return {"load": asked, "entries": {str(k): v for k, v in labels.entries.items()},
                    **({"rejected": rejected} if rejected is not None else {})}
        choice = labels.choose(self._failure, exists=self._complete)
        load = choice.step
        # Every step folder newer than the chosen one (all the labelled ones and those after, if none is chosen)
        # leaves TorchTitan's reach, newest first: the rejected one goes before anything else can fail.
        after = load if load is not None else min(labels.entries) - 1
        aside = []
        try:
            for step in sorted((s for s in self._step_folders() if s > after), reverse=True):
                aside.append(self._set_aside(step))
        finally:
            labels.restarted_from(load, set_aside=aside)  # what was moved is recorded, whatever happens next
        if load is None:
            load = self._find_load_step()  # what is left, resolved once here: every rank loads the same
            log.error("scout_torchtitan: no TorchTitan checkpoint is safe to load (%s); %d set aside in %s: "
                      "TorchTitan starts from %s", choice.reason, len(aside), SET_ASIDE,
                      f"step {load}" if load != -1 else "its initial load, if configured")
        else:
            log.warning("scout_torchtitan: restarting from TorchTitan checkpoint step %d (%s: %s); %d newer set "
                        "aside in %s", load, choice.label, choice.reason, len(aside), SET_ASIDE)
        return {"load": load, "entries": {str(k): v for k, v in labels.entries.items()}}

    def _complete(self, step: int) -> bool:
        """A checkpoint TorchTitan can load (its own test: DCP metadata or an HF index)."""
        folder = self._create_checkpoint_id(step)
        return any(os.path.isfile(os.path.join(folder, f)) for f in (".metadata", "model.safetensors.index.json"))

    def _step_folders(self) -> list[int]:
        """The steps of the folders TorchTitan would consider (its own pattern, ``step-N`` anywhere in the name)."""
        if not os.path.isdir(self.folder):
            return []
        found = (re.search(r"step-(\d+)", n) for n in os.listdir(self.folder) if n != SET_ASIDE)
        return sorted({int(m.group(1)) for m in found if m})

    def _set_aside(self, step: int) -> str:
        """Move the folders of ``step`` into ``scout-set-aside/`` (kept for forensics; TorchTitan no longer sees
        them). Nothing there is ever deleted by SCOUT: clean it up once you are done with it."""
        target_dir = os.path.join(self.folder, SET_ASIDE)
        os.makedirs(target_dir, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        moved = []
        for name in os.listdir(self.folder):
            m = re.search(r"step-(\d+)", name)
            if m and int(m.group(1)) == step and name != SET_ASIDE:
                target = os.path.join(target_dir, f"{name}-{stamp}")
                os.replace(os.path.join(self.folder, name), target)
                moved.append(target)
        for folder in (target_dir, self.folder):
            fsync_dir(folder)
        return ", ".join(moved)

    def close(self) -> None:
        # Public close (not the _close hook): SCOUT is attached even when TorchTitan's checkpointing is off.
        scout, self.scout = getattr(self, "scout", None), None
        try:
            if scout is not None:
                scout.close()  # may raise ScoutStop (a pending stop): TorchTitan's own close runs regardless
        finally:
            super().close()


def _job_local(section: ScoutSection, dump_folder: str, folder: str) -> ScoutSection:
    """SCOUT's snapshot store inside this job's own checkpoint folder (``<dump_folder>/<checkpoint.folder>/scout``)
    unless ``--scout.checkpoint.directory`` is set: the schema's default, ``checkpoints`` in the working
    directory, would let a restart of another job from the same directory restore this job's snapshots (the
    in-memory slots are keyed by the store's path, too)."""
    if section.checkpoint.directory != CheckpointConfig().directory:
        return section
    if filesystem.is_remote(dump_folder):  # SCOUT's store needs a POSIX folder: the default stays, with a warning
        log.warning("scout_torchtitan: dump folder %s is remote: SCOUT's snapshot store stays in ./%s; set "
                    "--scout.checkpoint.directory to a shared POSIX folder of this job", dump_folder,
                    section.checkpoint.directory)
        return section
    store = os.path.join(dump_folder, folder, "scout")
    return dataclasses.replace(section, checkpoint=dataclasses.replace(section.checkpoint, directory=store))


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
