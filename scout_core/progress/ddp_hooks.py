"""DDP's one comm-hook slot, shared: a hook the user registers after SCOUT's runs inside SCOUT's.

DDP allows one comm hook per model, and SCOUT's (:meth:`~scout_core.progress.hooks.ProgressTracker.
install_ddp_comm_hook`) takes it to publish each bucket's all-reduce. The model's own registration methods are
replaced on the instance so that the user's hook, or DDP's built-in ALLREDUCE or FP16_COMPRESS (the same
arithmetic as DDP's C++ built-ins), is handed to SCOUT's hook, which delegates every bucket to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["FutureWork", "take_later_hooks"]


class FutureWork:
    """A comm hook's future, polled as a work is (complete when the future is done)."""

    def __init__(self, fut: Any) -> None:
        self._fut = fut

    def is_completed(self) -> bool:
        return bool(self._fut.done())


def take_later_hooks(ddp_model: Any, user_hook: list[tuple[Any, Callable[..., Any], bool]]) -> None:
    """Make the DDP instance's hook registration hand the user's hook to SCOUT's, which delegates to it.

    DDP allows one comm hook per model and SCOUT's holds the slot, so a user's own registration after
    ``enable()`` (a compression hook, PowerSGD) would raise. Registration keeps DDP's checks and its
    logging of the hook's name, and refuses a second user hook as DDP itself does. Only DDP's own methods are
    replaced (a subclass's override stays its own, and then raises as DDP does), and only on the instance:
    ``DistributedDataParallel.register_comm_hook(ddp, ...)`` called on the class still raises.
    """
    from torch.nn.parallel import DistributedDataParallel

    if type(ddp_model).register_comm_hook is not DistributedDataParallel.register_comm_hook:
        return
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

    ddp_model.register_comm_hook = register_comm_hook
    ddp_model._register_builtin_comm_hook = register_builtin_comm_hook
