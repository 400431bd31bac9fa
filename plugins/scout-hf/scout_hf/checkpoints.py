"""The Trainer's own ``checkpoint-N`` folders, labelled by SCOUT's certification, and the restart that resumes from
the one SCOUT's retrieval policy chose.

* While training, every save of the Trainer is checkpoint I/O for SCOUT's observers (a save that takes minutes is
  not a stalled job: :mod:`scout_hf.callback`) and, once every rank finished its part (the Trainer's ``on_save``
  event and a barrier), labelled latest / candidate / verified / rejected in
  ``scout-labels.json`` in the Trainer's ``output_dir`` (:mod:`scout_core.checkpoint.durable`), by its global step.
* At a restart the callback steers ``trainer.train(resume_from_checkpoint=True)``: the Trainer resolves ``True`` to
  the ``checkpoint-N`` folder of the highest N in ``output_dir`` (``get_last_checkpoint``), so before that call goes
  on (the callback wrapped ``train`` when the Trainer was built) rank 0 reads the labels, chooses the step
  (after an SDC stop: the newest verified one) and moves the newer folders into ``scout-set-aside/`` (kept for
  forensics, out of the Trainer's reach). Where nothing is safe every folder is set aside and the Trainer says it
  found no checkpoint: the run starts without ``resume_from_checkpoint``.
* A path the user names (``resume_from_checkpoint="out/checkpoint-40"``) is loaded as named, unless SCOUT labelled
  it rejected: then training stops at its start on every rank (:class:`RejectedCheckpointError`) unless
  ``checkpoint.load_rejected`` is set.
* After the load, SCOUT's step count, replay schedule and certification go on from the Trainer's global step.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch.distributed as dist

from scout_core.checkpoint import durable
from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_core.runtime import ScoutHandle

__all__ = ["TrainerCheckpoints", "adopt_start", "checkpoint_folders", "plan_restart", "refuse_rejected_load"]

log = logging.getLogger("scout_hf")

_FOLDER = re.compile(r"^checkpoint-(\d+)$")
"""The Trainer's checkpoint folder names (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``)."""


