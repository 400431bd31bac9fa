"""Megatron-Core's MoE layers under SCOUT: ``MoELayer`` recognised, its experts bound to scout_core's expert recipe.

* Without expert parallelism every data-parallel rank holds every expert: each expert is checked on its own by
  the expert recipe (:class:`scout_core.moe.binding.MoEBinding`), among the ranks holding it (Megatron's
  expert-data-parallel group), on the rows it received in training; the dense recipe replays such a layer's
  attention (``self_attention``). The router and the layer norms are not replayed.
* With expert parallelism each EP position holds other experts and the layer exchanges tokens with an AllToAll:
  a whole layer replayed on one shared input would differ on every rank with nothing wrong. The dense recipe then
  replays such a layer's attention (``self_attention``) only, and the experts are not bound yet (a warning says
  so, the same on every rank).
* Experts are bound where Megatron runs them one by one (``SequentialMLP``, ``--moe-grouped-gemm`` off); grouped
  GEMM experts (``GroupedMLP``, ``TEGroupedMLP``) are not bound yet.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from scout_core.moe.binding import MoEBinding

__all__ = ["dense_parts", "moe_binding", "moe_layers"]

log = logging.getLogger("scout_megatron")


def moe_layers(inner: list[nn.Module]) -> tuple[list[nn.Module], list[str]]:
    """Megatron's ``MoELayer`` modules in the unwrapped model chunks, with their names."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    found = [(m, f"chunk{i}.{n}" if i else n) for i, chunk in enumerate(inner) for n, m in chunk.named_modules()
             if isinstance(m, MoELayer)]
    return [m for m, _ in found], [n for _, n in found]


def _expert_peers() -> list[list[int]]:
    from megatron.core import parallel_state

    mine = sorted(dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [list(g) for g in sorted({tuple(g) for g in everyone})]


def moe_binding(inner: list[nn.Module]) -> MoEBinding | None:
    """The expert recipe's binding of Megatron's MoE layers, or None (no MoE layer, or a layout not bound yet).
    Every rank calls it and decides alike (the layout is the same everywhere)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP

    layers, names = moe_layers(inner)
    if not layers:
        return None
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        log.warning("scout_megatron: expert parallelism: Megatron's experts are not bound to SCOUT's expert recipe "
                    "yet; MoE layers replay by their attention only")
        return None
    if not all(isinstance(m.experts, SequentialMLP) for m in layers):
        log.warning("scout_megatron: grouped-GEMM experts (%s) are not bound to SCOUT's expert recipe yet; they "
                    "are checked inside their layers' replays only", type(layers[0].experts).__name__)
        return None
    # Megatron's expert linears are its own parallel layers, not nn.Linear: the row width is the model's.
    return MoEBinding(layers=layers, names=names, experts=lambda m: m.experts.local_experts,
                      expert_peer_groups=_expert_peers(), hidden_size=int(layers[0].config.hidden_size))


def dense_parts(layers: list[nn.Module], names: list[str], *, bound: bool) -> tuple[list[nn.Module], list[str]]:
    """The repeated layers the dense recipe replays: every layer, except that a layer with an MoE MLP is replayed by
    its ``self_attention`` under expert parallelism (see the module's docstring) and where its experts are bound to
    the expert recipe (``bound``: their capture hooks must see training's rows only, and the expert recipe checks
    them)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if parallel_state.get_expert_model_parallel_world_size() <= 1 and not bound:
        return layers, names
    kept, replaced = [], 0
    for layer, name in zip(layers, names):
        if any(isinstance(m, MoELayer) for m in layer.modules()) and hasattr(layer, "self_attention"):
            kept.append((layer.self_attention, f"{name}.self_attention"))
            replaced += 1
        else:
            kept.append((layer, name))
    if replaced:
        log.warning("scout_megatron: %d MoE layer(s) replay by their attention in the dense recipe (their experts: %s)",
                    replaced, "the expert recipe" if bound else "not replayed under expert parallelism yet")
    return [m for m, _ in kept], [n for _, n in kept]
