"""DeepSpeed's MoE layers under SCOUT: ``deepspeed.moe.layer.MoE`` recognised, its experts bound to scout_core's
expert recipe.

* Each local expert (``moe.deepspeed_moe.experts.deepspeed_experts``) is checked on its own by the expert recipe
  (:class:`scout_core.moe.binding.MoEBinding`), among the ranks holding it: DeepSpeed's expert-data-parallel group
  of the layer's ``ep_size`` (the same EP position in every replica; without expert parallelism, every
  data-parallel rank), on the rows it received in training.
* DeepSpeed's dispatch pads every expert's rows to a capacity and exchanges equal blocks with an AllToAll, so
  there are no variable split sizes to replay it from: under expert parallelism the experts are checked and the
  token exchange is not replayed (a warning says so).
* The dense recipe replays a block holding an MoE layer by its largest part without one (the attention) and by
  the layer's gate (``TopKGate``: a linear router and top-k gating, its random token selection under the
  source's RNG): a whole block replayed on one input would run the experts too, whose capture hooks must see
  training's rows only, and under expert parallelism would differ on every rank with nothing wrong.
* DeepSpeed 0.19 refuses its native MoE under ZeRO-3 (it points to AutoEP, whose layers are not recognised here
  yet).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from scout_core.groups import gathered_groups
from scout_core.moe.binding import MoEBinding

__all__ = ["dense_parts", "moe_binding", "moe_layers"]

log = logging.getLogger("scout_deepspeed")


def moe_layers(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """DeepSpeed's ``MoE`` modules in ``model``, with their names."""
    from deepspeed.moe.layer import MoE

    found = [(m, n) for n, m in model.named_modules() if isinstance(m, MoE)]
    return [m for m, _ in found], [n for _, n in found]


def _local_experts(layer: nn.Module) -> list[nn.Module]:
    return list(layer.deepspeed_moe.experts.deepspeed_experts)


def moe_binding(model: nn.Module) -> MoEBinding | None:
    """The expert recipe's binding of DeepSpeed's MoE layers, or None (no MoE layer, or a layout not bound). Every
    rank calls it and decides alike (one gather of each rank's layout before any other collective)."""
    from deepspeed.utils import groups

    layers, names = moe_layers(model)
    sizes = sorted({int(m.ep_size) for m in layers})
    mine = [bool(layers), len(sizes) <= 1]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    everywhere, one_size = all(f[0] for f in everyone), all(f[1] for f in everyone)
    if not everywhere:
        if layers:
            log.warning("scout_deepspeed: some ranks hold no MoE layer: DeepSpeed's experts are not bound to SCOUT's "
                        "expert recipe")
        return None
    if not one_size:
        log.warning("scout_deepspeed: MoE layers of several expert-parallel sizes (%s) are not bound to SCOUT's "
                    "expert recipe yet", sizes)
        return None
    name = layers[0].expert_group_name
    ep_group = groups._get_expert_parallel_group(name)
    if layers[0].ep_size > 1:
        log.warning("scout_deepspeed: expert parallelism %d: experts are checked among their replicas; DeepSpeed's "
                    "capacity-padded AllToAll is not replayed", layers[0].ep_size)
    first = _local_experts(layers[0])[0]
    width = next((int(m.in_features) for m in first.modules() if isinstance(m, nn.Linear)), None)
    return MoEBinding(
        layers=layers, names=names, experts=_local_experts,
        expert_peer_groups=gathered_groups(groups._get_expert_data_parallel_group(name)),
        ep_position=dist.get_rank(group=ep_group) if layers[0].ep_size > 1 else 0,
        hidden_size=width or int(layers[0].deepspeed_moe.gate.wg.in_features))


def dense_parts(layers: list[nn.Module], names: list[str], *, bound: bool) -> tuple[list[nn.Module], list[str]]:
    """The modules the dense recipe replays: every repeated block, except that a block holding an MoE layer is
    replayed by its largest part without one (found by structure: the attention in common models) and by the MoE
    layers' gates (see the module's docstring)."""
    from deepspeed.moe.layer import MoE

    def has_moe(module: nn.Module) -> bool:
        return any(isinstance(m, MoE) for m in module.modules())

    kept: list[tuple[nn.Module, str]] = []
    replaced = 0
    for layer, name in zip(layers, names):
        if not has_moe(layer):
            kept.append((layer, name))
            continue
        replaced += 1
        parts = [(sum(p.numel() for p in child.parameters()), child_name, child)
                 for child_name, child in layer.named_children() if not has_moe(child)]
        parts = [p for p in parts if p[0] > 0]
        if parts:
            _, child_name, child = max(parts, key=lambda p: p[0])
            kept.append((child, f"{name}.{child_name}"))
        kept += [(m.deepspeed_moe.gate, ".".join(filter(None, (name, n, "deepspeed_moe.gate"))))
                 for n, m in layer.named_modules() if isinstance(m, MoE)]
    if replaced:
        log.warning("scout_deepspeed: %d MoE block(s) replay by their dense part and gate in the dense recipe (their "
                    "experts: %s)", replaced, "the expert recipe" if bound else "not checked in this layout")
    return [m for m, _ in kept], [n for _, n in kept]
