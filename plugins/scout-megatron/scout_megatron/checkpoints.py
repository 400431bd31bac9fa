"""Megatron's own checkpoints (``--save`` / ``--load`` and the ``latest_checkpointed_iteration.txt`` tracker),
labelled by SCOUT's certification, and the restart that loads the iteration SCOUT's retrieval policy chose.

* While training, every ``save_checkpoint`` of Megatron's loop is marked as checkpoint I/O for SCOUT's
  observers (a save that takes minutes is a checkpoint write, not a stalled job) and, once written, labelled
  latest / candidate / verified / rejected in ``scout-labels.json`` beside the iterations
  (:mod:`scout_core.checkpoint.durable`).
* At a restart, before Megatron loads anything, rank 0 reads the labels of ``--load``, chooses the iteration
  (after an SDC stop: the newest verified one), moves every newer ``iter_*`` folder into ``scout-set-aside/``
  (kept for forensics, out of Megatron's reach, so a later save of the same iteration never lands on an abandoned
  one) and points Megatron's tracker file at the chosen iteration. Megatron's own ``load_checkpoint`` then loads
  it, the way it always does. ``--ckpt-step`` (the user's explicit choice) is loaded as
  asked, unless SCOUT labelled that iteration rejected (refused, unless ``checkpoint.load_rejected``).
* After the load, SCOUT's step count, replay schedule and certification go on from the loaded iteration.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from scout_core.checkpoint.durable import (
    SET_ASIDE,
    FrameworkCheckpoints,
    agreed_restart_plan,
    point_tracker,
    refuse_rejected,
    set_aside,
)
from scout_core.runtime import ScoutHandle

__all__ = ["SET_ASIDE", "TRACKER", "label_saves", "plan_restart"]

log = logging.getLogger("scout_megatron")

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file: the iteration ``--load`` reads (megatron.training.checkpointing)."""
NON_PERSISTENT = "non_persistent"
"""Megatron's non-persistent global checkpoint folder inside ``--load`` (its default location)."""
_ITER = re.compile(r"^iter_(\d+)$")


