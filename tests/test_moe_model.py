"""The MoE test model at 16 ranks (EP 4 x DP 4): it trains, replicas stay equal, AllToAll is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist

from integrations_tests.moe_model import MoEConfig, build_model, sync_grads
from scout_core.signature import sign_many
from scout_core.testing.launcher import init_gloo, launch


def _train(ctx):
    init_gloo(ctx)
    cfg = MoEConfig()
    model, ep_group, dp_group = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    losses, splits = [], []
    for _ in range(4):
        x, y = torch.randn(2, 12, cfg.dim_in, generator=gen), torch.randn(2, 12, cfg.dim_out, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        sync_grads(model, dp_group)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        splits.append(model.layers[0].moe.last_plan.in_splits)
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    return {"dense": sign_many([torch.cat([p.detach().reshape(-1) for p in dense])])[0].signature,
            "experts": sign_many([torch.cat([p.detach().reshape(-1) for p in model.expert_parameters()])])[0]
            .signature, "losses": losses, "splits": splits}


def test_moe_model_trains_with_ep4_dp4():
    result = launch(_train, 16, timeout_s=120)
    assert result.ok, result.failures()
    values = result.values()
    assert len({v["dense"] for v in values}) == 1  # dense weights equal on every rank
    for pos in range(4):  # each EP position's experts equal across its 4 replicas, different between positions
        assert len({values[r]["experts"] for r in range(pos, 16, 4)}) == 1
    assert len({values[p]["experts"] for p in range(4)}) == 4
    assert all(v["losses"][-1] < v["losses"][0] * 1.5 for v in values)
    assert any(len(set(s)) > 1 for v in values for s in v["splits"])  # routing really is uneven


def test_expert_layer_matches_a_single_process_reference():
    """Dispatch, experts and combine over 4 ranks equal the same experts applied locally (EP 4, DP 1)."""
    def run(ctx):
        init_gloo(ctx)
        cfg = MoEConfig(depth=1)
        model, ep_group, _ = build_model(cfg, seed=3)
        moe = model.layers[0].moe
        x = torch.randn(10, cfg.hidden, generator=torch.Generator().manual_seed(ctx.rank))
        out = moe(x)
        # Gather every position's experts and recompute this rank's tokens locally.
        ups = [torch.empty(cfg.hidden, cfg.ffn) for _ in range(cfg.experts)]
        downs = [torch.empty(cfg.ffn, cfg.hidden) for _ in range(cfg.experts)]
        mine_up = torch.stack([e.up.detach() for e in moe.experts])
        mine_down = torch.stack([e.down.detach() for e in moe.experts])
        all_up = [torch.empty_like(mine_up) for _ in range(4)]
        all_down = [torch.empty_like(mine_down) for _ in range(4)]
        dist.all_gather(all_up, mine_up, group=ep_group)
        dist.all_gather(all_down, mine_down, group=ep_group)
        ups, downs = torch.cat(all_up), torch.cat(all_down)
        token, expert, weight = moe.route(x)
        ref = torch.zeros_like(x)
        for t, e, w in zip(token.tolist(), expert.tolist(), weight.tolist()):
            ref[t] += w * (torch.nn.functional.silu(x[t] @ ups[e]) @ downs[e])
        return float((out - ref).abs().max())

    result = launch(run, 4, timeout_s=60)
    assert result.ok, result.failures()
    assert max(result.values()) < 1e-5
