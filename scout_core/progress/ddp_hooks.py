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
import weakref
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


class _Slot:
    """What SCOUT keeps for a DDP model whose hook slot it holds: the registration functions DDP's class routes
    to, and the join context's last count of ranks not yet joined (the work of its all-reduce, whether DDP was
    told to divide by the initial world size, and the count once read), as DDP's reducer keeps it
    (``_set_forward_pass_work_handle``)."""

    def __init__(self, takes: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
        self.takes = takes
        self.join: tuple[Any, bool] | None = None
        self.count: int | None = None


_SLOTS: weakref.WeakKeyDictionary[Any, _Slot] = weakref.WeakKeyDictionary()
"""Beside the model, not on it: a copy of the model (``copy.deepcopy``, pickling) carries none of it, and DDP
builds the copy a reducer of its own, with a free hook slot."""


def _slot(obj: Any) -> _Slot | None:
    try:
        return _SLOTS.get(obj)
    except TypeError:  # not weakly referable or not hashable: not a model SCOUT hooked
        return None


def holds_slot(ddp_model: Any) -> bool:
    """Whether SCOUT's hook holds this model's comm-hook slot."""
    return _slot(ddp_model) is not None


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

    model_ref = weakref.ref(ddp_model)  # the slot's functions must not keep the model alive (its weak key)

    def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
        ddp_model = model_ref()
        ddp_model._check_comm_hook(hook)
        if user_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if ddp_model.logger is not None:
            ddp_model.logger._set_comm_hook_name(hook.__qualname__)
        user_hook.append((state, hook, False))

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        ddp_model = model_ref()
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
    _SLOTS[ddp_model] = _Slot((register_comm_hook, register_builtin_comm_hook))


def divisor(ddp_model: Any, world: int) -> int:
    """What DDP's reducer divides this iteration's gradients by: the world size, or under
    ``join(divide_by_initial_world_size=False)`` the number of ranks not yet joined, read from the join
    context's count as the reducer reads it (it waits for that all-reduce, which every rank launched in its
    forward). A joined rank's shadow buckets are zeros, whatever they are divided by."""
    slot = _slot(ddp_model)
    if slot is None or slot.join is None or slot.join[1]:
        return world
    if slot.count is None:  # once per forward, as the reducer: reading it waits for the device
        work = slot.join[0]
        work.wait()
        slot.count = int(work.get_future().value()[0].item())  # result() is missing on Python backends
    return slot.count


def _route_registration() -> None:
    """Send ``DistributedDataParallel``'s registration methods, for a model whose slot SCOUT holds, to
    SCOUT's hook; every other model gets DDP's own. Once per process; it stays (a model's hook stays too)."""
    from torch.nn.parallel import DistributedDataParallel

    for name, which in (("register_comm_hook", 0), ("_register_builtin_comm_hook", 1)):
        original = DistributedDataParallel.__dict__[name]
        if getattr(original, "__scout_routed__", False):
            continue

        def routed(self: Any, *args: Any, _original: Any = original, _which: int = which, **kwargs: Any) -> Any:
            slot = _slot(self)
            return _original(self, *args, **kwargs) if slot is None else slot.takes[_which](*args, **kwargs)

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
        slot = _slot(joinable) if work is not None else None
        if slot is not None:
            slot.join = (work, bool(getattr(joinable, "_divide_by_initial_world_size", True)))
            slot.count = None
        return work

    functools.update_wrapper(notify_join_context, original)
    notify_join_context.__scout_routed__ = True  # type: ignore[attr-defined]
    Join.notify_join_context = staticmethod(notify_join_context)
