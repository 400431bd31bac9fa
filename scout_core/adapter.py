"""What a framework hands the core: the one interface every plugin implements.

:class:`FrameworkAdapter` carries the objects SCOUT attaches to: model chunks
(pipeline stages), the inner torch optimizers that actually step (their step
hooks are the replay and snapshot boundary), the peer layout (a DeviceMesh or
explicit peer groups), the repeated layers plus embedding and output modules
that replay samples, extra RNG streams to align during replay, and caller
state (LR scheduler, data-loader position, gradient scaler) that a bitwise
resume must restore.

:func:`torch_adapter` is the plain-PyTorch adapter (DDP, FSDP2, HSDP): it
unwraps ``DistributedDataParallel``, finds the inner optimizers inside common
wrappers, discovers repeated blocks (children of ``nn.ModuleList``s) and the
embedding and output modules by the names popular model libraries use. A
framework plugin builds its own adapter from its framework's objects and calls
:func:`scout_core.runtime.enable_with`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scout_core.replay.rng import RngProvider

_log = logging.getLogger("scout")

__all__ = ["FrameworkAdapter", "dense_part", "find_inner_optimizers", "stateful_state", "torch_adapter"]

EMBEDDING_NAMES = ("embed_tokens", "tok_embeddings", "wte", "word_embeddings", "embedding", "embed", "embeddings")
"""Attribute names of the token embedding in popular model libraries (HF, TorchTitan, Megatron)."""
OUTPUT_NAMES = ("lm_head", "output_layer", "output", "head")
"""Attribute names of the language-model output layer."""


@dataclass(kw_only=True)
class FrameworkAdapter:
    """Everything SCOUT needs from a training framework."""

    chunks: list[nn.Module]
    """Model chunks (one per virtual pipeline stage), as the framework wraps them."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    """Inner torch optimizers, in the order they step; the boundary is the LAST one's step."""
    mesh: Any = None
    """A DeviceMesh with named dimensions (peer groups derive from it), or None."""
    peer_groups: list[list[int]] | None = None
    """Explicit equivalent-peer groups (a partition of the ranks), or None."""
    replica_groups: list[list[int]] | None = None
    """Unions of peer groups whose replays of a hidden layer give equal outputs although their members hold
    different parameter shards (Megatron's tensor-parallel partners without sequence parallelism: the layer's
    all-reduced output is replicated across them). A partition of the ranks, or None. Where a peer group has
    no strict majority on a hidden layer's output (two data-parallel replicas), the replica group's majority
    names the rank."""
    replicated_parameters: Callable[[nn.Module], list[torch.Tensor]] | None = None
    """The parameters of a layer that replica-group members hold as copies rather than shards (Megatron: those
    without ``tensor_model_parallel``). The replica comparison stands only while they are equal on every
    member; None: all of them are assumed equal."""
    compare_optimizer_slices: bool | None = None
    """Whether peers' optimizer updates are comparable (False where each peer's optimizer holds another shard
    of the state: Megatron's distributed optimizer); None: judged from the parameters (sharded DTensors)."""
    compare_param_grads: bool = True
    """Whether a replayed layer's weight gradients are signed (False where the framework accumulates them into
    its own buffers inside the backward and hands autograd a placeholder: Megatron's gradient-accumulation
    fusion)."""
    compare_extra_state: bool = True
    """Whether the modules' extra state (``get_extra_state``: Transformer Engine's FP8 scaling state) is compared
    among peers with the parameter state (False where each rank scales FP8 by its own amax: Megatron's
    ``--tp-only-amax-red``). It is kept in snapshots and put back after replays either way."""
    replay_pairs_across_groups: bool = False
    """A replayed layer runs collectives with ranks of other peer groups (tensor or context parallelism: the
    partners replay the same layer together): every peer group must then replay as many times as every other,
    so determinism vetting is agreed job-wide."""
    step_owner: Any = None
    """An object whose ``step()`` ends the training step after the inner optimizers stepped (Megatron's
    ``MegatronOptimizer``, which then copies and gathers the updated parameters): SCOUT's boundary follows it
    instead of the last inner optimizer's step. None: the last inner optimizer's step."""
    replay_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    """Entered around each check: what the framework switches off while SCOUT calls its layers outside
    training (Megatron's parameter all-gather pre-hooks under ``--overlap-param-gather``)."""
    gather_layer: Callable[[nn.Module], tuple[Callable[..., Any], Callable[[], None]]] | None = None
    """For parameters a framework shards at rest outside FSDP2 (DeepSpeed ZeRO-3): makes a replayed layer's
    parameters whole and returns ``(forward, release)``, the callable replay runs the layer through (without the
    framework's own hooks, which would fetch, release or reduce into the live training state) and what undoes
    it. Every rank of the layer's gather group calls it for the same layer at the same check, so it may be a
    collective. On a failure it undoes what it did before raising. None: layers are called as they are."""
    gather_bytes: Callable[[nn.Module], int] | None = None
    """Device bytes ``gather_layer`` allocates for a layer: probed before any rank joins the gather, so a rank
    without the memory skips the check together with its peers rather than failing alone before the collective.
    None: no probe."""
    layers: list[nn.Module] | None = None
    """Repeated layers for hang marks and hidden-layer replay; None = discovered."""
    layer_names: list[str] | None = None
    marked_layers: list[nn.Module] | None = None
    """Modules whose forward and backward mark progress for the hang path, when they are not ``layers`` (the
    replay samples a block's part, but a hang is placed by the block); None = the repeated layers."""
    embedding: nn.Module | None = None
    output: nn.Module | None = None
    boundary_owner: nn.Module | None = None
    """The FSDP2 module that owns embedding and output parameters (unsharded for their replay)."""
    rng_providers: dict[str, RngProvider] = field(default_factory=dict)
    """Extra RNG streams (e.g. a tensor-parallel RNG tracker): get and set a state tensor."""
    get_state: Callable[[], dict[str, Any]] | None = None
    """Caller state for snapshots (LR scheduler, data position, scaler)."""
    set_state: Callable[[dict[str, Any]], None] | None = None
    name: str = "torch"
    """Which adapter built this (shown in records and errors)."""
    moe: Any = None
    """A :class:`scout_core.moe.replay.MoEBinding` (MoE layers and the groups holding the same experts), or
    None: the expert recipe runs only with one."""
    pinned: dict[str, str] = field(default_factory=dict)
    """Live configuration keys the adapter fixed at attach, and why (``scout ctl set`` refuses them): e.g. the
    optimizer check turned off for an optimizer replay cannot reproduce."""

    def __post_init__(self) -> None:
        if not self.chunks or not all(isinstance(c, nn.Module) for c in self.chunks):
            raise TypeError("model must be an nn.Module or a list of nn.Module chunks")
        if not all(isinstance(o, torch.optim.Optimizer) for o in self.optimizers):
            raise TypeError("optimizers must be torch.optim.Optimizer instances (use find_inner_optimizers)")
        if (self.get_state is None) != (self.set_state is None):
            raise ValueError("give both get_state and set_state, or neither")

    def repeated_layers(self) -> list[nn.Module]:
        if self.layers is not None:
            return list(self.layers)
        return discover_layers(self.chunks)[0]


