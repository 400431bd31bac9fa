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
  ``dist.reduce_scatter_single`` and ``dist.all_reduce``, which are wrapped;
* coalesced batches (``torch.distributed._coalescing_manager``, Megatron's gradient and parameter buckets):
  inside it a collective call only queues its operation, which runs when the block ends; the wrapped manager
  keeps the block's collectives in flight until the batch's work completes.

Launch (with the fingerprint) is published BEFORE the call and completion
after it, so a rank waiting inside a collective is distinguishable from one
that never arrived and from one that finished it and stopped later.

Invisible, and therefore diagnosed at group scope only: collectives issued
from C++ without a Python hook (DDP's own bucket all-reduce when another comm
hook is already registered, DDP's construction-time broadcast), functional
collectives (``torch.distributed._functional_collectives``), and everything
inside compiled graphs (``torch.compile``, CUDA graphs). See docs/hangs.md.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scout_core.progress.fingerprint import SUPPORTED_OPS, CollectiveFingerprint, fingerprint_bucket, fingerprint_call
from scout_core.progress.record import Phase, ProgressRecord
from scout_core.replay.calls import tensor_leaves

__all__ = ["ProgressTracker", "install_collective_hooks", "late_bound", "uninstall_collective_hooks", "unobserved"]

_THREAD = threading.local()
POLL_QUIET_S = 0.05
"""The poller thread looks at in-flight collectives only after the training thread was this quiet."""


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
    """Publishes the rank's point in its step's collective sequence, and its phase, to the record.

    The coordinate is ``(step, i)``: ``i`` counts the collectives the training
    threads launched in this step and restarts at every optimizer step, so an
    extra publish on one rank (a rank-0-only evaluation or checkpoint write, a
    layer hooked twice) never shifts it. Module, data and checkpoint marks only
    change the phase. Launch and completion are tracked apart: while any
    launched collective is incomplete the record shows the oldest one and its
    fingerprint, so a rank that launched a bucket and then stopped in backward
    shows "done with bucket 1", not "waiting in bucket 1".

    Completion is known from the work's future on CPU transports (gloo), and
    by polling the work (or a CUDA event recorded behind a blocking call) at
    every publish on device transports, whose futures complete at launch.
    """

    def __init__(self, record: ProgressRecord) -> None:
        self.record = record
        self.step = 0
        self.launched = 0
        """Collectives the training threads launched in this step."""
        self._inflight: dict[tuple[int, int], tuple[int, str]] = {}  # (step, i) -> fingerprint, launch order
        self._polled: collections.deque[tuple[tuple[int, int], Any]] = collections.deque()
        self._phase = Phase.STARTING
        self._io: Phase | None = None  # inside checkpoint_io(): its collectives belong to the checkpoint
        self._lock = threading.Lock()  # autograd and comm hooks may run on other threads
        self._local = threading.local()
        self._trainer = threading.get_ident()
        self._handles: list[Any] = []
        self._poller: threading.Thread | None = None
        self._cuda_device: int | None = None
        """The device of the CUDA collectives in flight: the poller thread sets it before it polls them."""
        self.closed = False  # set by remove_hooks(): nothing may publish into a closed record
        self.resume_at: int | None = None
        """A resumed job's restored step: published from its first completed step on (until then the
        record says step 0, the observer's warm-up, whatever the restored step)."""

    # -- publishing ----------------------------------------------------------------------------

    @property
    def op_id(self) -> int:
        return self.launched

    def _publish_locked(self) -> None:
        if self._polled:
            self._poll_locked()
        if self._inflight:
            (step, i), fp = next(iter(self._inflight.items()))
            self.record.publish(step, i, self._phase, True, self.launched, fp)
        else:
            self.record.publish(self.step, self.launched, self._phase, False, self.launched)

    def _poll_locked(self) -> None:
        while self._polled:
            key, handle = self._polled[0]
            try:
                done = handle.query() if hasattr(handle, "query") else handle.is_completed()
            except Exception:  # a failed work is not pending any more
                done = True
            if not done:
                return
            self._polled.popleft()
            self._inflight.pop(key, None)

    def mark(self, phase: Phase) -> None:
        """A phase boundary (layer, data loader, checkpoint, optimizer): the coordinate does not move."""
        with self._lock:
            if self._phase is Phase.CLOSED or (self.closed and phase is not Phase.CLOSED):
                return  # after close() or a stop (a loop still iterating, a final flush): CLOSED is the last word
            self._phase = phase
            self._publish_locked()

    def counts_here(self) -> bool:
        """Collectives of this thread belong to the training protocol: the training thread's own, and
        those issued from backward (DDP comm hooks, FSDP2 reduce-scatters run on autograd threads)."""
        if getattr(_THREAD, "quiet", False):
            return False
        return threading.get_ident() == self._trainer or torch._C._current_graph_task_id() != -1

    def launch(self, fp: CollectiveFingerprint) -> tuple[int, int]:
        """Publish the launch of the next collective of this step; returns its key for :meth:`complete`."""
        with self._lock:
            if self.closed:
                return (self.step, 0)  # a wrapper that outlived close(): nothing may publish into a closed record
            self.launched += 1
            key = (self.step, self.launched)
            self._inflight[key] = (fp.hash64(), fp.text())
            # A collective of a checkpoint save or load (a distributed checkpoint's gathers and barriers) keeps the
            # checkpoint phase: the observer then allows it the I/O tolerance, and names a rank stuck there a
            # checkpoint stall.
            self._phase = self._io or Phase.COLLECTIVE
            self._publish_locked()
            return key

    def complete(self, key: tuple[int, int]) -> None:
        with self._lock:
            if self._inflight.pop(key, None) is not None and not self.closed:
                self._publish_locked()

    def track(self, key: tuple[int, int], result: Any, tensor: torch.Tensor | None) -> None:
        """Learn when the collective launched as ``key`` completes, from what its call returned.

        Completion is polled (``work.is_completed()``, or a CUDA event recorded behind a blocking call on a
        device, whose call returns at launch), never learned from a Python callback on the future: that
        callback runs on the transport's own thread, which then waits for the GIL before it can start the
        next collective (measured: +4 % step time under FSDP2 on gloo). The poll runs at every publish of the
        training thread and, while collectives are in flight and the training thread has been quiet for
        ``POLL_QUIET_S``, on a small poller thread, so a rank that stopped after a launch still shows it done.
        """
        on_device = tensor is not None and tensor.device.type not in ("cpu", "meta")
        if result is not None and hasattr(result, "is_completed"):
            handle: Any = result
        elif on_device and tensor.device.type == "cuda":
            handle = torch.cuda.Event()
            handle.record()
        else:
            self.complete(key)  # a blocking call on the host returned: done
            return
        with self._lock:
            if key not in self._inflight:
                return
            self._polled.append((key, handle))
            if on_device and tensor.device.type == "cuda":
                # The poller polls on this device, not device 0: a CUDA call on a thread that never set it
                # would create a context on GPU 0 (hundreds of MiB there, from every rank of the machine).
                self._cuda_device = tensor.device.index if tensor.device.index is not None \
                    else torch.cuda.current_device()
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll_while_quiet, name="scout-completion", daemon=True)
                self._poller.start()

    def _poll_while_quiet(self) -> None:
        device: int | None = None
        while not self.closed:
            time.sleep(POLL_QUIET_S)
            if not self._polled or time.monotonic() - self.record.last_publish < POLL_QUIET_S:
                continue  # nothing in flight, or the training thread publishes (and polls) itself
            with self._lock:
                if self._cuda_device is not None and self._cuda_device != device:  # set with the handles, above
                    device = self._cuda_device
                    torch.cuda.set_device(device)
                before = len(self._inflight)
                self._poll_locked()
                if len(self._inflight) != before and not self.closed:
                    self._publish_locked()

    def step_done(self) -> None:
        with self._lock:
            if self.closed:
                return
            if self.resume_at is not None:
                self.step, self.resume_at = self.resume_at, None
            self.step += 1
            self.launched = 0
            self._trainer = threading.get_ident()  # the thread that steps the optimizer trains
            # Step 0 is warm-up (compilation, lazy init, communicator set-up): its gaps don't count; from
            # step 1 on they are the job's healthy rhythm, which the observer's threshold adapts to (published
            # once step 1 completed: until then the observer tolerates the warm-up silence).
            self.record.commit_gaps()
            self.record.learning = True
            self._phase = Phase.STEP_END
            self._publish_locked()

    @property
    def in_collective(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Inside a published collective: the plain collectives it calls are not published again."""
        depth = getattr(self._local, "depth", 0)
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
        phase = Phase.CHECKPOINT_WRITE if kind == "write" else Phase.CHECKPOINT_READ
        outer, self._io = self._io, phase
        self.mark(phase)
        try:
            yield
        finally:
            self._io = outer
            self.mark(outer or Phase.COMPUTE)

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
            buffer.div_(dist.get_world_size(group))
            # DDP cannot unregister a comm hook: after close() it stays, averaging as before, silent.
            if tracker.closed:
                work = dist.all_reduce(buffer, group=group, async_op=True)
            else:
                key = tracker.launch(fingerprint_bucket(buffer, group))
                with tracker.calling():
                    work = dist.all_reduce(buffer, group=group, async_op=True)
                tracker.track(key, work, buffer)
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
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=1.0)  # it sleeps at most POLL_QUIET_S between looks at `closed`


# -- torch.distributed wrappers (process-wide, reference counted) ----------------------------------

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
