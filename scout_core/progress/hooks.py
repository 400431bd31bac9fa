"""Trainer-side progress publishing through public PyTorch hooks only.

Nothing in the training loop is edited. What is published, and from where:

* repeated layer forward: ``register_forward_pre_hook``;
* repeated layer backward (``observer.layer_backward_marks``): a gradient hook on the layer's input;
* optimizer step: ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``;
* data loader fetch: :meth:`ProgressTracker.wrap_dataloader` (wraps the iterator);
* checkpoint I/O: :meth:`ProgressTracker.checkpoint_io` (a context manager);
* ``torch.distributed`` collectives: module-attribute wrappers (:mod:`~scout_core.progress.collectives`);
* DDP gradient reduction: one collective per backward (:mod:`~scout_core.progress.ddp_backward`), or each
  bucket through ``DistributedDataParallel.register_comm_hook`` (``observer.ddp_bucket_hook``);
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
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scout_core.progress.collectives import install_collective_hooks, late_bound, uninstall_collective_hooks
from scout_core.progress.ddp_backward import mark_ddp_backward
from scout_core.progress.ddp_hooks import FutureWork, divisor, holds_slot, take_later_hooks
from scout_core.progress.fingerprint import CollectiveFingerprint, fingerprint_bucket
from scout_core.progress.record import DDP_REDUCTION, Phase, ProgressRecord
from scout_core.replay.calls import tensor_leaves

# The collective wrappers live in scout_core.progress.collectives; the trainer, the plugins and the tests import them
# from here.
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
        self._ddp_flags: list[Any] = []  # which gradients alias their DDP bucket: live as long as the comm hook
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
            (step, i), fp = self._oldest_locked()
            self.record.publish(step, i, self._phase, True, self.launched, fp)
        else:
            self.record.publish(self.step, self.launched, self._phase, False, self.launched)

    def _oldest_locked(self) -> tuple[tuple[int, int], tuple[int, str]]:
        """The in-flight collective to publish: the oldest, except DDP's reduction, which spans its whole backward:
        a collective issued inside that backward (SyncBatchNorm's, a user's) is shown while it is in flight."""
        items = iter(self._inflight.items())
        first = next(items)
        if not first[1][1].startswith(DDP_REDUCTION):
            return first
        return next((item for item in items if not item[1][1].startswith(DDP_REDUCTION)), first)

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
            # A blocking call on the host returned: done, published now (FSDP2's gloo collectives are all
            # blocking). Left for the next publish, a rank frozen in between would read as still inside a
            # collective its peers have left: a protocol mismatch to the observer, not a lagging rank.
            self.complete(key)
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

    def install_ddp_backward_marks(self, ddp_models: Iterable[Any]) -> None:
        """Each backward pass through these DDP models as one collective (no comm hook: the shipped way)."""
        self._handles += [mark_ddp_backward(self, m) for m in ddp_models]

    def install_ddp_comm_hook(self, ddp_model: Any) -> bool:
        """Route DDP's bucket all-reduce through a hook that publishes intent first.

        Same arithmetic as DDP's default (average over the group). Returns False
        when the model already has a comm hook (DDP allows one): the buckets then
        stay invisible and hang verdicts for them are group-scoped. A hook the user
        registers afterwards (``ddp.register_comm_hook``, or a built-in such as
        FP16_COMPRESS) takes over the arithmetic: SCOUT's hook hands every bucket to
        it untouched and publishes the bucket as one collective, whatever the hook
        runs inside (the collectives a hook issues from its futures' callbacks run
        on the transport's threads, counted on some ranks and not on others).
        """
        if holds_slot(ddp_model) or getattr(ddp_model, "_comm_hooks", None):
            return False  # SCOUT's hook holds the slot already, or the user's does
        group = ddp_model.process_group
        tracker = self
        # DDP scales each gradient as its own reduction would: times the reciprocal of the world size as it copies
        # the gradient into the bucket, but divided when the gradient already is its bucket's view (kept
        # gradients under gradient_as_bucket_view). The two differ in the last bit at 3, 5, 6, 12 ... ranks, so
        # which one each gradient gets is noted as autograd hands it over, before it is accumulated.
        aliased: dict[int, bool] = {}
        view_mode = bool(getattr(ddp_model, "gradient_as_bucket_view", False))
        if view_mode:
            for p in ddp_model.parameters():
                if p.requires_grad:  # kept for as long as the comm hook (DDP never drops it), not closed with it
                    self._ddp_flags.append(p.register_hook(
                        lambda _g, p=p: aliased.__setitem__(id(p), p.grad is not None and p.grad._base is not None)))

        user_hook: list[tuple[Any, Callable[..., Any], bool]] = []  # (state, hook, built-in), registered after
        # DDP's C++ reducer holds the hook, out of sight of Python's cycle collector: the hook must not hold
        # the model, or the model is never freed.
        model_ref = weakref.ref(ddp_model)

        # DDP inspects the hook's annotations (and this module's are strings), so none here.
        def hook(state, bucket):  # noqa: ANN001, ANN202
            world = dist.get_world_size(group)
            if isinstance(bucket, tuple):  # DDP's Python reducer (compiled DDP, delayed all-reduce): (grad, param)
                if user_hook and not user_hook[0][2]:  # DDP calls a user's Python hook here; never its built-ins
                    return user_hook[0][1](user_hook[0][0], bucket)
                grad = bucket[0]  # DDP's own reduction on this path; the result is unused
                grad.div_(world)
                dist.all_reduce(grad, group=group)
                return None
            if user_hook:
                return tracker._delegate(user_hook[0][1], user_hook[0][0], bucket, group)
            buffer = bucket.buffer()
            world = divisor(model_ref(), world)  # under join, the ranks not yet joined (as DDP's reducer divides)
            params = bucket.parameters() if view_mode else []
            if any(aliased.get(id(p)) for p in params):
                for p, g in zip(params, bucket.gradients(), strict=True):
                    g.div_(world) if aliased.get(id(p)) else g.mul_(1.0 / world)
            else:
                buffer.mul_(1.0 / world)
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
        except RuntimeError:  # a built-in hook holds the slot: DDP listed ours before its C++ side refused it
            with contextlib.suppress(ValueError, AttributeError):
                ddp_model._comm_hooks.remove((hook, None))  # else its Python reducer would run both
            return False
        take_later_hooks(ddp_model, user_hook)
        return True

    def _delegate(self, user_fn: Callable[..., Any], user_state: Any, bucket: Any, group: Any) -> Any:
        """The user's hook on one bucket, published as one collective of the bucket on every rank alike."""
        buffer = bucket.buffer()
        if self.closed:
            return user_fn(user_state, bucket)
        key = self.launch(fingerprint_bucket(buffer, group))
        try:
            with self.calling():  # what it issues on this thread is inside the bucket's collective
                fut = user_fn(user_state, bucket)
        except BaseException:
            self.complete(key)
            raise
        self.track(key, FutureWork(fut), buffer)
        return fut

    def remove_hooks(self) -> None:
        self.closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=1.0)  # it sleeps at most POLL_QUIET_S between looks at `closed`