def _unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside DDP (FSDP2 keeps the model's own class)."""
    while isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    return module


def dense_part(block: nn.Module, has_moe: Callable[[nn.Module], bool]) -> tuple[str, nn.Module] | None:
    """The part of an MoE block the dense recipe replays in its place: its child without an MoE layer that holds
    the most parameters (the attention in common models, found by structure, not by name; the norms beside it are
    tiny), as ``(child name, child)``; None when no such child holds parameters."""
    parts = [(sum(p.numel() for p in child.parameters()), child_name, child)
             for child_name, child in block.named_children() if not has_moe(child)]
    parts = [p for p in parts if p[0] > 0]
    if not parts:
        return None
    _, child_name, child = max(parts, key=lambda p: p[0])
    return child_name, child


def discover_layers(chunks: Iterable[nn.Module]) -> tuple[list[nn.Module], list[str]]:
    """Repeated blocks (children of every ``nn.ModuleList``, and of every ``nn.ModuleDict`` whose children
    share one class, as TorchTitan keeps its blocks; outermost containers only) and their names.

    Nested lists (MoE experts inside a block) are not separate layers: the block
    that contains them is. A model without such a container is replayed whole, with a warning: pass
    ``layers=`` to ``enable()`` to name its blocks.
    """
    layers, names = [], []
    for ci, chunk in enumerate(chunks):
        inner = _unwrap(chunk)
        found = []
        taken: set[int] = set()
        for name, m in inner.named_modules():
            if _holds_blocks(m) and not any(name.startswith(p) for p in _prefixes(found)):
                for child_name, child in m.named_children():
                    if id(child) not in taken:
                        taken.add(id(child))
                        found.append((f"{name}.{child_name}", child))
        prefix = f"chunk{ci}." if ci else ""
        if not found:
            _log.warning("SCOUT: no nn.ModuleList or nn.ModuleDict of repeated blocks in %s; replay samples the "
                         "whole model chunk (pass layers=... to enable() to name its blocks)", type(inner).__name__)
            found = [("", inner)]
        layers += [m for _, m in found]
        names += [f"{prefix}{n}" if n else f"{prefix}model" for n, _ in found]
    return layers, names


def _holds_blocks(m: nn.Module) -> bool:
    """A container of repeated blocks: any ``ModuleList``; a ``ModuleDict`` only when its children share one
    class (nanoGPT's ``transformer`` dict holds the embedding, the block list and the norm: not blocks)."""
    if isinstance(m, nn.ModuleList):
        return True
    if isinstance(m, nn.ModuleDict):
        kinds = {type(c) for c in m.children()}
        return len(kinds) == 1 and len(m) > 1
    return False


def _prefixes(found: list[tuple[str, nn.Module]]) -> list[str]:
    return [n + "." for n, _ in found]


def _named_child(module: nn.Module, names: Sequence[str]) -> nn.Module | None:
    """The first direct child with one of ``names`` that is a single layer (not a container of blocks)."""
    for n in names:
        child = getattr(module, n, None)
        if isinstance(child, nn.Module) and not isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return child
    return None


def _bodies(module: nn.Module) -> list[nn.Module]:
    return [module] + [getattr(module, n) for n in ("model", "transformer") if isinstance(getattr(module, n, None),
                                                                                       nn.Module)]


def _declared(module: nn.Module, method: str) -> nn.Module | None:
    """The module a model declares through ``method`` (transformers' ``get_input_embeddings`` and
    ``get_output_embeddings``: a BERT-style model's embedding under ``.bert``, its head under ``.cls``), or None."""
    get = getattr(module, method, None)
    if not callable(get):
        return None
    try:
        found = get()
    except Exception:  # noqa: BLE001 - a model that does not implement it (NotImplementedError, AttributeError)
        return None
    return found if isinstance(found, nn.Module) and found is not module else None


def find_inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer``: itself, or those a wrapper holds.

    Understands lists, and wrappers that keep their inner optimizers in
    ``optimizer`` / ``optimizers`` / ``chained_optimizers`` (Megatron, DeepSpeed,
    TorchTitan containers). Raises when nothing inside is a torch optimizer.
    """
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        # Accelerate's AcceleratedOptimizer is an Optimizer around one (an attribute of the instance, never a
        # property that may refuse: Megatron's ChainedOptimizer raises on .optimizer): the inner one steps.
        inner = vars(optimizer).get("optimizer")
        if not isinstance(inner, torch.optim.Optimizer):
            return [optimizer]
        return find_inner_optimizers(inner)
    if isinstance(optimizer, (list, tuple)):
        return [o for item in optimizer for o in find_inner_optimizers(item)]
    for attr in ("chained_optimizers", "optimizers", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if inner is not None and inner is not optimizer:
            try:
                return find_inner_optimizers(inner)
            except TypeError:
                continue
    raise TypeError(f"no torch.optim.Optimizer found inside {type(optimizer).__name__}")


def stateful_state(objects: Mapping[str, Any]) -> tuple[Callable[[], dict[str, Any]],
                                                          Callable[[dict[str, Any]], None]]:
    """(get, set) over objects with ``state_dict``/``load_state_dict`` (LR scheduler, GradScaler, a
    stateful data loader), or plain ``(get, set)`` pairs of callables."""
    for name, obj in objects.items():
        ok = (isinstance(obj, tuple) and len(obj) == 2 and all(map(callable, obj))) or (
            hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))
        if not ok:
            raise TypeError(f"state[{name!r}] needs state_dict()/load_state_dict() or a (get, set) pair")

    def get() -> dict[str, Any]:
        return {n: (o[0]() if isinstance(o, tuple) else o.state_dict()) for n, o in objects.items()}

    def set_(saved: dict[str, Any]) -> None:
        for n, o in objects.items():
            if n in saved:
                o[1](saved[n]) if isinstance(o, tuple) else o.load_state_dict(saved[n])

    return get, set_


def torch_adapter(
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any = None,
    *,
    mesh: Any = None,
    peer_groups: Sequence[Sequence[int]] | None = None,
    layers: Iterable[nn.Module] | None = None,
    embedding: nn.Module | None = None,
    output: nn.Module | None = None,
    rng_providers: Mapping[str, RngProvider] | None = None,
    state: Mapping[str, Any] | None = None,
    moe: Any = None,
) -> FrameworkAdapter:
    """The plain-PyTorch adapter: a module (DDP, FSDP2, HSDP or bare) or a list of chunks."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    inner = [_unwrap(c) for c in chunks]
    if layers is None:  # found by structure (warns where none are: pass layers=)
        found_layers, names = discover_layers(chunks)
    else:  # named by their place in the model (``layers.0.moe.router``) where found there
        found_layers = list(layers)
        where = {id(m): n for c in inner for n, m in c.named_modules()}
        names = [where[id(m)] for m in found_layers] if all(id(m) in where for m in found_layers) else None
    if embedding is None:  # HF keeps the body under .model / .transformer
        embedding = next((e for m in _bodies(inner[0]) if (e := _named_child(m, EMBEDDING_NAMES))), None)
    if embedding is None:
        embedding = _declared(inner[0], "get_input_embeddings")
    if output is None:
        output = _named_child(inner[-1], OUTPUT_NAMES)
    if output is None:
        output = _declared(inner[-1], "get_output_embeddings")
    owner = None
    try:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(chunks[0], FSDPModule):
            owner = chunks[0]
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    get_state = set_state = None
    if state:
        get_state, set_state = stateful_state(state)
    return FrameworkAdapter(
        chunks=chunks, optimizers=find_inner_optimizers(optimizer), mesh=mesh,
        peer_groups=[list(map(int, g)) for g in peer_groups] if peer_groups is not None else None,
        layers=found_layers, layer_names=names, embedding=embedding, output=output, boundary_owner=owner,
        rng_providers=dict(rng_providers or {}), get_state=get_state, set_state=set_state, moe=moe,
    )