def checkpoint_folders(output_dir: str) -> dict[int, str]:
    """The Trainer's checkpoint folders in ``output_dir``: step -> folder name (as ``get_last_checkpoint`` sees
    them)."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return {}
    return {int(m.group(1)): name for name in names
            if (m := _FOLDER.match(name)) and os.path.isdir(os.path.join(output_dir, name))}


def _plan(output_dir: str) -> dict[str, Any] | None:
    """Rank 0's restart plan for ``output_dir`` (None: nothing SCOUT labelled there, the Trainer's own choice)."""
    labels = FrameworkCheckpoints(output_dir, writer=True)
    if not labels.entries:
        return None
    folders = checkpoint_folders(output_dir)
    unlabelled = sorted(s for s in folders if s not in labels.entries and s > max(labels.entries))
    if unlabelled and labels.stopped_for != "sdc":
        # Newer than anything SCOUT labelled (saved while SCOUT was off, or its labelling failed): nothing says it is
        # bad unless the job stopped for SDC, and the Trainer would load it anyway.
        log.warning("scout_hf: %s in %s carries no SCOUT label: the Trainer's own choice is loaded",
                    folders[unlabelled[-1]], output_dir)
        return None
    choice = labels.choose(exists=lambda step: step in folders)
    after = choice.step if choice.step is not None else -1
    # Newest first: the rejected folder leaves the Trainer's reach before anything else can fail. The labels change
    # only once everything moved: a plan that fails half-way still knows why the job stopped.
    aside = [durable.set_aside(output_dir, folders[step]) for step in sorted(folders, reverse=True) if step > after]
    labels.restarted_from(choice.step, set_aside=aside)
    if choice.step is None:
        log.warning("scout_hf: no checkpoint in %s is safe to resume from (%s): %d folder(s) set aside in %s; the "
                    "Trainer finds none, so start this run without resume_from_checkpoint", output_dir,
                    choice.reason, len(aside), durable.SET_ASIDE)
    else:
        log.warning("scout_hf: resume_from_checkpoint=True resumes from %s (%s: %s); %d newer folder(s) set aside "
                    "in %s", folders[choice.step], choice.label, choice.reason, len(aside), durable.SET_ASIDE)
    return {"load": None if choice.step is None else folders[choice.step], "step": choice.step,
            "reason": choice.reason}


def plan_restart(output_dir: str) -> dict[str, Any] | None:
    """Before ``train(resume_from_checkpoint=True)`` looks for the newest folder: choose the step from SCOUT's labels
    and set the newer folders aside (every rank calls it; rank 0 moves files and broadcasts the plan). None: no
    labels, the Trainer's own choice. After an SDC stop a plan that cannot be made stops the launch: the newest
    folder would restore the state the verdict rejected."""
    if not dist.is_initialized() or not output_dir:
        return None
    return durable.agreed_restart_plan(output_dir, lambda: _plan(output_dir), who="scout_hf",
                                       what="the Trainer's checkpoint folder")


def _adopt(output_dir: str, step: int | None) -> dict[str, Any] | None:
    """Rank 0, at the start of a run the restart plan did not choose for (a folder the user named, or a fresh start)
    in a folder whose labels say the last run stopped on a verdict: that run is abandoned, so its folders newer than
    the one this run started from (every folder, on a fresh start) leave the Trainer's reach and the labels, and the
    stop no longer stands (a later ``resume_from_checkpoint=True`` must not roll this run back for it)."""
    labels = FrameworkCheckpoints(output_dir, writer=True)
    if labels.stopped_for is None:
        return None
    folders = checkpoint_folders(output_dir)
    after = step if step is not None else -1
    aside = [durable.set_aside(output_dir, folders[s]) for s in sorted(folders, reverse=True) if s > after]
    labels.restarted_from(step, set_aside=aside)
    log.warning("scout_hf: this run starts from %s after a stop on a verdict; %d newer folder(s) of the stopped run "
                "set aside in %s", f"checkpoint-{step}" if step is not None else "scratch", len(aside),
                durable.SET_ASIDE)
    return {"step": step, "set_aside": len(aside)}


def adopt_start(output_dir: str, resumed: str | None, step: int) -> dict[str, Any] | None:
    """At train begin (every rank): :func:`_adopt` for this run's start, ``resumed`` (None: a fresh start) at
    ``step``."""
    if not dist.is_initialized() or not output_dir:
        return None
    here = resumed is not None and os.path.realpath(os.path.dirname(os.path.normpath(resumed))) == os.path.realpath(
        output_dir)
    start = step if here and step > 0 else None
    return durable.agreed_restart_plan(output_dir, lambda: _adopt(output_dir, start), who="scout_hf",
                                       what="the start of this run")


def refuse_rejected_load(resumed: str, step: int, *, allowed: bool) -> None:
    """The Trainer loaded ``resumed`` (a ``checkpoint-N`` folder) at ``step``: raise
    :class:`~scout_core.checkpoint.durable.RejectedCheckpointError` on every rank if SCOUT labelled it rejected
    (``allowed``: ``checkpoint.load_rejected``, a warning instead)."""
    folder = os.path.dirname(os.path.normpath(resumed))
    name = os.path.realpath(resumed)
    durable.refuse_rejected(folder, lambda s, e: s == step or os.path.realpath(e.get("path", "")) == name,
                            os.path.basename(os.path.normpath(resumed)), who="scout_hf", allowed=allowed)


class TrainerCheckpoints:
    """The labels of one Trainer's ``output_dir``, kept beside a SCOUT handle for the run."""

    def __init__(self, handle: ScoutHandle, output_dir: str) -> None:
        self.handle = handle
        self.folder = output_dir
        # Certification starts now, so an SDC verdict before the first save rejects what is saved after it.
        self.labels = handle.label_framework_checkpoints(output_dir)

    def saved(self, step: int) -> None:
        """The Trainer's ``on_save``: every rank wrote its part of ``checkpoint-<step>``; label it."""
        dist.barrier()  # rank 0 labels a folder every rank finished writing
        if self.labels is None:
            return
        try:
            self.labels.saved(step, os.path.join(self.folder, f"checkpoint-{step}"), self.handle.certifier)
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.handle.guard.report(step, "checkpoint", exc, "labelling the Trainer's checkpoint")

    def resumed(self, resumed: str, step: int) -> None:
        """The Trainer loaded ``resumed`` at ``step``: SCOUT goes on from there, trusting it as far as the labels of
        the folder it came from say (read the same on every rank)."""
        if step <= 0:
            return
        source = os.path.dirname(os.path.normpath(resumed))
        labels = self.labels
        if labels is None or os.path.realpath(labels.folder) != os.path.realpath(source):
            labels = FrameworkCheckpoints(source, writer=False)
        self.handle.continue_from(step, verified=labels.verified_at(step))
        if self.handle.rank == 0:
            log.info("scout_hf: SCOUT goes on from the Trainer's step %d (%s)", step, resumed)
