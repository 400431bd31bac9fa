"""ZeRO-3 under replay: a sampled layer's partitioned parameters gathered for its replay only, and the layer called
without DeepSpeed's module hooks (scout_core's ``FrameworkAdapter.gather_layer`` and ``MoEBinding.materialize``).

ZeRO-3 keeps each parameter partitioned across its data-parallel group and registers hooks on every module: before
a forward they fetch (all-gather) the module's parameters, after it they release them, and around the backward
they fetch again and reduce-scatter the gradients into the optimizer's partition. A replay that ran those hooks
would move the prefetch coordinator's trace and reduce replay's gradients into training's. So the parameters are
gathered with ``deepspeed.zero.GatheredParameters`` (without a modifier rank: nothing is written back) on every rank
of the partition group at the same check, as FSDP2 replay unshards, and DeepSpeed's hooks are set aside while the
layer replays. Hooks of anyone else (the user's, a library's) stay and run in replay as in training, as they do under
ZeRO-1/2 and every other layout: a fault that enters through such a hook is replayed too, not silently skipped.
Replay's gradients are computed with ``torch.autograd.grad``, which never runs the parameters' post-accumulate-grad
hooks (ZeRO's gradient reduction).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from scout_core.replay.layer import defining_module

__all__ = ["gather_zero3", "gathered_bytes", "module_hooks_set_aside"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _from_deepspeed(hook: Any) -> bool:
    """Whether a hook is DeepSpeed's own (defined in a ``deepspeed`` module: ZeRO-3's fetch, release and gradient
    hooks are closures of ``deepspeed.runtime.zero``), seen through partials and bound methods."""
    module = defining_module(hook)
    return module == "deepspeed" or module.startswith("deepspeed.")


@contextlib.contextmanager
def module_hooks_set_aside(module: nn.Module) -> Iterator[None]:
    """``module`` and everything inside it called without DeepSpeed's module hooks (ZeRO-3's parameter fetch and
    release, its pre-backward gradient hooks), restored afterwards, also on a failure; other hooks stay."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for m in module.modules():
            for attr in _HOOK_DICTS:
                hooks = getattr(m, attr, None)
                if hooks and any(_from_deepspeed(h) for h in hooks.values()):
                    saved.append((m, attr, hooks))
                    setattr(m, attr, type(hooks)((k, h) for k, h in hooks.items() if not _from_deepspeed(h)))
        yield
    finally:
        for m, attr, hooks in saved:
            setattr(m, attr, hooks)


def _zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s ZeRO-3 parameters that are partitioned now. Persistent ones (``ds_persist``: below
    ``stage3_param_persistence_threshold``, LayerNorm weights by default) stay whole on every rank; gathering them
    would partition them again on the release, and training would fetch them back on every forward after."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in module.parameters() if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def gathered_bytes(layer: nn.Module) -> int:
    """Device bytes gathering ``layer`` allocates (scout_core's ``FrameworkAdapter.gather_bytes``): its partitioned
    parameters whole (``ds_numel``), twice over (DeepSpeed gathers each into a padded flat buffer that the parameter
    then views: about once, the rest is margin). Replay
    probes this much before any rank joins the gather, so a rank without the memory skips the check with its peers
    instead of failing alone before the collective (DeepSpeed allocates the gathered buffers first)."""
    return 2 * sum(int(p.ds_numel) * p.element_size() for p in _zero3_params(layer))


def gather_zero3(layer: nn.Module) -> tuple[Callable[..., Any], Callable[[], None]]:
    """ZeRO-3: ``layer``'s parameters gathered whole (a collective over their partition group: every rank calls it
    for the same layer at the same check) and the layer callable without DeepSpeed's hooks; returns
    ``(forward, release)`` (scout_core's ``FrameworkAdapter.gather_layer``). On a failure what was done is undone
    before the error goes on."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    params = _zero3_params(layer)
    stack = contextlib.ExitStack()
    try:
        if params:
            stack.enter_context(GatheredParameters(params))  # modifier_rank None: nothing is written back
        stack.enter_context(module_hooks_set_aside(layer))
    except BaseException:
        stack.close()
        raise
    return layer, stack.close
