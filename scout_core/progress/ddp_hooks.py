"""DDP's one comm-hook slot, shared: a hook the user registers after SCOUT's runs inside SCOUT's.

DDP allows one comm hook per model, and SCOUT's (:meth:`~scout_core.progress.hooks.ProgressTracker.
install_ddp_comm_hook`) takes it to publish each bucket's all-reduce. DDP's registration methods route such a
model's registrations to SCOUT's hook, so that the user's hook, or DDP's built-in ALLREDUCE or FP16_COMPRESS (the
same arithmetic as DDP's C++ built-ins), is handed to SCOUT's hook, which delegates every bucket to it. And
since with a hook registered DDP no longer scales the gradients itself, SCOUT's hook divides as DDP's reducer
would, by the ranks not yet joined under ``join(divide_by_initial_world_size=False)`` too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["FutureWork", "divisor", "holds_slot", "take_later_hooks"]


class FutureWork:
    """A comm hook's future, polled as a work is (complete when the future is done)."""

    def __init__(self, fut: Any) -> None:
        self._fut = fut

    def is_completed(self) -> bool:
        return bool(self._fut.done())


_TAKES = "_scout_takes_comm_hooks"
"""On a DDP instance whose hook slot SCOUT holds: its registration functions, which the class's route to."""
_JOIN_WORK = "_scout_join_work"
"""On such an instance: the last work of the join context's count of ranks not yet joined, and whether DDP was
told to divide by the initial world size (what its reducer keeps, ``_set_forward_pass_work_handle``)."""


def holds_slot(ddp_model: Any) -> bool:
    """Whether SCOUT's hook holds this model's comm-hook slot."""
    return _TAKES in vars(ddp_model)


def take_later_hooks(ddp_model: Any, user_hook: list[tuple[Any, Callable[..., Any], bool]]) -> None:
    """Make the model's hook registration hand the user's hook to SCOUT's, which delegates to it.

    DDP allows one comm hook per model and SCOUT's holds the slot, so a user's own registration after
    ``enable()`` (a compression hook, PowerSGD) would raise. DDP's registration methods are routed on the
    class (:func:`_route_registration`), so the instance's method, ``DistributedDataParallel.
    register_comm_hook(ddp, ...)`` and a subclass's ``super().register_comm_hook(...)`` all arrive here.
    Registration keeps DDP's checks and its logging of the hook's name, and refuses a second user hook as DDP
    itself does. A subclass that registers through ``dist._register_comm_hook`` itself still raises as DDP does.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
        ddp_model._check_comm_hook(hook)
        if user_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if ddp_model.logger is not None:
            ddp_model.logger._set_comm_hook_name(hook.__qualname__)
        user_hook.append((state, hook, False))

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        # The same arithmetic as DDP's C++ built-ins: divide, then all-reduce (FP16: cast, divide, all-reduce).
        builtins = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                    dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in builtins:
            raise ValueError(f"unknown built-in DDP comm hook {comm_hook_type!r}")
        if user_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if ddp_model.logger is not None:
            ddp_model.logger._set_comm_hook_name(str(comm_hook_type))
        user_hook.append((ddp_model.process_group, builtins[comm_hook_type], True))

    _route_registration()
    _count_join()
    vars(ddp_model)[_TAKES] = (register_comm_hook, register_builtin_comm_hook)
    vars(ddp_model)[_JOIN_WORK] = None


def divisor(ddp_model: Any, world: int) -> int:
    """What DDP's reducer divides this iteration's gradients by: the world size, or under
    ``join(divide_by_initial_world_size=False)`` the number of ranks not yet joined, read from the join
    context's count as the reducer reads it (it waits for that all-reduce, which every rank launched in its
    forward). A joined rank's shadow buckets are zeros, whatever they are divided by."""
    held = vars(ddp_model).get(_JOIN_WORK)
    if held is None or held[1]:
        return world
    work = held[0]
    work.wait()
    return int(work.result()[0].item())


def _route_registration() -> None:
    """Send ``DistributedDataParallel``'s registration methods, for a model whose slot SCOUT holds, to
    SCOUT's hook; every other model gets DDP's own. Once per process; it stays (a model's hook stays too)."""
    from torch.nn.parallel import DistributedDataParallel

    for name, which in (("register_comm_hook", 0), ("_register_builtin_comm_hook", 1)):
        original = DistributedDataParallel.__dict__[name]
        if getattr(original, "__scout_routed__", False):
            continue

        def routed(self: Any, *args: Any, _original: Any = original, _which: int = which, **kwargs: Any) -> Any:
            takes = vars(self).get(_TAKES)
            return _original(self, *args, **kwargs) if takes is None else takes[_which](*args, **kwargs)

        functools.update_wrapper(routed, original)
        routed.__scout_routed__ = True  # type: ignore[attr-defined]
        setattr(DistributedDataParallel, name, routed)


def _count_join() -> None:
    """Keep, for each model whose slot SCOUT holds, the join context's count of ranks not yet joined, which
    DDP hands its reducer and never to a comm hook. ``Join.notify_join_context`` is wrapped once per process;
    for every other joinable it only calls through."""
    from torch.distributed.algorithms.join import Join

    original = Join.__dict__["notify_join_context"].__func__
    if getattr(original, "__scout_routed__", False):
        return

    def notify_join_context(joinable: Any) -> Any:
        work = original(joinable)
        if work is not None and _JOIN_WORK in vars(joinable):
            vars(joinable)[_JOIN_WORK] = (work, bool(getattr(joinable, "_divide_by_initial_world_size", True)))
        return work

    functools.update_wrapper(notify_join_context, original)
    notify_join_context.__scout_routed__ = True  # type: ignore[attr-defined]
    Join.notify_join_context = staticmethod(notify_join_context)
