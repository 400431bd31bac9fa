"""Replaying one sampled layer: ship the source's call, materialize the layer, run it, sign it.

These are the layer-level pieces of :class:`~scout_core.replay.engine.ReplayEngine`:

* the source's captured call reaches every peer through :mod:`~scout_core.replay.shipping`;
* :func:`materialize` makes an FSDP2 layer whole for the replay without
  running FSDP's hooks (so its reduce-scatter never touches live gradients);
* :func:`replay_layer` runs forward and ``torch.autograd.grad`` once per input
  variant under the source's RNG and returns the signed surfaces.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scout_core.consensus import c3_exchange
from scout_core.extra_state import capture_extra_states, extra_state_tensors, restore_extra_states
from scout_core.replay.calls import rebuild, tensor_leaves
from scout_core.replay.rng import RngProvider, replay_rng_scope, rng_fingerprint
from scout_core.replay.scratch import Scratch, fsdp_module, managed_parameters
from scout_core.replay.shipping import ShippedCall
from scout_core.signature import sign_many

_log = logging.getLogger("scout")

__all__ = ["GATHERED_RECEIPT", "GATHERED_SHARD", "ComputeClock", "LayerReplay", "device_of", "gather_ranks",
           "gathered_shard_surfaces", "materialize", "release_of", "replay_layer"]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_told: set[int] = set()


def defining_module(hook: Any) -> str:
    """The module that defined a hook, seen through partials and bound methods (whose hook it is)."""
    fn = hook
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        else:
            break
    return getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""


def _say_hooks_skipped(layer: torch.nn.Module) -> None:
    """FSDP2 replay calls the gathered layer's ``forward`` itself, past the module's own hooks (FSDP's, which must
    not run, and anyone else's, which then do not either): a user's hook there is named once, not skipped in
    silence. Hooks of the layer's submodules run as in training."""
    theirs = [h for attr in _HOOK_DICTS for h in getattr(layer, attr, {}).values()
              if not defining_module(h).startswith(("torch.", "scout_core."))]
    if callable(vars(layer).get("forward")):  # an instance's own forward (a patch): replay runs the class's
        theirs.append(vars(layer)["forward"])
    if theirs and id(layer) not in _told:
        _told.add(id(layer))
        names = ", ".join(sorted({getattr(h, "__qualname__", type(h).__name__) for h in theirs}))
        _log.warning("SCOUT replays %s (FSDP2) by calling its class's forward past the module's own hooks: %s "
                     "do not run in replay, so a fault they introduce is not seen there (hooks and forwards of its "
                     "submodules run)", type(layer).__name__, names)


GATHERED_SHARD = ".gathered_shard."
"""Surfaces ``<layer>.gathered_shard.<j>``: shard position ``j``'s part of an HSDP layer's gathered parameters."""
GATHERED_RECEIPT = ".gathered_receipt"
"""Surface ``<layer>.gathered_receipt``: the positions whose part this rank holds otherwise than its shard group."""


def gathered_shard_surfaces(layer: torch.nn.Module, name: str, shard_group: Any, shard_dims: Sequence[int], *,
                            gathered: bool = True) -> list[tuple[str, Any]]:
    """HSDP, after the unshard: the signature of every other shard position's part of the gathered parameters,
    and the positions this rank received otherwise than their owner holds them (one exchange over the group).

    The owner's copy of its own part is the reference (its replicas vouch for it through ``local_shard``): a
    mate whose copy differs received it corrupted, on its way or on arrival (``gathered_receipt``), whatever
    the other mates hold. A part that a replica holds otherwise while it matches its owner's is the owner's
    shard, and the replica's surfaces of this layer then differ because of it (``verdicts.
    explained_by_shard_mates``). Every mate joins the exchange, also one whose unshard (``gathered`` False) or
    signing failed: it sends "unavailable" and raises afterwards, so no mate is left waiting in the group.
    ``shard_dims``: each parameter's sharded dim, read before the unshard."""
    n, own = dist.get_world_size(shard_group), dist.get_rank(shard_group)
    names = [f"{name}{GATHERED_SHARD}{j}" for j in range(n)]
    failure: Exception | None = None
    try:
        if not gathered:
            raise RuntimeError(f"{name} was not gathered")
        parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for p, dim in zip(layer.parameters(), shard_dims, strict=True):
            if isinstance(p, DTensor):  # a nested fully_shard's parameter: not gathered by this unshard
                continue
            for j, chunk in enumerate(p.detach().chunk(n, dim=dim)):  # FSDP2's Shard(dim) splits as torch.chunk
                parts[j].append(chunk)
        # Per parameter, no concatenation: the gathered layer already took the scratch memory's headroom.
        signed: list[Any] = [tuple((s.signature, s.nonfinite) for s in sign_many(ps)) for ps in parts]
    except Exception as exc:  # noqa: BLE001 - raised after the exchange every mate joins
        failure, signed = exc, [("unavailable", own)] * n
    received = c3_exchange(signed, group=shard_group, surfaces=names)
    if failure is not None:
        raise failure
    mine = dist.get_global_rank(shard_group, own)
    otherwise = []
    for j, res in enumerate(received):
        held = dict(zip(res.peer_ranks, res.evidence, strict=True))
        if j != own and held[mine] != held[dist.get_global_rank(shard_group, j)]:
            otherwise.append(j)
    return [(names[j], signed[j]) for j in range(n) if j != own] + [(f"{name}{GATHERED_RECEIPT}", tuple(otherwise))]


def materialize(layer: torch.nn.Module, owner: torch.nn.Module | None = None,
                scratch: Scratch | None = None, gather: Any = None) -> tuple[Any, float | None, Any]:
    """``(forward, gather_s, release)`` for replaying ``layer``.

    An FSDP2 layer is unsharded through its public ``unshard()`` (timed: the
    parameter all-gather is the layer's communication) and its ORIGINAL class's
    ``forward`` is called directly, so FSDP's own hooks, and with them its
    reduce-scatter into the live sharded gradients, never run for the replay.
    ``release`` reshards. Other layers are called as they are. The memory the
    unshard needs was probed in ``scratch`` (see :mod:`scout_core.replay.scratch`)
    and is released to it here. ``gather``: a framework's own way to make a layer whole outside FSDP2
    (:attr:`scout_core.adapter.FrameworkAdapter.gather_layer`), which returns ``(forward, release)``.
    """
    if scratch is not None:
        scratch.headroom = None  # freed into the caching allocator, where the all-gather finds it
    if gather is not None and not fsdp_module(layer) and not (owner is not None and fsdp_module(owner)):
        forward, release = gather(layer)
        return forward, None, release
    if fsdp_module(layer):
        params = list(layer.parameters())
        sync(params)
        # Start together, or one late rank's earlier delay shows up as this gather's time. The barrier is on
        # the all-gather's own group: other peer groups (pipeline stages) replay other modules meanwhile.
        dist.barrier(group=_gather_group(layer))
        start = time.perf_counter()
        layer.unshard()
        sync(list(layer.parameters()))
        gather_s = time.perf_counter() - start
        from torch.distributed.fsdp import FSDPModule

        cls = next(c for c in type(layer).__mro__[1:] if not issubclass(c, FSDPModule))
        _say_hooks_skipped(layer)
        return cls.forward.__get__(layer), gather_s, layer.reshard
    if owner is not None and fsdp_module(owner):
        # A boundary module (embedding, LM head) or a block's part whose parameters the enclosing FSDP module
        # manages; its own parameters name the group (the owner may also hold experts sharded elsewhere).
        dist.barrier(group=_gather_group(layer) or _gather_group(owner))
        start = time.perf_counter()
        owner.unshard()
        sync(list(layer.parameters()))
        return layer, time.perf_counter() - start, owner.reshard
    return layer, None, None


def release_of(layer: torch.nn.Module, owner: torch.nn.Module | None = None) -> Any:
    """The reshard that undoes :func:`materialize` (also after it failed half-way), or None."""
    if fsdp_module(layer):
        return layer.reshard
    return owner.reshard if owner is not None and fsdp_module(owner) else None


def gather_ranks(layer: torch.nn.Module, owner: torch.nn.Module | None = None) -> tuple[int, ...]:
    """Global ranks of the all-gather that unshards ``layer`` (or its FSDP2 ``owner``), ascending."""
    group = _gather_group(layer) if fsdp_module(layer) or owner is None else (
        _gather_group(layer) or _gather_group(owner))
    if group is None:
        return ()
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _gather_group(module: torch.nn.Module) -> Any:
    """The process group FSDP2 all-gathers ``module``'s parameters over (its mesh's shard dimension); its own,
    not a nested FSDP module's (a block's experts are sharded over a mesh of their own)."""
    for p in (managed_parameters(module) if fsdp_module(module) else module.parameters()):
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None:
            continue
        if mesh.ndim == 1:
            return mesh.get_group()
        return mesh.get_group(next(d for d, pl in enumerate(placements) if pl.is_shard()))
    return None


@dataclass
class LayerReplay:
    """What one replay of a sampled layer produced on this rank."""

    surfaces: list[tuple[str, Any]]
    """Signed surfaces (name, (signatures, non-finite count)), compared across peers."""
    compute_s: float
    """The fastest variant's compute time on the device's own clock (:class:`ComputeClock`)."""
    reproducible: bool | None = None
    """Whether the first variant, replayed twice here, signed the same both times (None: not vetted)."""


class ComputeClock:
    """Compute time on the device's own clock, not wall time: on a CUDA device the time between two events
    on its stream; on the host this thread's CPU time, which a busy machine's scheduler cannot inflate (a
    rank descheduled for 10 ms has not computed for 10 ms). Host replays run on one thread (replay_layer),
    so this thread's time is all of it. On a GPU the events also count the device idling while a late host
    launches kernels: a small, launch-bound layer on a rank whose host is busier (a background thread
    holding the GIL) looks slower (docs/replay.md, known limits)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def __enter__(self) -> ComputeClock:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._start = time.thread_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self._events[1].record()
            torch.cuda.synchronize(self.device)
            self.elapsed = self._events[0].elapsed_time(self._events[1]) / 1000.0
        else:
            self.elapsed = time.thread_time() - self._start


def replay_layer(forward: Any, layer: torch.nn.Module, name: str, call: ShippedCall, *,
                 variants: Sequence[float], providers: Mapping[str, RngProvider], deterministic: bool,
                 compare_param_state: bool, vet: bool = False, param_grads: bool = True,
                 compare_extra_state: bool = True) -> LayerReplay:
    """Forward and backward of ``layer`` on the shipped call, per input variant: signed surfaces and the
    compute time (the fastest variant's). ``vet``: replay the first variant twice and say whether it
    signed the same (replay assumes bitwise determinism; a rank where it does not hold is not evidence).

    Gradients are computed functionally (``torch.autograd.grad`` on clones), never
    into ``.grad``; each output tensor that needs a gradient gets the one the source
    saw in training (a ones tensor where none arrived, identically on every peer).
    Each variant's outputs and gradients are signed as soon as they exist and then dropped: the check
    holds one variant's tensors at a time, not all of them until the end. ``param_grads`` False: the weight
    gradients are not signed (a framework that accumulates them straight into its own buffers inside the
    backward hands autograd a placeholder instead). The parameter state includes the layer's modules' extra state
    (Transformer Engine's FP8 scaling state, :mod:`scout_core.extra_state`) unless ``compare_extra_state`` is False
    (a framework that scales FP8 by each rank's own amax: it differs among peers with nothing wrong).
    """
    received = [*call.tensors, *call.grad_outputs.values()]
    surfaces: list[tuple[str, Any]] = [
        ("replay.inputs", (tuple(s.signature for s in sign_many(received)), rng_fingerprint(call.rng)))]
    trained = [p for p in layer.parameters() if p.requires_grad]
    params = trained if param_grads else []  # the parameters whose gradients are taken and signed
    device = trained[0].device if trained else device_of(layer)
    times = []
    reproducible: bool | None = None
    # Running statistics (BatchNorm), counters and caches are training state: replay in train mode would
    # advance them once per run, so they are put back exactly as they were (also between vetting runs).
    saved_buffers = [(b, b.detach().clone()) for b in layer.buffers()]
    # So is a module's extra state: a forward under FP8 rolls Transformer Engine's amax history.
    saved_extra = capture_extra_states(layer)

    def restore_buffers() -> None:
        with torch.no_grad():
            for b, saved in saved_buffers:
                b.copy_(saved)
        if saved_extra:
            restore_extra_states(layer, saved_extra, from_outside=False)  # its own state of a moment ago

    # On the host, one thread: this thread's CPU time is then all of the replay's compute (intra-op helper
    # threads would be invisible to it), and a reduction's order cannot depend on a rank's thread count.
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads != 1:
        torch.set_num_threads(1)
    try:
        for k, v in enumerate(variants):
            signed, t = _replay_once(forward, params, call, v, providers, deterministic, name, device)
            if vet and k == 0:
                restore_buffers()
                again, t_again = _replay_once(forward, params, call, v, providers, deterministic, name, device)
                reproducible, t = again == signed, min(t, t_again)
            surfaces += signed
            times.append(t)
    finally:
        restore_buffers()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    if compare_param_state:
        state = [p.detach() for p in trained] + [b for b in layer.buffers() if b.is_floating_point()]
        if compare_extra_state:
            state += extra_state_tensors(saved_extra)  # as of training, before the replay touched it
        surfaces += _signed([(f"{name}.param_state", state)])
    # The variants are the same work at different scales, so the fastest of them is the compute time:
    # a slow device is slow in every variant, a hiccup delays one of them.
    return LayerReplay(surfaces, min(times), reproducible)


def _replay_once(forward: Any, params: list[torch.Tensor], call: ShippedCall, v: float,
                 providers: Mapping[str, RngProvider], deterministic: bool, name: str,
                 device: torch.device) -> tuple[list[tuple[str, Any]], float]:
    """One variant: forward and gradients under the source's RNG, signed at once; (surfaces, compute s)."""
    with replay_rng_scope(call.rng, providers, deterministic=deterministic):
        inputs = []
        for t, needs_grad in zip(call.tensors, call.requires_grad, strict=True):
            x = t.detach().clone()
            if v != 1.0 and x.is_floating_point():
                x.mul_(v)
            inputs.append(x.requires_grad_(needs_grad and x.is_floating_point()))
        args, kwargs = rebuild(call.spec, inputs)
        with ComputeClock(device) as clock:
            outs = tensor_leaves(forward(*args, **kwargs))
            wrt = [x for x in inputs if x.requires_grad] + params
            live = [(i, o) for i, o in enumerate(outs) if o.requires_grad]
            grads: Sequence[torch.Tensor | None] = ()
            if live and wrt:
                grad_outs = [_grad_for(call.grad_outputs.get(i), o) for i, o in live]
                grads = torch.autograd.grad([o for _, o in live], wrt, grad_outputs=grad_outs, allow_unused=True)
    tag = f"{name}.x{v:g}"
    n_in = len(wrt) - len(params)
    to_sign: list[tuple[str, list[torch.Tensor]]] = []
    if outs:
        to_sign.append((f"{tag}.output", [o.detach() for o in outs]))
    in_grads = [g for g in grads[:n_in] if g is not None]
    if in_grads:
        to_sign.append((f"{tag}.grad_input", in_grads))
    p_grads = [g for g in grads[n_in:] if g is not None]
    if p_grads:
        to_sign.append((f"{tag}.grad_param", p_grads))
    return _signed(to_sign), clock.elapsed


def _grad_for(saved: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    if saved is not None and saved.shape == out.shape and saved.dtype == out.dtype:
        return saved
    return torch.ones_like(out)


def _signed(groups: list[tuple[str, list[torch.Tensor]]]) -> list[tuple[str, Any]]:
    """One signature per tensor, all in one transfer; a surface's evidence is the tuple of its tensors'."""
    flat = [t for _, ts in groups for t in ts]
    signed = iter(sign_many(flat))
    out = []
    for name, ts in groups:
        sigs = [next(signed) for _ in ts]
        out.append((name, (tuple(s.signature for s in sigs), sum(s.nonfinite for s in sigs))))
    return out


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module computes: its first parameter's (or buffer's) device, else the host."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def sync(params: Sequence[torch.Tensor]) -> None:
    if params and params[0].is_cuda:
        torch.cuda.synchronize(params[0].device)
