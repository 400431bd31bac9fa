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

__all__ = ["adopt_start", "checkpoint_folders", "continue_after_load", "exception_files", "label_saves",
           "plan_restart", "refuse_rejected_load"]

log = logging.getLogger("scout_lightning")

_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")
"""The files Lightning's ``ckpt_path="last"`` looks for (``ModelCheckpoint.CHECKPOINT_NAME_LAST``)."""


def checkpoint_folders(trainer: Any) -> list[str]:
    """The folders the trainer's ``ModelCheckpoint`` callbacks write to (resolved as Lightning resolves them, real
    paths, each once)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            # ModelCheckpoint resolves a folder it was not given at its own setup, after this callback's.
            folder = cb.dirpath if cb.dirpath is not None else cb._ModelCheckpoint__resolve_ckpt_dir(trainer)
            folders.append(os.path.realpath(os.fspath(folder)))
    return list(dict.fromkeys(folders))


def exception_files(trainer: Any) -> list[str]:
    """The files Lightning's ``OnExceptionCheckpoint`` callbacks write (among the files ``"last"`` resolves to)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    return [os.path.realpath(os.fspath(cb.ckpt_path)) for cb in trainer.callbacks
            if isinstance(cb, OnExceptionCheckpoint)]


def _suspect(labels: FrameworkCheckpoints) -> bool:
    """The labels say newer state is suspect: the job stopped on a verdict, or a verdict (``on_verdict: log``)
    rejected checkpoints."""
    return labels.stopped_for is not None or any(e.get("label") == "rejected" for e in labels.entries.values())


def _step_files(folder: str, labels: FrameworkCheckpoints) -> dict[int, str]:
    """The labelled step files still in ``folder``, by name (a folder moved or mounted elsewhere keeps its labels;
    a distributed checkpoint, a folder, is not one SCOUT steers)."""
    return {step: os.path.join(folder, os.path.basename(e["path"])) for step, e in labels.entries.items()
            if os.path.isfile(os.path.join(folder, os.path.basename(e["path"])))}


def _plan(folder: str, others: list[str], exceptions: list[str], resolved: str | None) -> dict[str, Any] | None:
    """Rank 0's restart plan (``folder``: the labelled one; ``others``: the other ModelCheckpoint folders;
    ``exceptions``: OnExceptionCheckpoint's files; ``resolved``: the path rank 0's Lightning resolved ``"last"``
    to). None: the labels say nothing is suspect (a normal end, a stop no verdict explains: Lightning's own
    choice), or Lightning resolved no file (it starts from scratch). Else every newer or unlabelled file
    (``last*.ckpt`` of every folder, the saves on an exception) leaves Lightning's reach and the chosen step file is
    copied to the path Lightning resolved."""
    labels = FrameworkCheckpoints(folder, writer=True)
    if not _suspect(labels) or resolved is None:
        return None
    where = os.path.realpath(resolved)
    if not ((os.path.dirname(where) in [folder, *others] and _LAST.match(os.path.basename(where)))
            or where in exceptions):
        raise RuntimeError(f"Lightning resolved the checkpoint to load to {resolved}, a file SCOUT does not steer "
                           f"(not a last*.ckpt of a ModelCheckpoint folder, nor an OnExceptionCheckpoint's file)")
    files = _step_files(folder, labels)
    choice = labels.choose(exists=lambda step: step in files)
    after = choice.step if choice.step is not None else -1
    unlabelled = [os.path.join(f, n) for f in [folder, *others] for n in _checkpoint_files(f) if _LAST.match(n)]
    doomed = [*(files[s] for s in sorted(files, reverse=True) if s > after), *unlabelled,
              *(e for e in exceptions if os.path.isfile(e))]
    aside = [durable.set_aside(os.path.dirname(p), os.path.basename(p)) for p in dict.fromkeys(doomed)]
    if choice.step is not None:
        _link(files[choice.step], where)
    labels.restarted_from(choice.step, set_aside=aside)
    if choice.step is None:
        log.warning("scout_lightning: no checkpoint in %s is safe to load (%s): %d file(s) set aside in %s; start this "
                    "run without ckpt_path", folder, choice.reason, len(aside), durable.SET_ASIDE)
    else:
        log.warning('scout_lightning: ckpt_path="last" loads %s (%s: %s), copied to %s; %d newer or unlabelled '
                    "file(s) set aside in %s", os.path.basename(files[choice.step]), choice.label, choice.reason,
                    where, len(aside), durable.SET_ASIDE)
    return {"load": None if choice.step is None else files[choice.step], "step": choice.step, "folder": folder,
            "reason": choice.reason}


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
    user's own argument: ``asked``): the labelled folder's plan, unless the user named a path (``fit(ckpt_path=
    <file>)`` or the ``trainer.ckpt_path`` setter: loaded as named, refused at train start if labelled rejected).
    Every rank calls it (rank 0 moves files and broadcasts): each rank resolved the path from its own view of the
    files, so only rank 0's counts."""
    folders = checkpoint_folders(trainer)
    named = (asked is not None and asked != "last") or bool(getattr(trainer._checkpoint_connector, "_user_managed",
                                                                     False))
    if not dist.is_initialized() or not folders or named:
        return None
    exceptions = exception_files(trainer)
    return durable.agreed_restart_plan(folders[0], lambda: _plan(folders[0], folders[1:], exceptions, resolved),
                                       who="scout_lightning", what="Lightning's checkpoint file")


