"""Lightning's own checkpoints (the files ``ModelCheckpoint`` writes), labelled by SCOUT's certification, and the
restart that makes ``ckpt_path="last"`` load the one SCOUT's retrieval policy chose.

* While training, every ``trainer.save_checkpoint`` is checkpoint I/O for SCOUT's observers and, once Lightning
  returned from it (rank 0 wrote the file, every rank passed Lightning's barrier), a step file in the first
  ``ModelCheckpoint``'s folder (``epoch=0-step=40.ckpt``) is labelled latest / candidate / verified / rejected in
  ``scout-labels.json`` beside it, by the trainer's global step. ``last*.ckpt`` (rewritten at every save, whatever
  step files are kept) and the other folders' files are not labelled.
* ``trainer.fit(model, ckpt_path="last")`` resolves ``"last"`` to the path of the newest ``last*.ckpt`` (or of a save
  on an exception) before anything of the run is set up, and reads that file only after the callbacks' ``setup``.
  There (:func:`plan_restart`), unless the user named a path, rank 0 reads the labels and, where the job stopped on a
  verdict, chooses (after an SDC stop: the newest verified step file), moves every newer or unlabelled ``.ckpt`` of
  every checkpoint folder into ``scout-set-aside/`` (kept for forensics) and copies the chosen step file to the path
  Lightning resolved: Lightning loads it. Where nothing is safe every such file is set aside and Lightning says the
  file is not there: start that run without ``ckpt_path``. After a normal end or a stop no verdict explains,
  ``"last"`` is Lightning's own choice.
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
from scout_core.plugin_support import InstanceAttribute
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


def _plan(folder: str, others: list[str], resolved: str | None) -> dict[str, Any] | None:
    """Rank 0's restart plan for ``folder`` (the labelled one; ``others``: the other checkpoint folders; ``resolved``:
    the path Lightning resolved ``"last"`` to on rank 0). None: the job did not stop on a verdict (a normal end, an
    unexplained crash): Lightning's own choice, its newest file. After a verdict stop every file newer than the
    choice, and every file SCOUT did not label (``last*.ckpt``, Lightning's saves on an exception), in every
    checkpoint folder, leaves Lightning's reach, and the chosen step file is copied to the path Lightning
    resolved."""
    labels = FrameworkCheckpoints(folder, writer=True)
    if labels.stopped_for is None:
        return None
    # By name inside the folder: a folder moved or mounted elsewhere keeps its labels. Step files only: a
    # distributed checkpoint (a folder) is not one SCOUT steers.
    files = {step: os.path.join(folder, os.path.basename(e["path"])) for step, e in labels.entries.items()
             if os.path.isfile(os.path.join(folder, os.path.basename(e["path"])))}
    choice = labels.choose(exists=lambda step: step in files)
    after = choice.step if choice.step is not None else -1
    keep = {os.path.basename(files[s]) for s in files if s <= after}
    aside = [durable.set_aside(where, name) for where in [folder, *others] for name in _checkpoint_files(where)
             if where != folder or name not in keep]
    target = resolved if resolved and os.path.dirname(os.path.realpath(resolved)) in {
        os.path.realpath(f) for f in [folder, *others]} else os.path.join(folder, "last.ckpt")
    if choice.step is not None:
        _link(files[choice.step], target)
    labels.restarted_from(choice.step, set_aside=aside)
    if choice.step is None:
        log.warning("scout_lightning: no checkpoint in %s is safe to load (%s): %d file(s) set aside in %s; start this "
                    "run without ckpt_path", folder, choice.reason, len(aside), durable.SET_ASIDE)
    else:
        log.warning('scout_lightning: ckpt_path="last" loads %s (%s: %s), copied to %s; %d newer or unlabelled '
                    "file(s) set aside in %s", os.path.basename(files[choice.step]), choice.label, choice.reason,
                    target, len(aside), durable.SET_ASIDE)
    return {"load": None if choice.step is None else files[choice.step], "step": choice.step, "reason": choice.reason}


def _checkpoint_files(folder: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    except OSError:
        return []


def _link(source: str, target: str) -> None:
    """``target`` holds a copy of ``source``'s bytes, made atomically. A copy, not a link: Lightning rewrites
    ``last.ckpt`` in place at its next save, which through a link would overwrite the chosen step file."""
    tmp = f"{target}.scout-tmp"
    shutil.copy2(source, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    fsync_dir(os.path.dirname(target))


def plan_restart(trainer: Any, resolved: str | None, asked: Any) -> dict[str, Any] | None:
    """At the trainer's setup, before Lightning reads the checkpoint it resolved ``ckpt_path`` to (``resolved``; the
    user's own argument: ``asked``): the labelled folder's plan, unless the user named a path (loaded as named,
    refused at train start if labelled rejected). Every rank calls it (rank 0 moves files and broadcasts): each
    rank resolved the path from its own view of the files, so only rank 0's counts."""
    folders = checkpoint_folders(trainer)
    if not dist.is_initialized() or not folders or (asked is not None and asked != "last"):
        return None
    return durable.agreed_restart_plan(folders[0], lambda: _plan(folders[0], [*folders[1:], *_exception_folders(
        trainer)], resolved), who="scout_lightning", what="Lightning's checkpoint file")


def _exception_folders(trainer: Any) -> list[str]:
    """The folders Lightning's OnExceptionCheckpoint callbacks write to (their files are among "last"'s)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    return [os.fspath(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]


def refuse_rejected_load(path: str, *, allowed: bool) -> None:
    """Lightning loaded ``path``: raise ``RejectedCheckpointError`` on every rank if SCOUT labelled it rejected
    (``allowed``: ``checkpoint.load_rejected``, a warning instead)."""
    name = os.path.basename(path)  # by name inside the folder, as the labels are read everywhere
    durable.refuse_rejected(os.path.dirname(os.path.realpath(path)),
                            lambda _s, e: os.path.basename(e.get("path", "")) == name, name, who="scout_lightning",
                            allowed=allowed)


def label_saves(handle: ScoutHandle, trainer: Any) -> Callable[[], None]:
    """Wrap this trainer's ``save_checkpoint`` (see the module's docstring); returns what puts Lightning's back.
    SCOUT labels one folder, the first ``ModelCheckpoint``'s; the others' files are not labelled (a warning)."""
    save = trainer.save_checkpoint
    folders = checkpoint_folders(trainer)
    if not folders:
        return lambda: None
    labelled = os.path.realpath(folders[0])
    labels = handle.label_framework_checkpoints(folders[0])
    if len(folders) > 1 and handle.rank == 0:
        log.warning("scout_lightning: checkpoints in %s are not labelled (SCOUT labels %s); a restart after an SDC "
                    "stop sets their last*.ckpt aside", ", ".join(folders[1:]), folders[0])

    @functools.wraps(save)
    def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        with handle.checkpoint_io("write"):
            out = save(filepath, *args, **kwargs)
        path = os.fspath(filepath)
        if labels is not None and os.path.realpath(os.path.dirname(path)) == labelled:
            step = int(trainer.global_step)
            try:
                if not _LAST.match(os.path.basename(path)):
                    labels.saved(step, path, handle.certifier)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                handle.guard.report(step, "checkpoint", exc, "labelling Lightning's checkpoint")
        return out

    return InstanceAttribute(trainer, "save_checkpoint", save_checkpoint).remove


def continue_after_load(handle: ScoutHandle, path: str, step: int) -> None:
    """Lightning loaded ``path`` at ``step``: SCOUT goes on from there, trusting it as far as its folder's labels
    say."""
    if step <= 0:
        return
    labels = FrameworkCheckpoints(os.path.dirname(os.path.realpath(path)), writer=False)
    handle.continue_from(step, verified=labels.verified_at(step))
