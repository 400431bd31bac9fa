"""A small decoder with a top-k routed MoE feed-forward and expert parallelism, for the MoE cells.

Layout at 16 ranks: EP 4 x DP 4. The EP group is 4 consecutive ranks; each holds ``experts / ep`` local
experts. Experts are replicated over DP: the peers of an EP position are the same position in the other
replicas (ranks ``p, p + 4, p + 8, p + 12``). Tokens go to their experts and come back with
``dist.all_to_all_single`` and uneven split sizes (gloo in torch 2.13 supports uneven and zero splits on CPU
tensors; checked in tests/test_moe_model.py), through :class:`AllToAll`, an autograd function whose backward
is the reverse exchange.

Gradients are synchronized as Megatron does it: dense parameters (embedding, attention, norms, router, head)
averaged over the world, expert parameters over their DP group (:func:`sync_grads`).

The experts can compute with :class:`~scout_core.moe.paths.ReferenceGroupedGemm` (``path_kernel``): a tiled
GEMM whose execution paths are those of the shape catalog, so a cell can put a fault on one path role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scout_core.moe.paths import ReferenceGroupedGemm

__all__ = ["AllToAll", "MoEConfig", "MoEDecoder", "MoELayer", "RoutingPlan", "build_moe_groups", "sync_grads"]


@dataclass(kw_only=True)
class MoEConfig:
    dim_in: int = 16
    hidden: int = 32
    ffn: int = 32
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    capacity: int = 24
    """Most tokens one expert takes in one step; the rest are dropped (they pass through the residual)."""
    depth: int = 2
    dim_out: int = 8
    ep: int = 4


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        y = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        gx = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])
        dist.all_to_all_single(gx, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return gx, None, None, None


@dataclass
class RoutingPlan:
    """One dispatch's communication plan: rows sent to and received from each EP peer, and the rows each
    local expert receives from each source (``recv_counts[src][e]``)."""

    in_splits: list[int]
    out_splits: list[int]
    recv_counts: list[list[int]] = field(default_factory=list)


class Expert(nn.Module):
    """One expert MLP, ``down(silu(up(x)))``, as two GEMMs the path kernel can run."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(hidden, ffn) / math.sqrt(hidden))
        self.down = nn.Parameter(torch.randn(ffn, hidden) / math.sqrt(ffn))
        self.path_kernel: ReferenceGroupedGemm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = self.path_kernel.gemm if self.path_kernel is not None else torch.matmul
        return gemm(F.silu(gemm(x, self.up)), self.down)