def iterations(folder: str) -> list[int]:
    """The iterations Megatron saved in ``folder`` (its ``iter_0000042`` directories)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(folder) if (m := _ITER.match(n)))


def iteration_dir(folder: str, iteration: int) -> str:
    return os.path.join(folder, f"iter_{iteration:07d}")


def _tracked(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, TRACKER), encoding="utf-8", errors="replace") as fh:
            text = fh.read().strip()
        return int(text) if text.isascii() and text.isdigit() else None  # "²".isdigit() too
    except OSError:
        return None


def complete(folder: str, iteration: int) -> bool:
    """A checkpoint Megatron can load: the distributed formats' ``metadata.json`` is written last, once every rank
    wrote its shard and the coordinator its ``.metadata`` (an asynchronous save still in flight has neither, and
    one with ``.metadata`` only would be read as another format); the legacy per-rank format is complete once the
    tracker names it or a later iteration."""
    where = iteration_dir(folder, iteration)
    if os.path.isfile(os.path.join(where, "metadata.json")):
        return True
    if os.path.isfile(os.path.join(where, ".metadata")):
        return False
    tracked = _tracked(folder)
    return os.path.isdir(where) and tracked is not None and tracked >= iteration


def _set_aside(folder: str, iteration: int | None, name: str | None = None) -> str:
    """Move ``iter_<iteration>`` (or the entry ``name``) into ``scout-set-aside/``."""
    return set_aside(folder, os.path.basename(iteration_dir(folder, iteration)) if iteration is not None else str(name))


def _plan(folder: str, ckpt_step: int | None) -> dict[str, Any] | None:
    """Rank 0's restart plan for ``folder`` (None: nothing SCOUT labelled there, Megatron's own choice)."""
    labels = FrameworkCheckpoints(folder, writer=True)
    if not labels.entries:
        return None
    if ckpt_step:
        labels.restarted_from(int(ckpt_step))  # the user's explicit choice, nothing moved
        log.warning("scout_megatron: --ckpt-step %d asked for: loaded as asked", ckpt_step)
        return {"load": int(ckpt_step), "reason": "--ckpt-step"}
    choice = labels.choose(exists=lambda it: complete(folder, it))
    # Newest first: the rejected iteration leaves Megatron's reach before anything else can fail. The labels change
    # only once everything moved: a plan that fails half-way still knows why the job stopped.
    after = choice.step if choice.step is not None else -1
    aside: list[str] = []
    for it in sorted((i for i in iterations(folder) if i > after), reverse=True):
        aside.append(_set_aside(folder, it))
    if labels.stopped_for is not None and os.path.isdir(os.path.join(folder, NON_PERSISTENT)):
        # Megatron loads its non-persistent checkpoint whenever it is at or past the tracker's iteration: after a
        # verdict it may hold the state the verdict rejected.
        aside.append(_set_aside(folder, None, NON_PERSISTENT))
    point_tracker(folder, TRACKER, None if choice.step is None else str(choice.step))
    labels.restarted_from(choice.step, set_aside=aside)
    log.warning("scout_megatron: restart from %s (%s: %s); %d newer iteration(s) set aside in %s",
                f"iteration {choice.step}" if choice.step is not None else "Megatron's initialization",
                choice.label, choice.reason, len(aside), SET_ASIDE)
    return {"load": choice.step, "reason": choice.reason, "stopped_for": choice.failure}


def plan_restart(load_dir: str | None, ckpt_step: int | None = None, *,
                 load_rejected: bool = False) -> dict[str, Any] | None:
    """Before Megatron's ``load_checkpoint``: choose the iteration to load from SCOUT's labels and make Megatron
    load it (every rank calls it; rank 0 moves files and broadcasts the plan). None: no labels, Megatron's own
    choice. After an SDC stop a plan that cannot be made stops the launch: loading the newest iteration then
    would restore the state the verdict rejected. ``--ckpt-step`` of an iteration SCOUT labelled rejected raises
    ``RejectedCheckpointError`` on every rank, unless ``load_rejected`` (``checkpoint.load_rejected``)."""
    if not load_dir or not dist.is_initialized():
        return None
    if ckpt_step:
        refuse_rejected(load_dir, lambda step, _entry: step == int(ckpt_step), f"--ckpt-step {ckpt_step}",
                        who="scout_megatron", allowed=load_rejected)
    return agreed_restart_plan(load_dir, lambda: _plan(load_dir, ckpt_step), who="scout_megatron",
                               what="Megatron's iteration")


def label_saves(handle: ScoutHandle, save_dir: str | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap Megatron's ``save_checkpoint``: checkpoint I/O for the observers, then the new iteration labelled in
    ``save_dir`` (nothing labelled without ``--save``, or with replay off: nothing could verify it)."""
    labels = handle.label_framework_checkpoints(save_dir) if save_dir else None

    def wrap(save: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(save)
        def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
            with handle.checkpoint_io("write"):
                out = save(iteration, *args, **kwargs)
            if labels is not None and not kwargs.get("non_persistent_ckpt", False):
                try:
                    labels.saved(int(iteration), iteration_dir(save_dir, int(iteration)), handle.certifier)
                except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                    handle.guard.report(int(iteration), "checkpoint", exc, "labelling Megatron's checkpoint")
            return out

        return save_checkpoint

    return wrap


def continue_after_load(handle: ScoutHandle, iteration: int, folder: str | None) -> None:
    """Megatron loaded ``iteration``: SCOUT goes on from there, trusting it as far as its labels say."""
    if iteration <= 0:
        return
    labels = handle.framework_checkpoints
    verified = labels.verified_at(iteration) if labels is not None else None
    handle.continue_from(int(iteration), verified=verified)
    if handle.rank == 0:
        log.info("scout_megatron: SCOUT goes on from Megatron's iteration %d (verified up to %s) in %s", iteration,
                 verified, folder)
