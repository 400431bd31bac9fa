"""DeepSpeed's torch backend binds its all-gather and reduce-scatter at start-up, before SCOUT's collective hooks
exist: the plugin reroutes them through torch.distributed at call time, where the hooks see them."""

from __future__ import annotations

import importlib
from typing import Any

from scout_core.testing.launcher import RankContext, init_gloo, launch


def _rank(ctx: RankContext) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    init_gloo(ctx)
    import deepspeed
    import deepspeed.comm as ds_comm

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    from scout_deepspeed.adapter import observe_backend_collectives

    seen: list[str] = []

    def observed() -> list[str]:  # what a hook on torch.distributed sees of DeepSpeed's ZeRO collectives
        seen.clear()
        real = {n: getattr(dist, n) for n in ("all_gather_into_tensor", "reduce_scatter_tensor")}
        for name, fn in real.items():
            setattr(dist, name, lambda *a, _n=name, _f=fn, **k: seen.append(_n) or _f(*a, **k))
        try:
            x = torch.ones(2)
            ds_comm.allgather_fn(torch.empty(2 * ctx.world_size), x, async_op=True).wait()  # ZeRO-3 parameter gather
            ds_comm.reduce_scatter_fn(torch.empty(2), torch.ones(2 * ctx.world_size))  # its gradient reduction
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        return list(seen)

    before = observed()
    rerouted = observe_backend_collectives()
    again = observe_backend_collectives()
    return {"before": before, "after": observed(), "rerouted": rerouted, "again": again}


def test_zeros_collectives_reach_torch_distributed_once_rerouted():
    result = launch(_rank, 2, timeout_s=120)
    assert result.ok, result.failures()
    for value in result.values():
        assert value["before"] == []  # bound at start-up: out of a hook's sight
        assert value["after"] == ["all_gather_into_tensor", "reduce_scatter_tensor"] and value["rerouted"]
        assert value["again"] is False  # idempotent
