"""Memory for a check's collectives, taken before the ranks agree to run them.

A replay check runs collectives that allocate: FSDP2's unshard (the layer's
full parameters), the scratch all-reduce that times a training-shaped gradient
exchange, HSDP's reduce-scatter and replica all-reduce. If one rank ran out of
memory inside such a collective, it would raise while its peers wait in the
same collective forever. So every allocation a check's collectives need is made
first, as local work under the :class:`~scout_core.replay.guard.DiagnosisGuard`,
and only then do the ranks agree to go on: an out-of-memory error becomes a
check skipped on every rank with a ``diagnosis_error`` record.

The unshard's memory cannot be handed to FSDP, so it is probed: a block of the
unsharded size is allocated and held until just before ``unshard()``, whose
all-gather buffer the caching allocator then serves from the freed block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Scratch", "compute_device", "fsdp_module", "fsdp_owners", "managed_parameters", "module_compute_device",
           "reserve", "unshard_bytes"]


@dataclass
class Scratch:
    """What one replayed layer's collectives will use, allocated up front."""

    headroom: torch.Tensor | None = None
    """Held until the unshard (then freed for it): as many bytes as the layer's unsharded parameters."""
    all_reduce: torch.Tensor | None = None
    """The timed training-shaped all-reduce's buffer (layers without an FSDP all-gather to time)."""
    hsdp: tuple[torch.Tensor, torch.Tensor] | None = None
    """HSDP: the reduce-scatter's full input and its per-shard output (the replica all-reduce reuses it)."""


def fsdp_module(module: torch.nn.Module | None) -> bool:
    """True for a module ``fully_shard`` manages (it unshards through its public ``unshard()``)."""
    if module is None:
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def fsdp_owners(modules: list[torch.nn.Module], roots: list[torch.nn.Module]) -> list[torch.nn.Module | None]:
    """For each of ``modules``, the innermost FSDP2 module around it inside ``roots``, or None (it unshards
    itself, or nothing shards it). A repeated layer given as part of a ``fully_shard``-ed block (the attention
    of a block whose experts cannot be replayed with it) is unsharded through that block."""
    name_of: dict[int, tuple[str, dict[str, torch.nn.Module]]] = {}
    for root in roots:  # one walk per root, however many layers
        by_name = dict(root.named_modules())
        for name, m in by_name.items():
            name_of.setdefault(id(m), (name, by_name))
    owners: list[torch.nn.Module | None] = []
    for module in modules:
        owner = None
        if not fsdp_module(module) and id(module) in name_of:
            name, by_name = name_of[id(module)]
            parts = name.split(".") if name else []
            for k in range(len(parts) - 1, -1, -1):  # longest enclosing prefix first: the innermost
                outer = by_name.get(".".join(parts[:k]))
                if fsdp_module(outer):
                    owner = outer
                    break
        owners.append(owner)
    return owners


def managed_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``module``'s own ``unshard()`` gathers: not those of nested FSDP modules (the root
    of a model manages only the embedding, final norm and head; its blocks gather their own)."""
    nested = {id(p) for m in module.modules() if m is not module and fsdp_module(m) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def compute_device(local: torch.Tensor) -> torch.device:
    """Where a module whose parameter is ``local`` computes: the accelerator even when its shard is offloaded
    to the host (CPU-offloaded FSDP), else the tensor's own device."""
    if local.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return local.device


def module_compute_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes (see :func:`compute_device`); the host for a module without parameters."""
    local = _first_local(module)
    return compute_device(local) if local is not None else torch.device("cpu")


def _first_local(layer: torch.nn.Module) -> torch.Tensor | None:
    for p in layer.parameters():
        return p.to_local() if hasattr(p, "to_local") else p
    return None


def unshard_bytes(layer: torch.nn.Module, owner: torch.nn.Module | None) -> int:
    """Device bytes the unshard before replaying ``layer`` needs at its peak (0: no unshard).

    A DTensor's numel is its global size. The unshard allocates the all-gather output and then copies each
    parameter out of it: about twice the unsharded bytes (counted in the shards' dtype, so a bf16 gather of
    fp32 shards is over-counted twofold: the probe errs on the side of skipping a check).
    """
    gathered = layer if fsdp_module(layer) else (owner if fsdp_module(owner) else None)
    if gathered is None:
        return 0
    return 2 * sum(_gathered_numel(p) * p.element_size() for p in managed_parameters(gathered))


def _gathered_numel(param: torch.Tensor) -> int:
    """Elements FSDP2's all-gather yields for ``param``: its local shard times the size of the mesh dimension
    FSDP shards it over (the first sharded one: FSDP's dimension is outermost, before TP or EP). A DTensor's
    ``numel()`` is its global size, which for an expert-parallel weight counts every EP position's experts."""
    spec = getattr(param, "_spec", None)
    if spec is None:
        return param.numel()
    local = param.to_local().numel()  # type: ignore[attr-defined]
    dims = [d for d, pl in enumerate(spec.placements) if pl.is_shard()]
    return local * (spec.mesh.size(dims[0]) if dims else 1)


def reserve(layer: torch.nn.Module, owner: torch.nn.Module | None, *, time_all_reduce: bool,
            hsdp_groups: tuple[object, object] | None, headroom_bytes: int = 0) -> Scratch:
    """Allocate what replaying ``layer`` will need in its collectives (see the module docstring).

    ``headroom_bytes``: the unshard probe. The recipes of one check replay one after another, each
    resharding before the next unshards, so the check probes once, for the largest of them."""
    scratch = Scratch()
    local = _first_local(layer)
    if local is None:
        return scratch
    if headroom_bytes:
        scratch.headroom = torch.empty(headroom_bytes, dtype=torch.uint8, device=compute_device(local))
    if time_all_reduce:
        params = [p for p in layer.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params) or 1
        scratch.all_reduce = torch.zeros(numel, dtype=local.dtype, device=local.device)
    if hsdp_groups is not None:
        n_shards = dist.get_world_size(hsdp_groups[0])
        per_shard = -(-sum(p.numel() for p in layer.parameters()) // n_shards)
        scratch.hsdp = (torch.zeros(per_shard * n_shards, dtype=local.dtype, device=local.device),
                        torch.zeros(per_shard, dtype=local.dtype, device=local.device))
    return scratch
