"""Drop-ins for ``megatron.training``'s ``parse_and_validate_args`` and ``pretrain``: the one-line change.

A Megatron-Core 0.19 training script parses its arguments, then calls ``pretrain``::

    from scout_megatron import parse_and_validate_args, pretrain   # the only changed line

* :func:`parse_and_validate_args` is Megatron's, with SCOUT's flags added through Megatron's own
  ``extra_args_provider`` (composed with the script's provider, which runs first), and SCOUT's configuration
  validated while the arguments are parsed;
* :func:`pretrain` is Megatron's; with ``--scout`` it attaches SCOUT right after Megatron's
  ``setup_model_and_optimizer`` has built the model chunks, the optimizer and the scheduler (and loaded
  ``--load``), before the first iteration, and closes it when ``pretrain`` returns or raises. Megatron's saves
  are labelled by certification and a restart loads the iteration SCOUT chose (:mod:`scout_megatron.checkpoints`).
  Without ``--scout`` it is Megatron's ``pretrain``, untouched.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from scout_core.actions import ScoutStop
from scout_core.config import ScoutConfig
from scout_core.runtime import ScoutHandle
from scout_megatron.flags import add_scout_args, config_from_args

__all__ = ["RERUN_TO_DISAMBIGUATE", "last_handle", "parse_and_validate_args", "pretrain", "scout_args_provider"]

RERUN_TO_DISAMBIGUATE = 16
"""Megatron's rerun state machine's exit code: resume from the checkpoint it just saved, on another GPU."""

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def scout_args_provider(extra_args_provider: ArgsProvider | None = None) -> ArgsProvider:
    """An ``extra_args_provider`` that runs the script's own provider, then adds SCOUT's flags."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_scout_args(parser)

    return provide


def parse_and_validate_args(extra_args_provider: ArgsProvider | None = None, ignore_unknown_args: bool = False,
                            args_defaults: dict[str, Any] | None = None) -> argparse.Namespace:
    """Megatron's ``parse_and_validate_args`` with SCOUT's flags (same arguments, same result)."""
    from megatron.training import arguments

    return arguments.parse_and_validate_args(scout_args_provider(extra_args_provider), ignore_unknown_args,
                                             args_defaults or {})


class _Attached:
    """Holds the handle of the SCOUT attached during one ``pretrain`` call."""

    handle: ScoutHandle | None = None


_last: _Attached = _Attached()


def last_handle() -> ScoutHandle | None:
    """The SCOUT handle the running (or last) ``pretrain`` call attached, or None: for a script's own callbacks
    (its replay history and incidents stay readable after ``pretrain`` returned and closed it)."""
    return _last.handle


_TRAIN_DATA_ARG = 4
"""The position of ``train_data_iterator`` in Megatron's ``train(forward_step_func, model, optimizer,
opt_param_scheduler, train_data_iterator, ...)``."""


def _scout_config(megatron_args: argparse.Namespace) -> ScoutConfig | None:
    """SCOUT's configuration from the parsed arguments, or None: SCOUT not asked for (no ``--scout``)."""
    if not hasattr(megatron_args, "scout"):
        if any(a.startswith("--scout") for a in sys.argv[1:]):
            raise RuntimeError("scout_megatron.pretrain: --scout was given but the arguments were parsed without "
                               "SCOUT's flags: parse them with scout_megatron.parse_and_validate_args (the same "
                               "import line); --yaml-cfg replaces the parsed flags and cannot carry SCOUT's")
        return None
    return config_from_args(megatron_args)


def _refuse_cuda_graphs(megatron_args: argparse.Namespace) -> None:
    """Stop a launch with SCOUT and CUDA graphs, naming the graph flags given."""
    graphs = [flag for flag, on in (
        ("--optimizer-cuda-graph", getattr(megatron_args, "optimizer_cuda_graph", False)),
        ("--cuda-graph-impl", getattr(megatron_args, "cuda_graph_impl", "none") not in (None, "none")),
        ("--enable-cuda-graph", getattr(megatron_args, "enable_cuda_graph", False))) if on]
    if graphs:
        # A captured graph replays kernels without running Python: SCOUT's boundary and capture hooks would run at
        # the capture only, and diagnosis would silently stop.
        raise RuntimeError(f"scout_megatron: SCOUT observes training through Python hooks, which CUDA graphs skip: "
                           f"run without {', '.join(graphs)}, or without --scout")


