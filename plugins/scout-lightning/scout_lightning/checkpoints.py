"""Lightning's own checkpoints (the files ``ModelCheckpoint`` writes), labelled by SCOUT's certification, and the
restart that makes ``ckpt_path="last"`` load the one SCOUT's retrieval policy chose.

* While training, every ``trainer.save_checkpoint`` is checkpoint I/O for SCOUT's observers and, once Lightning
  returned from it (rank 0 wrote the file, every rank passed Lightning's barrier), a step file in a
  ``ModelCheckpoint`` folder (``epoch=0-step=40.ckpt``) is labelled latest / candidate / verified / rejected in
  ``scout-labels.json`` beside it, by the trainer's global step. ``last.ckpt`` (rewritten at every save) is not
  labelled itself: it holds the newest save.
* ``trainer.fit(model, ckpt_path="last")`` resolves ``"last"`` to the path of ``last.ckpt`` before anything of the
  run is set up, and reads that file only after the callbacks' ``setup``. There (:func:`plan_restart`) rank 0 reads
  the labels and, where the newest checkpoint is not the one to load (after an SDC stop: the newest verified one),
  moves the newer step files and ``last*.ckpt`` into ``scout-set-aside/`` (kept for forensics) and copies the chosen
  step file to ``last.ckpt``: Lightning loads it. Where nothing is safe ``last.ckpt`` is set aside and Lightning
  says the file is not there: start that run without ``ckpt_path``.
* A step file the user names (``ckpt_path="ckpts/epoch=0-step=40.ckpt"``) is loaded as named, unless SCOUT labelled it
  rejected: training stops at its start on every rank unless ``checkpoint.load_rejected`` is set.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from scout_core.checkpoint import durable
from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_core.checkpoint.store import fsync_dir
from scout_core.runtime import ScoutHandle

__all__ = ["checkpoint_folders", "continue_after_load", "label_saves", "plan_restart", "refuse_rejected_load"]

log = logging.getLogger("scout_lightning")

_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")
"""The files Lightning's ``ckpt_path="last"`` looks for (``ModelCheckpoint.CHECKPOINT_NAME_LAST``)."""


def checkpoint_folders(trainer: Any) -> list[str]:
    """The folders the trainer's ``ModelCheckpoint`` callbacks write to (resolved as Lightning resolves them)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            # ModelCheckpoint resolves a folder it was not given at its own setup, after this callback's.
            folder = cb.dirpath if cb.dirpath is not None else cb._ModelCheckpoint__resolve_ckpt_dir(trainer)
            folders.append(os.fspath(folder))
    return list(dict.fromkeys(folders))


def _plan(folder: str) -> dict[str, Any] | None:
    """Rank 0's restart plan for ``folder`` (None: nothing SCOUT labelled there, or the newest checkpoint is the one
    to load: Lightning's own choice)."""
    labels = FrameworkCheckpoints(folder, writer=True)
    if not labels.entries:
        return None
    files = {step: e["path"] for step, e in labels.entries.items() if os.path.isfile(e["path"])}
    choice = labels.choose(exists=lambda step: step in files)
    if files and choice.step == max(files):
        return None
    after = choice.step if choice.step is not None else -1
    lasts = sorted(n for n in os.listdir(folder) if _LAST.match(n))
    aside = [durable.set_aside(folder, os.path.basename(files[s])) for s in sorted(files, reverse=True) if s > after]
    aside += [durable.set_aside(folder, name) for name in lasts]
    if choice.step is not None:
        for name in lasts or ["last.ckpt"]:
            _link(files[choice.step], os.path.join(folder, name))
    labels.restarted_from(choice.step, set_aside=aside)
    if choice.step is None:
        log.warning("scout_lightning: no checkpoint in %s is safe to load (%s): %d file(s) set aside in %s; start this "
                    "run without ckpt_path", folder, choice.reason, len(aside), durable.SET_ASIDE)
    else:
        log.warning('scout_lightning: ckpt_path="last" loads %s (%s: %s); %d newer file(s) set aside in %s',
                    os.path.basename(files[choice.step]), choice.label, choice.reason, len(aside), durable.SET_ASIDE)
    return {"load": None if choice.step is None else files[choice.step], "step": choice.step, "reason": choice.reason}


def _link(source: str, target: str) -> None:
    """``target`` holds a copy of ``source``'s bytes, made atomically. A copy, not a link: Lightning rewrites
    ``last.ckpt`` in place at its next save, which through a link would overwrite the chosen step file."""
    tmp = f"{target}.scout-tmp"
    shutil.copy2(source, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    fsync_dir(os.path.dirname(target))


def plan_restart(trainer: Any) -> list[dict[str, Any] | None]:
    """At the trainer's setup, before Lightning reads the checkpoint ``ckpt_path`` named: each ``ModelCheckpoint``
    folder's plan (every rank calls it; rank 0 moves files and broadcasts)."""
    if not dist.is_initialized():
        return []
    return [durable.agreed_restart_plan(folder, lambda f=folder: _plan(f), who="scout_lightning",
                                        what="Lightning's checkpoint file")
            for folder in checkpoint_folders(trainer)]


def refuse_rejected_load(path: str, *, allowed: bool) -> None:
    """Lightning loaded ``path``: raise ``RejectedCheckpointError`` on every rank if SCOUT labelled it rejected
    (``allowed``: ``checkpoint.load_rejected``, a warning instead)."""
    name = os.path.realpath(path)
    durable.refuse_rejected(os.path.dirname(name), lambda _s, e: os.path.realpath(e.get("path", "")) == name,
                            os.path.basename(path), who="scout_lightning", allowed=allowed)


def label_saves(handle: ScoutHandle, trainer: Any) -> Callable[[], None]:
    """Wrap this trainer's ``save_checkpoint`` (see the module's docstring); returns what puts Lightning's back."""
    save = trainer.save_checkpoint
    folders = {os.path.realpath(f) for f in checkpoint_folders(trainer)}
    labels = {f: handle.label_framework_checkpoints(f) for f in folders}

    @functools.wraps(save)
    def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        with handle.checkpoint_io("write"):
            out = save(filepath, *args, **kwargs)
        path = os.fspath(filepath)
        found = labels.get(os.path.realpath(os.path.dirname(path)))
        if found is not None and not _LAST.match(os.path.basename(path)):
            step = int(trainer.global_step)
            try:
                found.saved(step, path, handle.certifier)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                handle.guard.report(step, "checkpoint", exc, "labelling Lightning's checkpoint")
        return out

    trainer.save_checkpoint = save_checkpoint

    def restore() -> None:
        if vars(trainer).get("save_checkpoint") is save_checkpoint:
            del trainer.save_checkpoint

    return restore


def continue_after_load(handle: ScoutHandle, path: str, step: int) -> None:
    """Lightning loaded ``path`` at ``step``: SCOUT goes on from there, trusting it as far as its folder's labels
    say."""
    if step <= 0:
        return
    labels = FrameworkCheckpoints(os.path.dirname(os.path.realpath(path)), writer=False)
    handle.continue_from(step, verified=labels.verified_at(step))
