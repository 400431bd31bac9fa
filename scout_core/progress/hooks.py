"""Trainer-side progress publishing through public PyTorch hooks only.

Nothing in the training loop is edited. What is published, and from where:

* repeated layer forward: ``register_forward_pre_hook``;
* repeated layer backward (``observer.layer_backward_marks``): a gradient hook on the layer's input;
* optimizer step: ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``;
* data loader fetch: :meth:`ProgressTracker.wrap_dataloader` (wraps the iterator);
* checkpoint I/O: :meth:`ProgressTracker.checkpoint_io` (a context manager);
* ``torch.distributed`` collectives: module-attribute wrappers (:func:`install_collective_hooks`);
* DDP gradient buckets: ``DistributedDataParallel.register_comm_hook``;
* FSDP2 all-gather / reduce-scatter: FSDP2 calls ``dist.all_gather_single``,
  ``dist.reduce_scatter_single`` and ``dist.all_reduce``, which are wrapped.

Intent and fingerprint of a collective are published BEFORE the call, so a
rank waiting inside it is distinguishable from one that never arrived.

Invisible, and therefore diagnosed at group scope only: collectives issued
from C++ without a Python hook (DDP's own bucket all-reduce when another comm
hook is already registered, DDP's construction-time broadcast), functional
collectives (``torch.distributed._functional_collectives``), and everything
inside compiled graphs (``torch.compile``, CUDA graphs). See docs/hangs.md.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scout_core.progress.fingerprint import SUPPORTED_OPS, CollectiveFingerprint, fingerprint_bucket, fingerprint_call
from scout_core.progress.record import Phase, ProgressRecord
from scout_core.replay.calls import tensor_leaves

__all__ = ["ProgressTracker", "install_collective_hooks", "uninstall_collective_hooks", "unobserved"]

_THREAD = threading.local()


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Collectives issued by this thread inside the block are not published as progress.

    For SCOUT's own background traffic (snapshot replication on its own group): it
    is no part of the training protocol, and a stalled partner must not make this
    rank's trainer look stuck in a collective.
    """
    previous = getattr(_THREAD, "quiet", False)
    _THREAD.quiet = True
    try:
        yield
    finally:
        _THREAD.quiet = previous