def _finalize_marked(finalize: Callable[..., Any], handle: ScoutHandle, margs: argparse.Namespace
                     ) -> Callable[..., Any]:
    """Megatron's ``maybe_finalize_async_save``, marked as checkpoint I/O while an asynchronous save is in flight."""
    from megatron.training.async_utils import is_empty_async_queue

    @functools.wraps(finalize)
    def finalize_marked(*fa: Any, **fk: Any) -> Any:
        # An asynchronous save's finalization (its metadata, barriers, the tracker; at the end, waiting for
        # the writer) is checkpoint I/O too, not a stalled job. Megatron calls this every iteration: only a
        # save in flight is marked, so the step's hot path publishes nothing more.
        if not getattr(margs, "async_save", False) or is_empty_async_queue():
            return finalize(*fa, **fk)
        with handle.checkpoint_io("write"):
            return finalize(*fa, **fk)

    return finalize_marked


def _train_with_marked_data(train: Callable[..., Any], attached: _Attached) -> Callable[..., Any]:
    """Megatron's ``train``, its training data iterator marked for SCOUT once SCOUT is attached."""
    from scout_megatron.attach import mark_data

    @functools.wraps(train)
    def train_with_marked_data(*a: Any, **k: Any) -> Any:
        if attached.handle is not None:  # a fetch of the training data marks the hang path (data stalls)
            if len(a) > _TRAIN_DATA_ARG:
                a = (*a[:_TRAIN_DATA_ARG], mark_data(attached.handle, a[_TRAIN_DATA_ARG]), *a[_TRAIN_DATA_ARG + 1:])
            elif "train_data_iterator" in k:
                k["train_data_iterator"] = mark_data(attached.handle, k["train_data_iterator"])
        return train(*a, **k)

    return train_with_marked_data


def pretrain(*args: Any, **kwargs: Any) -> Any:
    """Megatron's ``pretrain`` (same arguments, same result), with SCOUT attached when ``--scout`` was given."""
    from megatron.training import get_args, training

    megatron_args = get_args()
    config = _scout_config(megatron_args)
    if config is None:
        return training.pretrain(*args, **kwargs)  # SCOUT not asked for: Megatron's pretrain, untouched
    _refuse_cuda_graphs(megatron_args)
    from scout_megatron.attach import attach
    from scout_megatron.checkpoints import continue_after_load, label_saves, plan_restart

    global _last
    attached = _last = _Attached()
    setup, save, finalize = (training.setup_model_and_optimizer, training.save_checkpoint,
                             training.maybe_finalize_async_save)

    @functools.wraps(setup)
    def setup_then_attach(*a: Any, **k: Any) -> Any:
        margs = get_args()
        load, own = getattr(margs, "load", None), getattr(margs, "save", None)
        if load and own and os.path.realpath(load) == os.path.realpath(own):
            # Before Megatron's own load: its tracker is pointed at the iteration SCOUT's labels chose. Only in the
            # job's own folder: a --load of another run's checkpoints (a base model to finetune) is left as it is.
            plan_restart(load, getattr(margs, "ckpt_step", None), load_rejected=config.checkpoint.load_rejected)
        model, optimizer, scheduler = setup(*a, **k)
        if attached.handle is None and optimizer is not None:  # --skip-train builds no optimizer: nothing to watch
            handle = attached.handle = attach(model, optimizer, config=config, opt_param_scheduler=scheduler)
            training.save_checkpoint = label_saves(handle, own)(save)
            training.maybe_finalize_async_save = _finalize_marked(finalize, handle, margs)
            continue_after_load(handle, int(getattr(margs, "iteration", 0) or 0), getattr(margs, "load", None))
        return model, optimizer, scheduler

    train = training.train
    # ``pretrain`` calls the module's ``setup_model_and_optimizer``, ``train`` and ``save_checkpoint`` by name and
    # offers no hook between building the model and training it: the names are rebound for this call only.
    training.setup_model_and_optimizer = setup_then_attach
    training.train = _train_with_marked_data(train, attached)
    planned: SystemExit | None = None
    try:
        try:
            return training.pretrain(*args, **kwargs)
        except SystemExit as exc:
            if isinstance(exc, ScoutStop) or exc.code not in (0, None, RERUN_TO_DISAMBIGUATE):
                raise
            # Megatron's planned exits (--exit-interval, --exit-duration-in-mins, its signal handler) end
            # with sys.exit(0) from inside its loop: a normal end for SCOUT too (the last step's state settled, a
            # stop decided at it carried out), not a failure. So is its rerun state machine's exit 16, which saved a
            # checkpoint to resume from on another GPU: the relaunch loads it unless SCOUT rejected it.
            planned = exc
    finally:
        training.setup_model_and_optimizer, training.save_checkpoint, training.train = setup, save, train
        training.maybe_finalize_async_save = finalize
        if attached.handle is not None:
            attached.handle.close()
    raise planned
