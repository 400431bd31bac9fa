"""Small real models and real parallel wrappers for the cells: DDP, FSDP2, HSDP.

The model is deterministic (seeded), small enough that 16 CPU ranks step in
milliseconds, and shaped like the models SCOUT targets: an input layer, a
``ModuleList`` of identical repeated blocks, and an output head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LAYOUTS = ("ddp", "fsdp2", "hsdp")


class Block(nn.Module):
    def __init__(self, hidden: int, bias: bool = True, norm_weight: bool = True) -> None:
        super().__init__()
        # bias=False: Llama style (RMSNorm with a weight only, linears without bias): two tensors a block;
        # norm_weight=False: an RMSNorm without a weight (as in OLMo's non-parametric norm), one tensor a block.
        self.norm = nn.LayerNorm(hidden) if bias else nn.RMSNorm(hidden, elementwise_affine=norm_weight)
        self.fc = nn.Linear(hidden, hidden, bias=bias)
        # No-op points at the block's entry and exit, where a cell hooks the whole block's forward and
        # backward (FSDP2 replay calls the block's forward directly, past hooks on the block itself).
        self.enter = nn.Identity()
        self.exit = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        return self.exit(x + torch.tanh(self.fc(self.norm(x))))


class TinyModel(nn.Module):
    def __init__(self, dim_in: int = 16, hidden: int = 32, depth: int = 3, dim_out: int = 8,
                 bias: bool = True, norm_weight: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(dim_in, hidden, bias=bias)
        self.layers = nn.ModuleList(Block(hidden, bias, norm_weight) for _ in range(depth))
        self.head = nn.Linear(hidden, dim_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@dataclass
class Parallel:
    """A wrapped model plus what SCOUT needs to know about its layout."""

    model: nn.Module
    inner: TinyModel
    layout: str
    mesh: Any = None


def build(layout: str, *, seed: int = 0, hsdp_replicas: int = 4, bucket_cap_mb: float | None = None,
          hidden: int = 32, bias: bool = True, depth: int = 3, norm_weight: bool = True) -> Parallel:
    """The seeded model wrapped for ``layout`` over the default process group (``bucket_cap_mb``: DDP's
    bucket size; a small one splits the gradients into several all-reduces, as on a large model; ``hidden``:
    the blocks' width, larger where a cell needs compute measurable in milliseconds; ``bias=False``: Llama-style
    blocks, 2 parameter tensors a block instead of 4; ``norm_weight=False`` with it: 1; ``depth``: the number of
    blocks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    torch.manual_seed(seed)
    model = TinyModel(hidden=hidden, bias=bias, depth=depth, norm_weight=norm_weight)
    world = dist.get_world_size()
    if layout == "ddp":
        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        return Parallel(nn.parallel.DistributedDataParallel(model, **kwargs), model, layout)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    else:
        if world % hsdp_replicas:
            raise ValueError(f"HSDP with {hsdp_replicas} replicas needs a world size divisible by it, got {world}")
        mesh = init_device_mesh("cpu", (hsdp_replicas, world // hsdp_replicas),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Parallel(model, model, layout, mesh)


def start_rank(ctx: Any, *, timeout_s: float = 300.0) -> tuple[dict[str, Any], Any, Parallel, torch.optim.Optimizer]:
    """The common start of a training cell's rank: gloo, the injector, the wrapped model, AdamW."""
    from scout_core.testing.inject import Injector
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx, timeout_s=timeout_s)
    a = ctx.args
    injector = Injector(a["faults"], seed=a["seed"])
    par = build(a["layout"], seed=a["seed"], hidden=a.get("hidden", 32), hsdp_replicas=a.get("replicas", 4),
                bias=a.get("bias", True), depth=a.get("depth", 3), norm_weight=a.get("norm_weight", True))
    return a, injector, par, torch.optim.AdamW(par.model.parameters(), lr=1e-3)


def install_block_faults(par: Parallel, injector: Any, rank: int, state: dict[str, Any]) -> None:
    """Forward-output and backward faults inside every block (on ``fc``), surfaces ``layers.<i>.output`` /
    ``layers.<i>.grad``: they act in training and replay alike, however replay calls the block."""
    for i, block in enumerate(par.inner.layers):
        def out_fault(_m: Any, _a: Any, out: torch.Tensor, i: int = i) -> None:
            with torch.no_grad():
                injector.corrupt(f"layers.{i}.output", out, rank=rank, step=state["step"])

        def grad_fault(_m: Any, grad_input: Any, _g: Any, i: int = i) -> Any:
            if grad_input[0] is None:
                return None
            g = grad_input[0].clone()
            injector.corrupt(f"layers.{i}.grad", g, rank=rank, step=state["step"])
            return (g,)

        block.fc.register_forward_hook(out_fault)
        block.fc.register_full_backward_hook(grad_fault)


def install_optimizer_kernel_fault(injector: Any, rank: int, state: dict[str, Any]) -> None:
    """A defective optimizer kernel on this rank: torch's Adam/AdamW implementations (single-tensor, foreach and
    fused, all in ``torch.optim.adam``) compute every parameter's update, and the fault then changes each
    update as computed, before it lands in the parameter. It knows nothing of SCOUT: whatever calls the kernel
    (training's step, or SCOUT's replay of a slice) gets the defect while it is armed.

    ``optimizer.kernel``: every call of an armed step (a persistent defect: the replay errs as training did);
    ``optimizer.kernel.once``: the first call of an armed step only (a transient upset of training's step: the
    models here have one parameter group, so one call); ``optimizer.kernel.output``: like ``optimizer.kernel``,
    but the defect is in what the kernel writes (the new weight), not in the update before it is added (a flip of
    a low bit of an update is most often rounded away when it is added to a much larger weight: no defect at all)."""
    import torch.optim.adam as adam_impl

    calls: dict[int, int] = {}

    def defective(real: Any) -> Any:
        def kernel(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            step = state["step"]
            calls[step] = calls.get(step, 0) + 1
            surfaces = ["optimizer.kernel", "optimizer.kernel.output"] + (
                ["optimizer.kernel.once"] if calls[step] == 1 else [])
            armed = [s for s in surfaces if injector.corrupts(s, rank=rank, step=step)]
            if not armed:
                return real(params, *args, **kwargs)
            before = [p.detach().clone() for p in params]
            out = real(params, *args, **kwargs)
            with torch.no_grad():
                for p, old in zip(params, before, strict=True):
                    update = p.detach() - old
                    local = update.to_local() if hasattr(update, "to_local") else update  # this rank's shard
                    updates = [s for s in armed if s != "optimizer.kernel.output"]
                    for surface in updates if local.numel() else ():  # a shard may hold nothing of a small one
                        injector.corrupt(surface, local, rank=rank, step=step)
                    p.detach().copy_(old + update)
                    written = p.detach()
                    written = written.to_local() if hasattr(written, "to_local") else written
                    if "optimizer.kernel.output" in armed and written.numel():
                        injector.corrupt("optimizer.kernel.output", written, rank=rank, step=step)
            return out

        return kernel

    for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"):
        setattr(adam_impl, name, defective(getattr(adam_impl, name)))


def batches(rank: int, steps: int, *, batch: int = 8, dim_in: int = 16, dim_out: int = 8, seed: int = 0):
    """Deterministic per-rank data: different ranks see different samples, as in data parallelism."""
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    for _ in range(steps):
        yield torch.randn(batch, dim_in, generator=gen), torch.randn(batch, dim_out, generator=gen)