def _adopt(folder: str, loaded: str | None, step: int) -> dict[str, Any] | None:
    """Rank 0, at the start of a run the plan did not choose for (a file the user named, a fresh start) in a folder
    whose labels say the last run stopped on a verdict: that run is abandoned, so its step files newer than this
    run's start, and its ``last*.ckpt``, leave Lightning's reach and the labels, and the stop no longer stands (a
    later ``ckpt_path="last"`` must not roll this run back for it)."""
    labels = FrameworkCheckpoints(folder, writer=True)
    if labels.stopped_for is None:
        return None
    files = _step_files(folder, labels)
    here = loaded is not None and os.path.dirname(os.path.realpath(loaded)) == folder and step > 0
    after = step if here else -1
    doomed = [*(files[s] for s in sorted(files, reverse=True) if s > after),
              *(os.path.join(folder, n) for n in _checkpoint_files(folder) if _LAST.match(n))]
    aside = [durable.set_aside(folder, os.path.basename(p)) for p in dict.fromkeys(doomed)]
    labels.restarted_from(after if here else None, set_aside=aside)
    return {"step": after if here else None, "set_aside": len(aside)}


def adopt_start(trainer: Any, loaded: str | None, step: int) -> dict[str, Any] | None:
    """At train start (every rank): :func:`_adopt` for this run's start (``loaded``: the file Lightning loaded, None:
    none), before the labels are read for the run."""
    folders = checkpoint_folders(trainer)
    if not dist.is_initialized() or not folders:
        return None
    return durable.agreed_restart_plan(folders[0], lambda: _adopt(folders[0], loaded, step), who="scout_lightning",
                                       what="the start of this run")


def refuse_rejected_load(path: str, *, allowed: bool) -> None:
    """Lightning loaded ``path``: raise ``RejectedCheckpointError`` on every rank if SCOUT labelled it rejected
    (``allowed``: ``checkpoint.load_rejected``, a warning instead). By the name of the file it is (a link followed)
    inside its folder, as the labels are read everywhere."""
    real = os.path.realpath(path)
    name = os.path.basename(real)
    durable.refuse_rejected(os.path.dirname(real), lambda _s, e: os.path.basename(e.get("path", "")) == name,
                            os.path.basename(path), who="scout_lightning", allowed=allowed)


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


def continue_after_load(handle: ScoutHandle, folder: str, step: int) -> None:
    """Lightning loaded the checkpoint of ``step``, whose labels are in ``folder``: SCOUT goes on from there, trusting
    it as far as those labels say."""
    if step <= 0:
        return
    handle.continue_from(step, verified=FrameworkCheckpoints(folder, writer=False).verified_at(step))
