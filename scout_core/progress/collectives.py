"""Process-wide ``torch.distributed`` wrappers that publish each collective's launch and completion to a tracker.

Every supported collective of ``torch.distributed`` (and of ``distributed_c10d``,
for its internal callers) is replaced by a wrapper while at least one
:class:`~scout_core.progress.hooks.ProgressTracker` is installed (reference
counted); the originals return when the last one is uninstalled. Coalesced
batches (``torch.distributed._coalescing_manager``, Megatron's gradient and
parameter buckets) only queue their collectives: the wrapped manager keeps them
in flight until the batch's work completes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scout_core.progress.fingerprint import SUPPORTED_OPS, fingerprint_call

if TYPE_CHECKING:  # hooks re-exports this module's functions
    from scout_core.progress.hooks import ProgressTracker

__all__ = ["install_collective_hooks", "late_bound", "uninstall_collective_hooks"]

_ORIGINALS: dict[str, Callable[..., Any]] = {}
_ACTIVE: list[ProgressTracker] = []
_C10D = dist.distributed_c10d


def _make_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return original(*args, **kwargs)
        tracker = _ACTIVE[-1]
        # inside a published collective (object collectives call plain ones), or not the training protocol
        if getattr(tracker._local, "depth", 0) or tracker.closed or not tracker.counts_here():
            return original(*args, **kwargs)
        key = tracker.launch(fingerprint_call(name, args, kwargs))
        tracker._local.depth = 1
        try:
            result = original(*args, **kwargs)
        except BaseException:
            tracker.complete(key)  # it failed: not pending any more
            raise
        finally:
            tracker._local.depth = 0
        pending = getattr(tracker._local, "coalesced", None)
        if pending is not None and _queued(result):  # in a coalesced batch: it runs, and completes, with the batch
            pending.append((key, _first_tensor(args, kwargs)))
        else:  # an operation the manager does not batch ran at once (Megatron's fp32-accumulating reduce-scatter)
            tracker.track(key, result, _first_tensor(args, kwargs))
        return result

    wrapper.__scout_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _queued(result: Any) -> bool:
    """Whether a call inside a coalescing manager only queued its operation: torch then returns nothing, or a
    placeholder work (``_IllegalWork``) whose every method raises."""
    return result is None or type(result).__name__ == "_IllegalWork"


class _BatchWork:
    """The work of a coalesced batch: complete when every work torch returned for it is, or, on the host, once
    the batch was waited for (gloo's coalesced reduce-scatter work never reports itself completed, even after its
    wait returned; a device work's wait returns at once and only orders the stream, so it proves nothing there)."""

    def __init__(self, works: list[Any], *, host: bool) -> None:
        self.works = works
        self.host = host
        self.waited = False

    def is_completed(self) -> bool:
        return (self.host and self.waited) or all(w.is_completed() for w in self.works)

    def watch(self, cm: Any) -> None:
        """Learn when the caller waits for the batch (``cm.wait()``)."""
        wait = cm.wait

        def waited(*args: Any, **kwargs: Any) -> Any:
            out = wait(*args, **kwargs)
            self.waited = True
            return out

        cm.wait = waited


def _make_coalescing_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextlib.contextmanager
    def wrapper(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[Any]:
        tracker = _ACTIVE[-1] if _ACTIVE else None
        if tracker is None or tracker.closed or getattr(tracker._local, "coalesced", None) is not None:
            with original(group, device, async_ops) as cm:
                yield cm
            return
        pending: list[tuple[tuple[int, int], torch.Tensor | None]] = []
        tracker._local.coalesced = pending
        try:
            with original(group, device, async_ops) as cm:
                yield cm
        except BaseException:
            tracker._local.coalesced = None
            for key, _ in pending:
                tracker.complete(key)  # the batch failed: not pending any more
            raise
        tracker._local.coalesced = None
        # The batch ran as the block ended: asynchronously, its work is in the manager; synchronously it was waited
        # for (on a device, an event recorded now follows it).
        works = [w for w in getattr(cm, "works", []) if w is not None] if async_ops else []
        batch = None
        if works:
            first = next((t for _, t in pending if t is not None), None)
            batch = _BatchWork(works, host=first is None or first.device.type == "cpu")
            batch.watch(cm)
        for key, tensor in pending:
            tracker.track(key, batch, tensor)

    functools.update_wrapper(wrapper, original)
    wrapper.__scout_original__ = original  # type: ignore[attr-defined]
    return wrapper


_COALESCING = "_coalescing_manager"


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def late_bound(bound: Any) -> Any:
    """For a ``torch.distributed`` function a framework bound to a name of its own before SCOUT's collective hooks
    existed (Megatron's bucket functions, DeepSpeed's backend): a stand-in that calls ``torch.distributed``'s
    function of the same name at call time, where the hooks see it (torch's own function when none are installed).
    None where ``bound`` is not torch.distributed's (a framework's own implementation) or is a stand-in already."""
    if bound is None or getattr(bound, "_scout_late_bound", False):
        return None
    name = getattr(bound, "__name__", "")
    if getattr(dist, name, None) is not bound:
        return None

    def late(*args: Any, **kwargs: Any) -> Any:
        return getattr(dist, name)(*args, **kwargs)

    late._scout_late_bound = True  # type: ignore[attr-defined]
    late.__name__ = name
    return late


def install_collective_hooks(tracker: ProgressTracker) -> None:
    """Wrap every supported ``torch.distributed`` collective; idempotent per tracker."""
    if tracker in _ACTIVE:
        return
    if not _ORIGINALS:
        for name in SUPPORTED_OPS:
            original = getattr(dist, name, None)
            if original is None:
                continue
            _ORIGINALS[name] = original
            wrapper = _make_wrapper(name, original)
            setattr(dist, name, wrapper)
            if getattr(_C10D, name, None) is original:
                setattr(_C10D, name, wrapper)  # internal callers such as all_gather_object
        original = getattr(dist, _COALESCING, None)
        if original is not None:
            _ORIGINALS[_COALESCING] = original
            setattr(dist, _COALESCING, _make_coalescing_wrapper(original))
    _ACTIVE.append(tracker)


def uninstall_collective_hooks(tracker: ProgressTracker) -> None:
    """Undo :func:`install_collective_hooks`; the originals return when no tracker is left."""
    if tracker in _ACTIVE:
        _ACTIVE.remove(tracker)
    if _ACTIVE or not _ORIGINALS:
        return
    for name, original in _ORIGINALS.items():
        setattr(dist, name, original)
        if getattr(getattr(_C10D, name, None), "__scout_original__", None) is original:
            setattr(_C10D, name, original)
    _ORIGINALS.clear()
