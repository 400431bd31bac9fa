"""DDP's gradient reduction published without a comm hook: each backward pass as one collective of the step.

DDP's C++ reducer all-reduces its gradient buckets during backward and waits for them when backward ends. Making
each bucket visible takes a Python comm hook, and on gloo any Python comm hook costs a CPU step several percent
(torch's own ``allreduce_hook`` as much as SCOUT's: the future's callback and the hook's call each wait for the
GIL on the transport's and the autograd engine's threads). So by default SCOUT leaves DDP's bucket path alone and
publishes the reduction as one collective: launched when backward reaches the DDP model's output (a gradient
hook on it), complete when backward ends, after DDP's own wait for its buckets (an autograd final callback
queued from a final callback runs after every callback queued before it, DDP's reducer's among them).

What the observer can tell from it: a rank stopped before its backward (in forward, in the data loader, in its
own code) is behind peers that wait in the reduction, and is named; a rank stopped inside backward launched the
reduction as its peers did, so the group stopped at one point and the verdict names the group (an equal-progress
stall). ``observer.ddp_bucket_hook`` publishes each bucket instead, which names that rank too (docs/hangs.md).
"""

from __future__ import annotations

from typing import Any

import torch

from scout_core.progress.fingerprint import CollectiveFingerprint, describe_group
from scout_core.progress.record import DDP_REDUCTION
from scout_core.replay.calls import tensor_leaves

__all__ = ["fingerprint_reduction", "mark_ddp_backward"]


def fingerprint_reduction(ddp_model: Any) -> CollectiveFingerprint:
    """The reduction's fingerprint: its group and the number of gradient elements (equal on every rank: DDP
    checks at construction that every rank holds the same parameters)."""
    numel = sum(p.numel() for p in ddp_model.parameters() if p.requires_grad)
    return CollectiveFingerprint(op=DDP_REDUCTION, group=describe_group(ddp_model.process_group),
                                 shapes=((numel,),), dtypes=(), reduce_op="SUM")


def mark_ddp_backward(tracker: Any, ddp_model: Any) -> Any:
    """Publish each backward pass through ``ddp_model`` as one collective on ``tracker`` (a
    :class:`~scout_core.progress.hooks.ProgressTracker`); returns the forward hook's handle (remove it to stop).

    Every output that requires a gradient is hooked (a backward may start from any of them) and one backward
    launches once (its graph task's id). A forward under ``no_sync()`` launches nothing: DDP reduces nothing in
    that backward, and a rank's extra backward of its own (input gradients for a metric) must not shift its count.
    """
    fp = fingerprint_reduction(ddp_model)
    engine = torch.autograd.Variable._execution_engine
    launched_in: list[int] = [-1]  # the graph task that launched last

    def on_output_grad(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task == launched_in[0]:
            return
        launched_in[0] = task
        key = tracker.launch(fp)

        def after_ddp() -> None:  # queued now, it runs after the callbacks queued before it (DDP's wait)
            engine.queue_callback(lambda: tracker.complete(key))

        engine.queue_callback(after_ddp)

    def after_forward(module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not getattr(module, "require_backward_grad_sync", True):
            return  # evaluation, or gradient accumulation under no_sync(): DDP reduces nothing in this backward
        for t in tensor_leaves(output):
            if t.requires_grad:
                t.register_hook(on_output_grad)

    return ddp_model.register_forward_hook(after_forward)
