"""DeepSpeed's own checkpoints (``engine.save_checkpoint(save_dir, tag)`` and its ``latest`` file), labelled by
SCOUT's certification, and the restart that loads the tag SCOUT's retrieval policy chose.

* While training, every ``save_checkpoint`` is marked as checkpoint I/O for SCOUT's observers (a save that takes
  minutes is a checkpoint write, not a stalled job) and, once DeepSpeed returned from it (every rank wrote its
  part, the tag committed, ``latest`` written), labelled latest / candidate / verified / rejected in
  ``scout-labels.json`` beside the tags (:mod:`scout_core.checkpoint.durable`), by the engine's global step.
* At a restart, ``engine.load_checkpoint(load_dir)`` without a tag (DeepSpeed then reads ``latest``): rank 0 reads
  the labels, chooses the step (after an SDC stop: the newest verified one), moves the tags of newer steps into
  ``scout-set-aside/`` (kept for forensics, out of DeepSpeed's reach) and points ``latest`` at the chosen tag, or
  sets ``latest`` aside where nothing is safe (DeepSpeed then loads nothing and training starts from the model's
  initialization). DeepSpeed's own ``load_checkpoint`` then loads it, the way it always does. An explicit ``tag``
  (the user's choice), universal checkpoints and node-local storage are left to DeepSpeed (:func:`_no_plan`), but
  a tag SCOUT labelled rejected is refused (``RejectedCheckpointError`` on every rank) unless
  ``checkpoint.load_rejected`` is set.
* After the load, SCOUT's step count, replay schedule and certification go on from the engine's global step.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from scout_core.checkpoint import durable
from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_core.runtime import ScoutHandle

__all__ = ["LATEST", "install", "plan_restart"]

log = logging.getLogger("scout_deepspeed")

LATEST = "latest"
"""DeepSpeed's tracker file: the tag ``load_checkpoint`` reads when it is given none."""


def _tag_of(entry: Mapping[str, Any]) -> str:
    """The DeepSpeed tag a label entry is about (its folder's name)."""
    return os.path.basename(os.path.normpath(entry["path"]))


def _plan(folder: str) -> dict[str, Any] | None:
    """Rank 0's restart plan for ``folder`` (None: nothing SCOUT labelled there, DeepSpeed's own choice)."""
    labels = FrameworkCheckpoints(folder, writer=True)
    if not labels.entries:
        return None
    tag_of = {step: _tag_of(e) for step, e in labels.entries.items()}
    named = _latest(folder)
    if named is not None and named not in tag_of.values() and os.path.isdir(os.path.join(folder, named)):
        # DeepSpeed's newest tag carries no label (saved while SCOUT was off, or its labelling failed): nothing
        # says it is bad unless the job stopped for SDC; abandoning it silently would let a later save overwrite it.
        if labels.stopped_for != "sdc":
            log.warning("scout_deepspeed: latest names %s, which SCOUT did not label: DeepSpeed's own choice is "
                        "loaded", named)
            return None
        tag_of[-1] = named  # after an SDC stop it may hold the corruption: set aside with the newer tags
    choice = labels.choose(exists=lambda step: os.path.isdir(os.path.join(folder, tag_of[step])))
    # Newest first: the rejected tag leaves DeepSpeed's reach before anything else can fail. The labels change only
    # once everything moved: a plan that fails half-way still knows why the job stopped.
    after = choice.step if choice.step is not None else -1
    newest_first = sorted(tag_of, key=lambda step: (step != -1, -step))  # -1: the unlabelled tag latest names
    aside = [durable.set_aside(folder, tag_of[step]) for step in newest_first
             if (step > after or step == -1) and os.path.isdir(os.path.join(folder, tag_of[step]))]
    durable.point_tracker(folder, LATEST, None if choice.step is None else tag_of[choice.step])
    labels.restarted_from(choice.step, set_aside=aside)
    log.warning("scout_deepspeed: restart from %s (%s: %s); %d newer tag(s) set aside in %s",
                f"tag {tag_of[choice.step]}" if choice.step is not None else "the model's initialization",
                choice.label, choice.reason, len(aside), durable.SET_ASIDE)
    return {"load": None if choice.step is None else tag_of[choice.step], "step": choice.step,
            "reason": choice.reason}


def _latest(folder: str) -> str | None:
    """The tag DeepSpeed's ``latest`` names, or None."""
    try:
        with open(os.path.join(folder, LATEST), encoding="utf-8", errors="replace") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def plan_restart(load_dir: str) -> dict[str, Any] | None:
    """Before DeepSpeed's ``load_checkpoint`` reads ``latest``: choose the tag from SCOUT's labels and point
    ``latest`` at it (every rank calls it; rank 0 moves files and broadcasts the plan). None: no labels,
    DeepSpeed's own choice. After an SDC stop a plan that cannot be made stops the launch: loading the newest tag
    then would restore the state the verdict rejected."""
    if not dist.is_initialized():
        return None
    return durable.agreed_restart_plan(load_dir, lambda: _plan(load_dir), who="scout_deepspeed", what="DeepSpeed's tag")


