"""TorchTitan's MoE experts under scout_core's expert recipe (paper section 6.2), with expert parallelism.

TorchTitan keeps an MoE layer's local experts in one :class:`GroupedExperts` module (3-D weights, one slice per
expert), called once per step with every routed row and the row count of each expert. scout_core's expert
recipe replays one expert at a time and compares it among the ranks that hold the same experts (same EP
position, other data-parallel replicas). :class:`GroupedExpertSlice` is the bridge: a view of one local expert
that runs TorchTitan's own ``GroupedExperts.forward`` with only its rows (every other expert gets none), whose
parameters are the grouped module's weights as they are registered at that moment, and whose rows come from the
grouped module's call in training.

The weights are FSDP2-sharded at rest (TorchTitan shards experts in the block's FSDP unit, over its
expert-FSDP mesh): :func:`expert_binding` gives scout_core a ``materialize`` that unshards the block for the
check, on every rank at the same check, and reshards it after.

Only expert-parallel jobs are bound (without EP every rank holds every expert, and the dense recipe replays MoE
blocks whole). The AllToAll replay is not wired (no ``ep_groups``): TorchTitan's dispatchers keep no split plan
SCOUT could read.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scout_core.moe.binding import MoEBinding
from scout_core.replay.scratch import fsdp_owners
from scout_core.signature import local_tensor
from scout_core.wire import all_gather_data

__all__ = ["GroupedExpertSlice", "expert_binding", "expert_peer_groups"]

log = logging.getLogger("scout_torchtitan")


class GroupedExpertSlice(nn.Module):
    """Local expert ``index`` of a TorchTitan ``GroupedExperts``, called on ``[rows, dim]``.

    It runs ``GroupedExperts.forward`` itself (TorchTitan's code, its ``_grouped_mm`` seam) on this expert's
    weight slices with a single group, never with empty groups for the other experts (whose gradients some
    grouped-GEMM kernels leave undefined), and its ``parameters()`` are those slices, so the replay's weight
    gradients are this expert's alone."""

    def __init__(self, grouped: nn.Module, index: int) -> None:
        super().__init__()
        self._grouped = [grouped]  # in a list: not a submodule, its weights stay the block's
        self.index = index
        self._slices: list[torch.Tensor] | None = None

    @property
    def capture_module(self) -> nn.Module:
        return self._grouped[0]

    def rows_from(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """This expert's rows in a ``GroupedExperts(x, num_tokens_per_expert)`` call."""
        x = args[0] if args else kwargs.get("x_RD")
        counts = args[1] if len(args) > 1 else kwargs.get("num_tokens_per_expert_E")
        if not isinstance(x, torch.Tensor) or not isinstance(counts, torch.Tensor):
            return None
        ends = torch.cumsum(counts.detach().to("cpu", torch.int64), dim=0)
        start = int(ends[self.index - 1]) if self.index else 0
        return x[start:int(ends[self.index])]

    def trained_parameters(self) -> list[nn.Parameter]:
        """The weights training updates (the grouped module's, shared by every local expert)."""
        g = self._grouped[0]
        return [g.w1_EFD, g.w2_EDF, g.w3_EFD]

    def parameters(self, recurse: bool = True) -> Any:  # noqa: ARG002
        """This expert's weight slices of the grouped weights as registered now (whole, during the check): the
        forward that follows computes with exactly these tensors."""
        self._slices = [local_tensor(w)[self.index:self.index + 1] for w in self.trained_parameters()]
        return iter(self._slices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self._grouped[0]
        if self._slices is None:
            self.parameters()
        w1, w2, w3 = self._slices  # type: ignore[misc]
        one = types.SimpleNamespace(w1_EFD=w1, w2_EDF=w2, w3_EFD=w3, _grouped_mm=g._grouped_mm)
        try:
            return type(g).forward(one, x, torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device))
        finally:
            self._slices = None


def expert_peer_groups(ep_mesh: Any) -> tuple[list[list[int]], list[list[int]]]:
    """``(expert peer groups, EP groups)``: the ranks at each EP position (they hold the same experts once FSDP
    gathers them), and the EP groups (the ranks one AllToAll spans), every rank's view gathered."""
    mine = (int(ep_mesh.get_local_rank()), tuple(sorted(dist.get_process_group_ranks(ep_mesh.get_group()))))
    views = all_gather_data(mine, what="expert-parallel layout")
    positions = sorted({p for p, _ in views})
    peers = [[r for r, (p, _) in enumerate(views) if p == pos] for pos in positions]
    ep_groups = sorted({g for _, g in views})
    return peers, [list(g) for g in ep_groups]


def expert_binding(trainer: Any, chunks: list[nn.Module]) -> MoEBinding | None:
    """The MoE binding of an expert-parallel TorchTitan model, or None (no EP, or no TorchTitan MoE layer)."""
    dims, cfg = trainer.parallel_dims, trainer.config
    if dims.ep <= 1:
        return None
    # Decisions every rank takes alike (from the configuration), before any collective:
    if dims.pp > 1:
        log.warning("scout_torchtitan: expert parallelism with pipeline parallelism: the experts are not replayed "
                    "(expert peers would span pipeline stages holding other layers)")
        return None
    if cfg.compile.enable and "model" in cfg.compile.components:
        log.warning("scout_torchtitan: --compile.enable compiles the blocks with fullgraph: the expert recipe's "
                    "capture hooks inside them would recompile at every check, so the experts are not replayed")
        return None
    from torchtitan.models.common.moe import GroupedExperts, MoE

    layers, names, grouped = [], [], []
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if isinstance(m, MoE):
                inner = getattr(getattr(m, "routed_experts", None), "inner_experts", None)
                if type(inner) is not GroupedExperts:  # a subclass may compute otherwise: not bound
                    log.warning("scout_torchtitan: MoE layer %s has %s experts: not replayed", name,
                                type(inner).__name__)
                    continue
                layers.append(m)
                names.append(name.replace("._checkpoint_wrapped_module", ""))
                grouped.append(inner)
    peers, _ep_groups = expert_peer_groups(dims.get_mesh("ep"))  # every rank, before deciding anything more
    smallest = min(len(g) for g in peers)
    if smallest < 2:
        log.warning("scout_torchtitan: each EP position is held by one rank only (expert parallelism %d over %d "
                    "ranks): no replica to compare an expert with, the experts are not replayed", dims.ep,
                    dist.get_world_size())
        return None
    if smallest < 3 and dist.get_rank() == 0:
        log.warning("scout_torchtitan: %d ranks hold each EP position: a corrupted expert is detected, but with "
                    "no majority the rank is not named (three or more are)", smallest)
    if not layers:
        return None
    owners = fsdp_owners(grouped, chunks)
    by_layer = {id(m): (g, o) for m, g, o in zip(layers, grouped, owners)}
    ep = trainer.parallel_dims.ep  # each EP position holds num_experts / ep of them (FSDP may split them further)
    slices = {id(m): [GroupedExpertSlice(g, i) for i in range(g.num_experts // ep)] for m, g in zip(layers, grouped)}

    def materialize(layer: nn.Module) -> Callable[[], None]:
        owner = by_layer[id(layer)][1]
        if owner is None:
            return lambda: None
        try:
            owner.unshard()
        except BaseException:
            owner.reshard()  # never leave the block half unsharded for training's next forward
            raise
        return owner.reshard

    w = grouped[0].w1_EFD
    return MoEBinding(layers=layers, names=names, experts=lambda m: slices[id(m)], expert_peer_groups=peers,
                      hidden_size=int(w.shape[-1]), materialize=materialize)
