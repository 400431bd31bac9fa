"""DeepSpeed's MoE layers under SCOUT: ``deepspeed.moe.layer.MoE`` recognised, its experts bound to scout_core's
expert recipe.

* Each local expert (``moe.deepspeed_moe.experts.deepspeed_experts``) is checked on its own by the expert recipe
  (:class:`scout_core.moe.binding.MoEBinding`), among the ranks holding it: DeepSpeed's expert-data-parallel group
  of the layer's ``ep_size`` (the same EP position in every replica; without expert parallelism, every
  data-parallel rank), on the rows it received in training.
* Under expert parallelism each expert check also replays the AllToAll with one communication plan across every
  EP group (:mod:`scout_core.moe.alltoall`). DeepSpeed pads every expert's rows to a capacity and sends each EP
  position equal blocks; the split sizes are computed from the last dispatch as its gate sizes the capacity. Not
  under ``drop_tokens=False``, where the gate agrees the capacity across the EP group (a warning says so).
* The dense recipe replays a block holding an MoE layer by its largest part without one (the attention) and by
  the layer's gate (``TopKGate``: a linear router and top-k gating, its random token selection under the
  source's RNG): a whole block replayed on one input would run the experts too, whose capture hooks must see
  training's rows only, and under expert parallelism would differ on every rank with nothing wrong.
* DeepSpeed 0.19 refuses its native MoE under ZeRO-3 (it points to AutoEP, whose layers are not recognised here
  yet).
"""

from __future__ import annotations

import logging
import math

import torch.distributed as dist
from torch import nn

from scout_core.adapter import dense_part
from scout_core.groups import gathered_groups
from scout_core.moe.binding import MoEBinding
from scout_core.wire import all_gather_data

__all__ = ["dense_parts", "moe_binding", "moe_layers"]

log = logging.getLogger("scout_deepspeed")


def moe_layers(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """DeepSpeed's ``MoE`` modules in ``model``, with their names."""
    from deepspeed.moe.layer import MoE

    found = [(m, n) for n, m in model.named_modules() if isinstance(m, MoE)]
    return [m for m, _ in found], [n for _, n in found]


def _local_experts(layer: nn.Module) -> list[nn.Module]:
    return list(layer.deepspeed_moe.experts.deepspeed_experts)


def _dispatch_splits(layer: nn.Module) -> list[int]:
    """The rows this rank sent to each EP position in the layer's last dispatch: DeepSpeed pads every expert's
    tokens to one capacity, ``max(ceil(tokens * k / experts * capacity_factor), min_capacity)`` (its gate's
    ``_capacity``; ``exp_counts`` counts tokens * k), and sends each EP position its local experts' blocks."""
    moe = layer.deepspeed_moe
    counts = getattr(moe, "exp_counts", None)
    if counts is None:
        raise RuntimeError("the MoE layer has not dispatched yet")
    gate = moe.gate
    experts = moe.num_local_experts * moe.ep_size
    capacity = max(math.ceil(int(counts.sum()) / experts * float(gate.capacity_factor)), int(gate.min_capacity))
    return [moe.num_local_experts * capacity] * moe.ep_size


def moe_binding(model: nn.Module) -> MoEBinding | None:
    """The expert recipe's binding of DeepSpeed's MoE layers, or None (no MoE layer, or a layout not bound). Every
    rank calls it and decides alike (one gather of each rank's layout before any other collective)."""
    from deepspeed.utils import groups

    layers, names = moe_layers(model)
    sizes = sorted({int(m.ep_size) for m in layers})
    mine = [bool(layers), len(sizes) <= 1]
    everyone = all_gather_data(mine, what="MoE layout")
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
    ep = int(layers[0].ep_size)
    # The AllToAll is replayed from split sizes computed as DeepSpeed's gate sizes its capacity; without dropping,
    # the capacity is agreed across the EP group inside the gate, and a split cannot be known here.
    alltoall = ep > 1 and all(getattr(m.deepspeed_moe.gate, "drop_tokens", True) for m in layers)
    if ep > 1 and not alltoall:
        log.warning("scout_deepspeed: expert parallelism %d without token dropping (drop_tokens=False): experts are "
                    "checked among their replicas; the AllToAll is not replayed", ep)
    first = _local_experts(layers[0])[0]
    width = next((int(m.in_features) for m in first.modules() if isinstance(m, nn.Linear)), None)
    return MoEBinding(
        layers=layers, names=names, experts=_local_experts,
        expert_peer_groups=gathered_groups(groups._get_expert_data_parallel_group(name)),
        ep_groups=gathered_groups(ep_group) if alltoall else None, splits=_dispatch_splits if alltoall else None,
        ep_position=dist.get_rank(group=ep_group) if ep > 1 else 0,
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
        part = dense_part(layer, has_moe)
        if part is not None:
            kept.append((part[1], f"{name}.{part[0]}"))
        kept += [(m.deepspeed_moe.gate, ".".join(filter(None, (name, n, "deepspeed_moe.gate"))))
                 for n, m in layer.named_modules() if isinstance(m, MoE)]
    if replaced:
        log.warning("scout_deepspeed: %d MoE block(s) replay by their dense part and gate in the dense recipe (their "
                    "experts: %s)", replaced, "the expert recipe" if bound else "not checked in this layout")
    return [m for m, _ in kept], [n for _, n in kept]
