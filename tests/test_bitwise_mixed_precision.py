"""Training under ``enable()`` equals training without SCOUT bit for bit: FSDP2 with a mixed-precision policy and
gradient accumulation, at a world size that is not a power of two."""

from __future__ import annotations

import torch
import torch.distributed as dist

from scout_core.testing.launcher import RankContext, init_gloo, launch


def _fsdp2_mixed_precision(ctx: RankContext):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from integrations_tests.models import TinyModel, batches
    from scout_core.config import load

    init_gloo(ctx)
    torch.manual_seed(0)
    model = TinyModel(hidden=24, depth=3)
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp_shard",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = None
    if ctx.args["scout"]:
        import scout_core

        d = ctx.args["dir"]
        cfg = load(None, ["replay.cadence.hidden=2", "replay.cadence.optimizer=2", "checkpoint.enabled=false",
                          f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
        handle = scout_core.enable(model, opt, config=cfg)
        handle.resume()
    data = iter(batches(ctx.rank, 16))
    for _ in range(8):
        for micro in range(2):  # gradient accumulation: the first micro-batch keeps its gradients unreduced
            model.set_requires_gradient_sync(micro == 1)
            x, y = next(data)
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    checks: list = []
    if handle is not None:
        checks = [(r.step, r.skipped) for r in handle.replay.history]
        handle.close(discard_snapshots=True)
    state = [p.to_local().detach().clone() for p in model.parameters()]
    state += [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
              for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"state": state, "checks": checks}


def test_fsdp2_mixed_precision_with_accumulation_is_bitwise_unchanged_under_enable(tmp_path):
    """bf16 parameters, fp32 reduction, two micro-batches a step (one without the reduce-scatter), 3 ranks,
    replay every second step: parameters and AdamW's state end the same as without SCOUT, bit for bit."""
    off = launch(_fsdp2_mixed_precision, 3, timeout_s=180, args={"scout": False})
    on = launch(_fsdp2_mixed_precision, 3, timeout_s=180, args={"scout": True, "dir": str(tmp_path)})
    assert off.ok and on.ok, off.failures() + on.failures()
    for rank, (a, b) in enumerate(zip(off.values(), on.values())):
        assert len(a["state"]) == len(b["state"])
        for x, y in zip(a["state"], b["state"]):
            assert torch.equal(x, y), f"rank {rank}: {(x != y).sum().item()} of {x.numel()} elements differ"
    checks = on.values()[0]["checks"]
    assert len(checks) >= 3 and not any(skipped for _, skipped in checks), checks  # replay ran, on bf16 layers
