"""What SCOUT needs to know of a model's MoE layers: :class:`MoEBinding`, passed as ``enable(..., moe=...)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["MoEBinding", "expert_width"]


@dataclass(kw_only=True)
class MoEBinding:
    """The MoE layers of a model and the groups that hold the same experts."""

    layers: list[nn.Module]
    """The MoE modules; each holds this rank's local experts (``experts`` below)."""
    experts: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    """A MoE layer's local experts, each a module called on ``[rows, hidden]`` (it may return a tuple, such as
    Megatron's ``(out, bias)``: the first tensor is the output); default: the layer's ``experts``
    ``ModuleList`` (Megatron's ``SequentialMLP``: ``lambda m: m.local_experts``)."""
    expert_peer_groups: list[list[int]]
    """A partition of the ranks into groups holding the same experts (same EP position, other replicas)."""
    names: list[str] | None = None
    """Names of ``layers`` for records (default ``moe.<i>``)."""
    ep_groups: list[list[int]] | None = None
    """A partition of the ranks into EP groups (the ranks one AllToAll spans), in EP-position order; with it,
    each expert check also replays the AllToAll with one communication plan (:mod:`scout_core.moe.alltoall`)."""
    splits: Callable[[nn.Module], Sequence[int]] | None = None
    """This rank's split sizes of a MoE layer's last dispatch (rows sent to each EP peer); default: the
    layer's ``last_plan.in_splits``."""
    ep_position: int | None = None
    """This rank's EP position (catalog entries are per position); default: its index in its EP group when
    ``ep_groups`` is given, else 0 (every position has the same dimensions)."""
    hidden_size: int | None = None
    """Width of the rows an expert takes; default: found from the expert (see :func:`expert_width`)."""
    materialize: Callable[[nn.Module], Callable[[], None]] | None = None
    """For experts sharded at rest (FSDP2 DTensor weights): makes one MoE layer's local experts whole and returns
    what undoes it (an FSDP unshard and its reshard). Every rank calls it for the same layer at the same check,
    so it may be a collective."""

    # An expert may be a *view* of a grouped-experts module (one module holding every local expert's weights,
    # called once per step with all routed rows): the view's ``capture_module`` is the module training calls,
    # and its ``rows_from(args, kwargs)`` picks this expert's rows from that call.

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("MoEBinding needs at least one MoE layer")
        for m in self.layers:
            experts = self.local_experts(m)
            if not experts or not all(isinstance(e, nn.Module) for e in experts):
                raise TypeError(f"MoE layer {type(m).__name__} has no local experts (modules): give an `experts` "
                                "ModuleList or MoEBinding(experts=...)")
            if self.materialize is None and any(_is_dtensor(p) for e in experts for p in e.parameters()):
                raise ValueError(f"the experts of {type(m).__name__} are sharded (DTensor parameters, FSDP2): the "
                                 "expert recipe compares whole experts among their replicas; keep experts out of "
                                 "fully_shard (ignored_params=...) for now")
        if len({len(self.local_experts(m)) for m in self.layers}) != 1:
            raise ValueError("every MoE layer must hold the same number of local experts")
        flat = sorted(r for g in self.expert_peer_groups for r in g)
        if dist.is_initialized() and flat != list(range(dist.get_world_size())):
            raise ValueError(f"expert_peer_groups must partition the ranks exactly once, "
                             f"got {self.expert_peer_groups}")
        if self.ep_groups is not None and dist.is_initialized():
            flat = sorted(r for g in self.ep_groups for r in g)
            if flat != list(range(dist.get_world_size())):
                raise ValueError(f"ep_groups must partition the ranks exactly once, got {self.ep_groups}")
        if self.names is not None and len(self.names) != len(self.layers):
            raise ValueError(f"{len(self.names)} names for {len(self.layers)} MoE layers")
        if self.hidden_size is not None and self.hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {self.hidden_size}")

    def local_experts(self, layer: nn.Module) -> list[nn.Module]:
        """The local experts of ``layer``."""
        if self.experts is not None:
            return list(self.experts(layer))
        experts = getattr(layer, "experts", None)
        return list(experts) if isinstance(experts, nn.ModuleList) else []

    @staticmethod
    def capture_module(expert: nn.Module) -> nn.Module:
        """The module whose calls in training carry ``expert``'s rows (itself, or a view's grouped module)."""
        return getattr(expert, "capture_module", expert)

    @staticmethod
    def rows(expert: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """``expert``'s rows in a call of its capture module (a view picks its own; else the first tensor)."""
        if hasattr(expert, "rows_from"):
            return expert.rows_from(args, kwargs)
        return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)

    def expert_parameters(self) -> list[nn.Parameter]:
        """Every local expert's parameters, in every bound layer."""
        return [p for m in self.layers for e in self.local_experts(m)
                for p in (e.trained_parameters() if hasattr(e, "trained_parameters") else e.parameters())]

    def position(self, rank: int) -> int:
        """This rank's EP position (see ``ep_position``)."""
        if self.ep_position is not None:
            return self.ep_position
        if self.ep_groups is not None:
            return next(sorted(g).index(rank) for g in self.ep_groups if rank in g)
        return 0


def expert_width(expert: nn.Module, hidden_size: int | None = None) -> int:
    """The width of the rows ``expert`` takes: ``hidden_size`` when given; else the first ``nn.Linear``'s
    ``in_features`` (a Linear stores ``[out, in]``: Mixtral's ``w1``, Hugging Face's ``gate_proj``); else the
    first parameter's first dimension (raw ``[hidden, ffn]`` weights, the test model). Megatron's experts use its
    own parallel linears: scout-megatron passes the model's hidden size."""
    if hidden_size is not None:
        return int(hidden_size)
    for m in expert.modules():
        if isinstance(m, nn.Linear):
            return int(m.in_features)
    p = next(expert.parameters(), None)
    if p is None or p.dim() < 1:
        raise ValueError(f"cannot tell the input width of expert {type(expert).__name__}: "
                         "set MoEBinding.hidden_size")
    return int(p.shape[0])


def _is_dtensor(p: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)