class ProgressTracker:
    """Counts steps and operations and publishes them to the rank's record."""

    def __init__(self, record: ProgressRecord) -> None:
        self.record = record
        self.step = 0
        self.op_id = 0
        self._lock = threading.Lock()  # autograd and comm hooks may run on other threads
        self._local = threading.local()
        self._handles: list[Any] = []
        self.closed = False  # set by remove_hooks(): nothing may publish into a closed record
        self.resume_at: int | None = None
        """A resumed job's restored step: published from its first completed step on (until then the
        record says step 0, the observer's warm-up, whatever the restored step)."""

    # -- publishing ----------------------------------------------------------------------------

    def mark(self, phase: Phase) -> None:
        with self._lock:
            self.op_id += 1
            self.record.publish(self.step, self.op_id, phase)

    def enter_collective(self, fp: CollectiveFingerprint) -> None:
        with self._lock:
            self.op_id += 1
            self.record.publish_collective(self.step, self.op_id, fp.hash64(), fp.text())

    def step_done(self) -> None:
        with self._lock:
            if self.resume_at is not None:
                self.step, self.resume_at = self.resume_at, None
            self.step += 1
            self.op_id += 1
            self.record.publish(self.step, self.op_id, Phase.STEP_END)

    @property
    def in_collective(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def collective(self, fp: CollectiveFingerprint) -> Iterator[None]:
        """Publish intent, then run the body; nested collectives (object collectives call
        plain ones) are not published again."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self.enter_collective(fp)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    # -- boundaries the training loop passes through --------------------------------------------

    def wrap_dataloader(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """An iterable that publishes the data-loader phase around every fetch."""
        tracker = self

        class _Tracked:
            def __iter__(self) -> Iterator[Any]:
                it = iter(iterable)
                while True:
                    tracker.mark(Phase.DATALOADER)
                    try:
                        item = next(it)
                    except StopIteration:
                        tracker.mark(Phase.COMPUTE)
                        return
                    tracker.mark(Phase.COMPUTE)
                    yield item

            def __len__(self) -> int:
                return len(iterable)  # type: ignore[arg-type]

        return _Tracked()

    @contextlib.contextmanager
    def checkpoint_io(self, kind: str = "write") -> Iterator[None]:
        """Mark checkpoint reads or writes: ``with tracker.checkpoint_io("write"): save(...)``."""
        if kind not in ("read", "write"):
            raise ValueError(f"checkpoint_io kind must be 'read' or 'write', got {kind!r}")
        self.mark(Phase.CHECKPOINT_WRITE if kind == "write" else Phase.CHECKPOINT_READ)
        try:
            yield
        finally:
            self.mark(Phase.COMPUTE)

    # -- module and optimizer hooks ---------------------------------------------------------------

    def install_module_hooks(self, layers: Iterable[torch.nn.Module], *, backward: bool = False) -> None:
        """One forward pre-hook per repeated layer; optionally backward marks too.

        With ``backward=True`` the pre-hook also puts a gradient hook on the
        layer's input, which fires once the layer's backward has produced it.
        That locates a rank frozen inside backward more precisely, but a Python
        callback per layer inside the autograd engine costs 1-3 % of a CPU step
        (README benchmarks), so it is off by default. Classification does not
        need it: peers that wait in a collective have published its intent and
        are ahead of a rank stopped anywhere in backward.
        """

        def on_grad(grad: torch.Tensor) -> None:
            self.mark(Phase.BACKWARD)

        def pre(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.mark(Phase.FORWARD)

        def pre_with_backward(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.mark(Phase.FORWARD)
            first = next(iter(tensor_leaves((args, kwargs))), None)
            if first is not None and first.requires_grad:
                first.register_hook(on_grad)

        hook = pre_with_backward if backward else pre
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))

    def install_optimizer_hooks(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        opts = list(optimizers)
        for i, opt in enumerate(opts):
            self._handles.append(opt.register_step_pre_hook(lambda *_: self.mark(Phase.OPTIMIZER)))
            if i == 0:  # one step per iteration even with several inner optimizers
                self._handles.append(opt.register_step_post_hook(lambda *_: self.step_done()))

    def install_ddp_comm_hook(self, ddp_model: Any) -> bool:
        """Route DDP's bucket all-reduce through a hook that publishes intent first.

        Same arithmetic as DDP's default (average over the group). Returns False
        when the model already has a comm hook (DDP allows one): the buckets then
        stay invisible and hang verdicts for them are group-scoped.
        """
        group = ddp_model.process_group
        tracker = self

        # DDP inspects the hook's annotations (and this module's are strings), so none here.
        def hook(state, bucket):  # noqa: ANN001, ANN202
            buffer = bucket.buffer()
            world = dist.get_world_size(group)
            # DDP cannot unregister a comm hook: after close() it stays, averaging as before, silent.
            published = contextlib.nullcontext() if tracker.closed else tracker.collective(
                fingerprint_bucket(buffer, group))
            with published:
                buffer.div_(world)
                work = dist.all_reduce(buffer, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        try:
            ddp_model.register_comm_hook(None, hook)
        except RuntimeError:
            return False
        return True

    def remove_hooks(self) -> None:
        self.closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()


# -- torch.distributed wrappers (process-wide, reference counted) ----------------------------------

_ORIGINALS: dict[str, Callable[..., Any]] = {}
_ACTIVE: list[ProgressTracker] = []
_C10D = dist.distributed_c10d


def _make_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE or getattr(_THREAD, "quiet", False):
            return original(*args, **kwargs)
        tracker = _ACTIVE[-1]
        local = tracker._local
        depth = getattr(local, "depth", 0)
        if depth:  # inside an object collective: its inner calls are not published again
            return original(*args, **kwargs)
        tracker.enter_collective(fingerprint_call(name, args, kwargs))
        local.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            local.depth = 0

    wrapper.__scout_original__ = original  # type: ignore[attr-defined]
    return wrapper


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