class Router(nn.Module):
    """The gate's logits over the experts. ``tap`` is a no-op point inside the forward where a cell corrupts
    the logits: a replay of an FSDP2 unit calls its forward without the unit's own hooks (FSDP's), as a
    hardware fault inside the computation would still strike."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.tap = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tap(self.proj(x))


class MoELayer(nn.Module):
    """Top-k routing, capacity, dispatch over the EP group, local experts, combine."""

    def __init__(self, cfg: MoEConfig, ep_group: Any, ep_rank: int) -> None:
        super().__init__()
        self.cfg, self.ep_group, self.ep_rank = cfg, ep_group, ep_rank
        self.local = cfg.experts // cfg.ep
        self.router = Router(cfg.hidden, cfg.experts)
        self.experts = nn.ModuleList(Expert(cfg.hidden, cfg.ffn) for _ in range(self.local))
        self.last_plan: RoutingPlan | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token index, expert, weight) of every kept assignment, sorted by expert (stable)."""
        probs = F.softmax(self.router(x), dim=-1)
        weight, expert = probs.topk(self.cfg.top_k, dim=-1)
        token = torch.arange(x.shape[0]).repeat_interleave(self.cfg.top_k)
        expert, weight = expert.reshape(-1), weight.reshape(-1)
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        # Capacity: each expert keeps its first `capacity` assignments in token order.
        rank_in_expert = torch.arange(expert.numel()) - torch.searchsorted(expert, expert)
        keep = rank_in_expert < self.cfg.capacity
        return token[keep], expert[keep], weight[keep]

    def plan(self, expert: torch.Tensor) -> RoutingPlan:
        counts = torch.bincount(expert, minlength=self.cfg.experts)
        per_peer = counts.view(self.cfg.ep, self.local)
        recv = torch.empty_like(per_peer)
        dist.all_to_all_single(recv, per_peer.contiguous(), group=self.ep_group)  # who sends me how many
        return RoutingPlan(per_peer.sum(1).tolist(), recv.sum(1).tolist(), recv.tolist())

    def experts_forward(self, rows: torch.Tensor, recv_counts: list[list[int]]) -> torch.Tensor:
        """The local experts on the rows received (ordered by source, then local expert), same order out."""
        pieces = list(torch.split(rows, [c for per_src in recv_counts for c in per_src]))
        by_expert = [torch.cat([pieces[s * self.local + e] for s in range(len(recv_counts))])
                     for e in range(self.local)]
        outs = [expert(x) for expert, x in zip(self.experts, by_expert, strict=True)]
        # Back to (source, expert) order for the return trip.
        split_out = [list(torch.split(o, [recv_counts[s][e] for s in range(len(recv_counts))]))
                     for e, o in enumerate(outs)]
        return torch.cat([split_out[e][s] for s in range(len(recv_counts)) for e in range(self.local)]) \
            if rows.shape[0] else rows.new_zeros(0, rows.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        token, expert, weight = self.route(flat)
        plan = self.last_plan = self.plan(expert)
        received = AllToAll.apply(flat[token], plan.out_splits, plan.in_splits, self.ep_group)
        processed = self.experts_forward(received, plan.recv_counts)
        back = AllToAll.apply(processed, plan.in_splits, plan.out_splits, self.ep_group)
        out = torch.zeros_like(flat).index_add(0, token, back * weight.unsqueeze(-1).to(back.dtype))
        return out.reshape(shape)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, ep_group: Any, ep_rank: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.moe = MoELayer(cfg, ep_group, ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoEDecoder(nn.Module):
    def __init__(self, cfg: MoEConfig, ep_group: Any, ep_rank: int) -> None:
        super().__init__()
        self.embed = nn.Linear(cfg.dim_in, cfg.hidden)
        self.layers = nn.ModuleList(MoEBlock(cfg, ep_group, ep_rank) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.hidden, cfg.dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.moe.experts.parameters()]


def build_moe_groups(world: int, ep: int) -> tuple[Any, Any, int, int]:
    """(EP group, DP group, EP rank, DP rank) of this rank: EP groups are consecutive ranks, DP groups
    the same EP position in every replica. Every rank creates every group, in the same order."""
    rank = dist.get_rank()
    ep_group = dp_group = None
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            ep_group = g
    for pos in range(ep):
        g = dist.new_group(list(range(pos, world, ep)))
        if rank % ep == pos:
            dp_group = g
    return ep_group, dp_group, rank % ep, rank // ep


def build_model(cfg: MoEConfig, *, seed: int = 0, dense: str = "replicated") -> tuple[MoEDecoder, Any, Any]:
    """The seeded model on this rank: dense weights equal everywhere, each EP position's experts equal across
    its replicas (seeded by position).

    ``dense="fsdp2"`` shards the dense parts with FSDP2 over all ranks, as TorchTitan does with a MoE model's
    attention and router: each block's attention and router are their own FSDP units (a replay check unshards
    just the one it samples) and the root holds embedding, norms and head; the experts stay out of FSDP
    (``ignored_params``), sharded over EP and replicated over DP."""
    world = dist.get_world_size()
    ep_group, dp_group, ep_rank, _ = build_moe_groups(world, cfg.ep)
    torch.manual_seed(seed)
    model = MoEDecoder(cfg, ep_group, ep_rank)
    gen = torch.Generator().manual_seed(seed * 7919 + ep_rank + 1)
    with torch.no_grad():
        for p in model.expert_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[0]))
    if dense == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in model.layers:
            fully_shard(block.attn, mesh=mesh)
            fully_shard(block.moe.router, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params=set(model.expert_parameters()))
    elif dense != "replicated":
        raise ValueError(f"dense must be 'replicated' or 'fsdp2', got {dense!r}")
    return model, ep_group, dp_group


def sync_grads(model: MoEDecoder, dp_group: Any) -> None:
    """Average dense gradients over the world and expert gradients over the DP group (one flat buffer each).
    Dense parameters under FSDP2 (DTensors) are left alone: FSDP reduce-scattered them already."""
    from torch.distributed.tensor import DTensor

    experts = {id(p) for p in model.expert_parameters()}
    dense = [p for p in model.parameters() if id(p) not in experts and not isinstance(p, DTensor)]
    for params, group in ((dense, None), (model.expert_parameters(), dp_group)):
        if not params:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        for p, chunk in zip(params, torch.split(flat, [g.numel() for g in grads]), strict=True):
            p.grad = chunk.view_as(p)
