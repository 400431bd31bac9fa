"""In-memory snapshots of the training state, captured without blocking training.

A snapshot holds what a bitwise resume needs: this rank's model parameters and
buffers (local shards for FSDP2 / HSDP), the modules' own extra state
(``get_extra_state``: Transformer Engine's FP8 scaling state, see
:mod:`scout_core.extra_state`), every optimizer's state and param groups,
caller-owned extra state, and the CPU and device RNG states (plus any RNG a
plugin registers).

Capture is asynchronous. :meth:`SnapshotEngine.capture` grabs the RNG states
and starts copying tensors on a background thread (on CUDA: a side stream into
pinned host memory, ordered after the optimizer step that produced them). The
next optimizer step is the first thing that mutates the sources again, so an
optimizer step pre-hook waits for an unfinished copy; the forward and backward
passes in between overlap with it. The time the training thread spends in
``capture`` and in that wait is accumulated in ``blocking_s``.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from scout_core.extra_state import capture_extra_states, restore_extra_states
from scout_core.signature import local_tensor

__all__ = ["SnapshotEngine", "UnusableSnapshot", "local_tensor", "module_state", "restore_state"]


class UnusableSnapshot(RuntimeError):
    """The capture holds something a restart could not load (the caller's state): it is not kept."""


def module_state(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The chunk's live parameters and persistent buffers, named as ``state_dict()`` names them, without its
    hooks. A model's state-dict hooks may hand out converted copies (TorchTitan splits its fused ``wqkv`` into
    ``wq``/``wk``/``wv`` on save and fuses them back on load): a snapshot copied into such a copy would restore
    nothing, silently. (A module's ``get_extra_state`` is not part of it: see :mod:`scout_core.extra_state`.)"""
    state: dict[str, torch.Tensor] = {}
    for prefix, module in chunk.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                state[dot + name] = param
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                state[dot + name] = buf
    return state


def _like_param(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Wrap a saved local tensor the way ``param`` is held (DTensor shard or plain)."""
    local = local_tensor(param)
    if local is param or value.shape != local.shape:
        return value.to(local.device)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(local.device), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


class SnapshotEngine:
    """Captures and restores one rank's training state.

    ``get_extra`` returns extra state as objects the snapshot keeps as they are (fresh copies, not live
    objects training goes on mutating); ``set_extra`` puts it back on restore. Caller state that is final
    only at the end of the step comes through :meth:`complete_extra`, which copies it.
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        get_extra: Callable[[], dict[str, Any]] | None = None,
        set_extra: Callable[[dict[str, Any]], None] | None = None,
        rng_providers: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] | None = None,
    ) -> None:
        self.chunks = list(model_chunks)
        self.optimizers = list(optimizers)
        self.get_extra = get_extra
        self.set_extra = set_extra
        self.rng_providers = dict(rng_providers or {})
        self.blocking_s = 0.0
        self.captures = 0
        self._pending: threading.Thread | None = None
        self._cuda_event: Any = None
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        # The copy thread, the coordinator's persistence thread and the training thread's pre-step hook
        # all wait for a copy; one lock orders the join and the hand-over of its result.
        self._lock = threading.RLock()
        self._extra: dict[str, Any] = {}
        self._unusable: str | None = None  # why the capture in flight must not be kept
        self._extra_ready: threading.Event | None = None
        self._late_groups: list[Any] | None = None
        self._reserving: threading.Thread | None = None
        self._reserved = False
        self._hooks = [opt.register_step_pre_hook(lambda *_: self._wait_blocking()) for opt in self.optimizers]

    # -- capture ------------------------------------------------------------------------------

    def _sources(self, *, clone_buffers: bool = True) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, Any]]]:
        models = []
        for chunk in self.chunks:
            # Buffers change in the next forward (running statistics, DDP's buffer broadcast) while the
            # background copy may still run, so they are copied now; parameters and optimizer state change
            # only at the next optimizer step, which waits for the copy.
            buffers = {name for name, _ in chunk.named_buffers()} if clone_buffers else set()
            models.append({k: (local_tensor(v).clone() if k in buffers else local_tensor(v))
                           for k, v in module_state(chunk).items()})
        optims = []
        for opt in self.optimizers:
            sd = opt.state_dict()  # references to live state tensors; param ids are indices
            optims.append({
                "state": {i: {k: (local_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                          for i, st in sd["state"].items()},
                "param_groups": sd["param_groups"],
            })
        return models, optims

    @staticmethod
    def _tensors(models: list[dict[str, torch.Tensor]], optims: list[dict[str, Any]]) -> list[torch.Tensor]:
        return [t for m in models for t in m.values()] + [
            v for o in optims for st in o["state"].values() for v in st.values() if isinstance(v, torch.Tensor)]

    def reserve_host_memory(self) -> None:
        """Take the pinned host memory that CUDA captures copy into now, on a background thread.

        Pinning is slow: on an H200 the first capture of a 1.5 GB state stalled its step for 1.3 s, where
        later captures, served from torch's caching host allocator, cost nothing visible. Allocating and
        freeing the same sizes once leaves the blocks in that cache for the first capture. Call it once the
        optimizer state exists (after the first optimizer step); a capture waits for it to finish.
        """
        if self._reserved:
            return
        self._reserved = True
        try:
            models, optims = self._sources(clone_buffers=False)
            sizes = [(t.shape, t.dtype) for t in self._tensors(models, optims) if t.is_cuda]
        except Exception:  # noqa: BLE001 - a warm-up never breaks training; the capture reports real errors
            return
        if not sizes:
            return

        def reserve() -> None:
            try:
                blocks = [torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True) for shape, dtype in sizes]
                del blocks  # back into the caching host allocator, where the first capture finds them
            except Exception:  # noqa: BLE001 - only a warm-up: the capture allocates what it still needs
                pass

        self._reserving = threading.Thread(target=reserve, daemon=True, name="scout-pinned-reserve")
        self._reserving.start()

    def _join_reserve(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def capture(self, step: int, *, extra_later: bool = False, pinned: bool = True) -> None:
        """Start capturing the state as of now (call right after the optimizer step).

        ``extra_later``: the caller's state is not final yet (an LR scheduler or gradient scaler steps
        after the optimizer); :meth:`complete_extra` adds it, and :meth:`result` waits for it.
        ``pinned=False``: CUDA tensors too are copied into pageable host memory, by the background thread (a
        one-off copy that must not hold page-locked RAM, e.g. the state ``resume()`` may have to put back).
        """
        start = time.perf_counter()
        self._join_reserve()
        self._wait()  # at most one capture in flight
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        for name, (get, _) in self.rng_providers.items():
            rng[name] = get()
        # get_extra returns objects the snapshot may keep (SCOUT's sweep state is built as fresh host copies):
        # a second deep copy here would double its cost on the training thread.
        extra = self.get_extra() if self.get_extra else {}
        self._extra = extra
        self._unusable = None
        self._late_groups = None
        self._extra_ready = threading.Event()
        if not extra_later:
            self._extra_ready.set()
        models, optims = self._sources()
        # Small (FP8 scaling state) and rebuilt by each call: taken here, as of the optimizer step, since the next
        # forward advances it before the copy thread would get to it.
        header = {"step": step, "rng": rng, "extra": extra,
                  "module_extra": [capture_extra_states(chunk) for chunk in self.chunks]}
        tensors = self._tensors(models, optims)
        on_cuda = any(t.is_cuda for t in tensors)
        if on_cuda and pinned:
            self._capture_cuda(header, models, optims)
        else:
            self._pending = threading.Thread(target=self._copy, args=(header, models, optims), daemon=True)
            self._pending.start()
        self.captures += 1
        self.blocking_s += time.perf_counter() - start

    def _copy(self, header: dict[str, Any], models: list[dict[str, torch.Tensor]], optims: list[dict[str, Any]],
              non_blocking: bool = False) -> None:
        def cp(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=non_blocking)
            return out.copy_(t.detach(), non_blocking=non_blocking)

        try:
            self._result = {
                **header,
                "model": [{k: cp(v) for k, v in m.items()} for m in models],
                "optim": [{"state": {i: {k: cp(v) for k, v in st.items()} for i, st in o["state"].items()},
                           "param_groups": [dict(g) for g in o["param_groups"]]} for o in optims],
            }
        except BaseException as exc:  # surfaced by wait()
            self._error = exc

    def _capture_cuda(self, header: dict[str, Any], models: Any, optims: Any) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the optimizer step's kernels
        for t in self._tensors(models, optims):
            if t.is_cuda:
                # The cloned buffers die when this returns: without this their memory could be handed to
                # the next forward's kernels on the training stream before the side stream has read it.
                t.record_stream(stream)
        with torch.cuda.stream(stream):
            self._copy(header, models, optims, non_blocking=True)
        self._cuda_event = torch.cuda.Event()
        self._cuda_event.record(stream)

    def _wait(self, *, raise_error: bool = True) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.join()
                self._pending = None
            if self._cuda_event is not None:
                self._cuda_event.synchronize()
                self._cuda_event = None
            if raise_error and self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError("snapshot copy failed") from err

    def _wait_blocking(self) -> None:
        """Before the next optimizer step: the copy must have read the tensors it overwrites."""
        # One read of each: the persistence thread may clear them (under the lock) at any moment, and an
        # event it has already synchronized is still a valid (complete) event to wait on.
        pending, event = self._pending, self._cuda_event
        if pending is None and event is None:
            return
        start = time.perf_counter()
        if event is not None and pending is None:
            # GPU-side ordering only: the step's kernels wait for the copy; the host does not.
            torch.cuda.current_stream().wait_event(event)
        else:
            # Wait only: a failed copy is the persistence thread's to report (through result()), never an
            # exception out of the training loop's optimizer.step().
            self._wait(raise_error=False)
        self.blocking_s += time.perf_counter() - start

    def complete_extra(self, values: dict[str, Any], *, unusable: str | None = None) -> None:
        """Add the caller's final state to the capture in flight (a deep copy: training goes on).

        The optimizers' hyperparameters are taken again too: an LR scheduler writes the next step's
        learning rate into the param groups after the optimizer step the tensors were captured at.
        ``unusable``: why a restart could not load this state; :meth:`result` then raises
        :class:`UnusableSnapshot` and the capture is never written.
        """
        if self._extra_ready is None or self._extra_ready.is_set():
            return
        try:
            self._unusable = unusable
            self._extra.update(copy.deepcopy(values))
            self._late_groups = [copy.deepcopy(opt.state_dict()["param_groups"]) for opt in self.optimizers]
        finally:
            self._extra_ready.set()  # never leave the persistence thread waiting

    def result(self) -> dict[str, Any]:
        """The last captured snapshot (waits for its copy and its caller state)."""
        if self._extra_ready is not None:
            self._extra_ready.wait()
        with self._lock:
            self._wait()
            if self._unusable is not None:
                raise UnusableSnapshot(self._unusable)
            if self._late_groups is not None and self._result is not None:
                for saved, groups in zip(self._result["optim"], self._late_groups, strict=True):
                    saved["param_groups"] = groups
                self._late_groups = None
            if self._result is None:
                raise RuntimeError("no snapshot captured yet (or already released)")
            return self._result

    def release(self) -> None:
        """Drop the host copy once it is persisted: a rank holds one copy of its state in RAM, not two."""
        with self._lock:
            self._result = None

    def state_bytes(self) -> int:
        """Bytes of this rank's model and optimizer state (what one snapshot copies)."""
        models, optims = self._sources(clone_buffers=False)
        tensors = self._tensors(models, optims)
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- restore ------------------------------------------------------------------------------

    def restore(self, snap: dict[str, Any]) -> None:
        restore_state(self.chunks, self.optimizers, snap, set_extra=self.set_extra,
                      rng_providers=self.rng_providers)

    def close(self) -> None:
        self._join_reserve()
        self._wait()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


@torch.no_grad()
def restore_state(
    chunks: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    snap: dict[str, Any],
    *,
    set_extra: Callable[[dict[str, Any]], None] | None = None,
    rng_providers: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] | None = None,
) -> None:
    """Copy a snapshot into live (possibly freshly built) model chunks and optimizers, bitwise."""
    if len(snap["model"]) != len(chunks) or len(snap["optim"]) != len(optimizers):
        raise ValueError(f"snapshot has {len(snap['model'])} chunks / {len(snap['optim'])} optimizers, "
                         f"the job has {len(chunks)} / {len(optimizers)}")
    for chunk, saved in zip(chunks, snap["model"]):
        live = module_state(chunk)
        if set(live) != set(saved):
            raise ValueError(f"snapshot keys differ from the model: {sorted(set(live) ^ set(saved))[:5]}")
        for k, v in live.items():
            local_tensor(v).copy_(saved[k])
    for chunk, saved in zip(chunks, snap.get("module_extra", ())):  # absent in a snapshot of an older SCOUT
        restore_extra_states(chunk, saved)
    for opt, saved in zip(optimizers, snap["optim"]):
        params = [p for g in opt.param_groups for p in g["params"]]
        state = {}
        for i, st in saved["state"].items():
            p = params[int(i)]
            # Clone: load_state_dict may keep these very tensors, and the snapshot must stay intact.
            state[int(i)] = {k: (_like_param(p, v.clone()) if isinstance(v, torch.Tensor) else v)
                             for k, v in st.items()}
        opt.load_state_dict({"state": state, "param_groups": [dict(g) for g in saved["param_groups"]]})
    torch.set_rng_state(snap["rng"]["cpu"])
    if "cuda" in snap["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(snap["rng"]["cuda"])
    for name, (_, setter) in (rng_providers or {}).items():
        if name in snap["rng"]:
            setter(snap["rng"][name])
    if set_extra is not None:
        set_extra(snap["extra"])