def install(handle: ScoutHandle, engine: Any) -> Callable[[], None]:
    """Wrap this engine's ``save_checkpoint`` and ``load_checkpoint`` (see the module's docstring); returns what
    puts DeepSpeed's own methods back."""
    save, load = engine.save_checkpoint, engine.load_checkpoint
    # The folder SCOUT labels: the one the job loaded a labelled checkpoint from (so a verdict before the run's
    # first save marks that folder's labels: the relaunch must not go back to the state the run started from
    # as if nothing had happened), then the first folder the job saves to, for good.
    live: dict[str, Any] = {"folder": None, "labels": None, "from_load": False}
    unlabelled: set[str] = set()
    # Certification starts now, so an SDC verdict before the first save still rejects what is saved after it
    # (the corruption reached every replica by then).
    handle.certify_framework_checkpoints()

    def labels_for(save_dir: str) -> FrameworkCheckpoints | None:
        key = os.path.realpath(save_dir)
        if live["folder"] == key:
            if live["from_load"]:
                live["from_load"] = False  # the job saves where it loaded from: its folder for good
            return live["labels"]
        if live["folder"] is None or live["from_load"]:
            live.update(folder=key, labels=handle.label_framework_checkpoints(save_dir), from_load=False)
            return live["labels"]
        if key not in unlabelled:  # one job, one folder: SCOUT labels the first one it saves to
            unlabelled.add(key)
            log.warning("scout_deepspeed: checkpoints in %s are not labelled (SCOUT labels %s)", save_dir,
                        live["folder"])
        return None

    @functools.wraps(save)
    def save_checkpoint(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        with handle.checkpoint_io("write"):
            out = save(save_dir, tag, *args, **kwargs)
        step = int(engine.global_steps)
        try:
            labels = labels_for(save_dir)
            if labels is not None:
                labels.saved(step, os.path.join(save_dir, str(tag if tag is not None else f"global_step{step}")),
                             handle.certifier)
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            handle.guard.report(step, "checkpoint", exc, "labelling DeepSpeed's checkpoint")
        return out

    @functools.wraps(load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        if tag is not None:  # the user's choice is loaded, unless SCOUT labelled it rejected
            durable.refuse_rejected(load_dir, lambda _step, entry: _tag_of(entry) == str(tag), f"tag {tag}",
                            who="scout_deepspeed", allowed=handle.config.checkpoint.load_rejected)
        why_not = _no_plan(engine, tag)
        if why_not is None:
            plan_restart(load_dir)  # points `latest` at SCOUT's choice
        elif handle.rank == 0:
            log.warning("scout_deepspeed: %s: DeepSpeed's own choice is loaded", why_not)
        with handle.checkpoint_io("read"):
            out = load(load_dir, tag, *args, **kwargs)
        if out and out[0] is not None:
            if live["folder"] is None and FrameworkCheckpoints(load_dir, writer=False).entries:
                live.update(folder=os.path.realpath(load_dir), from_load=True,
                            labels=handle.label_framework_checkpoints(load_dir))
            _continue_after_load(handle, int(engine.global_steps), load_dir)
        return out

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint

    def restore() -> None:
        engine.save_checkpoint, engine.load_checkpoint = save, load

    return restore


def _no_plan(engine: Any, tag: Any) -> str | None:
    """Why this load must not be steered by SCOUT's labels (None: steer it). A load without a tag of a folder SCOUT
    labelled is steered whatever it restores: even ``load_module_only`` or ``load_optimizer_states=False`` restore
    the rejected state's weights (and, without ``load_module_only``, its global step) from what ``latest`` names."""
    if tag is not None:
        return f"tag {tag} asked for"
    if engine.load_universal_checkpoint():
        return "a universal checkpoint (read through latest_universal, which SCOUT's labels do not steer)"
    if engine.use_node_local_storage():
        return "node-local checkpoint storage (every node's own latest: rank 0 cannot steer them all)"
    return None


def _continue_after_load(handle: ScoutHandle, step: int, folder: str) -> None:
    """DeepSpeed loaded the checkpoint of ``step``: SCOUT goes on from there, trusting it as far as its labels say
    (labels of the folder it loaded from, read the same on every rank)."""
    if step <= 0:
        return
    labels = handle.framework_checkpoints
    if labels is None or os.path.realpath(labels.folder) != os.path.realpath(folder):
        labels = FrameworkCheckpoints(folder, writer=False)
    handle.continue_from(step, verified=labels.verified_at(step))
    if handle.rank == 0:
        log.info("scout_deepspeed: SCOUT goes on from DeepSpeed's step %d in %s", step, folder)
