"""The adapter: SCOUT's peer groups from TorchTitan's own ParallelDims, checked against the meshes TorchTitan
builds on 4 real ranks (gloo), and the Trainer's objects handed to scout_core."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from scout_core.testing.launcher import RankContext, init_gloo, launch
from scout_torchtitan.attach import peer_groups

LAYOUTS = [  # (dp_replicate, dp_shard, cp, tp, pp)
    (2, 2, 1, 1, 1),  # HSDP 2 x 2: peers are the replicas of one shard
    (1, 4, 1, 1, 1),  # FSDP over 4: peers are the shards (nothing is replicated)
    (2, 1, 1, 2, 1),  # DDP 2 x TP 2: peers hold the same TP shard
    (1, 2, 1, 1, 2),  # PP 2 x FSDP 2: peers are one stage's shards
    (1, 2, 2, 1, 1),  # FSDP 2 x CP 2: peers hold the same sequence chunk
]


def _titan_groups(ctx: RankContext) -> dict[str, Any]:
    from torchtitan.distributed.parallel_dims import ParallelDims

    from scout_torchtitan.cpu import use_cpu

    init_gloo(ctx)
    use_cpu()
    dp_replicate, dp_shard, cp, tp, pp = ctx.args["layout"]
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=1,
                        world_size=ctx.world_size)
    dims.build_mesh()
    # The group this rank's peers vary along, as TorchTitan's own mesh has it.
    mesh = dims.get_optional_mesh("dp_replicate" if dp_replicate > 1 else "dp_shard")
    titan = sorted(dist.get_process_group_ranks(mesh.get_group())) if mesh is not None else None
    # Every rank is done building its groups before any leaves: the store they rendezvous through lives in rank
    # 0's process (tcp:// init), and rank 0 leaving first broke a peer's last group (seen once in CI).
    dist.barrier()
    return {"ours": peer_groups(dims), "titan": titan}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "x".join(map(str, t)))
def test_peer_groups_are_torchtitans_data_parallel_groups(layout):
    result = launch(_titan_groups, 4, timeout_s=120, args={"layout": layout})
    assert result.ok, result.failures()
    values = result.values()
    ours = values[0]["ours"]
    assert all(v["ours"] == ours for v in values)  # one partition, the same on every rank
    assert sorted(r for g in ours for r in g) == [0, 1, 2, 3]
    for rank, v in enumerate(values):
        mine = next(g for g in ours if rank in g)
        if v["titan"] is not None:
            assert mine == v["titan"], (rank, mine, v["titan"])
    dp_replicate, dp_shard, cp, tp, pp = layout
    assert len(ours[0]) == (dp_replicate if dp_replicate > 1 else dp_shard)


def test_a_job_without_a_seed_is_told_that_runs_cannot_be_compared_bit_for_bit():
    import types

    from scout_torchtitan.attach import unseeded_warning

    def trainer(seed):
        return types.SimpleNamespace(config=types.SimpleNamespace(debug=types.SimpleNamespace(seed=seed)))

    assert "--debug.seed is not set" in unseeded_warning(trainer(None))
    assert unseeded_warning(trainer(0)) == "" and unseeded_warning(types.SimpleNamespace()) == ""
