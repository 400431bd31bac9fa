"""Peer groups, DeviceMesh derivation, group-size semantics and cross-group intersection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh

from scout_core.topology import (
    AttributionScope,
    GroupTiming,
    attribution_scope,
    axis_groups,
    coords_of,
    hosts_by_group,
    localize_slow_groups,
    peer_groups,
    peer_groups_from_mesh,
)


def test_paper_example_d4_t2():
    assert peer_groups({"d": 4, "t": 2}) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert coords_of(5, {"d": 4, "t": 2}) == {"d": 2, "s": 0, "t": 1, "p": 0, "c": 0, "e": 0}


def test_fsdp_only_uses_state_shard_axis():
    assert peer_groups({"s": 8}) == [tuple(range(8))]
    assert peer_groups({"s": 4, "t": 2}) == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_hsdp_fixes_shard_position():
    # 4 replicas x 4 shards: peers hold the same shard in different replicas.
    assert peer_groups({"d": 4, "s": 4}) == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]


def test_configurable_order():
    # Tensor-parallel outermost instead of innermost.
    assert peer_groups({"d": 4, "t": 2}, order=("t", "d", "s", "p", "c", "e")) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_pipeline_and_context_coordinates_stay_fixed():
    shape = {"d": 3, "p": 2, "c": 2}
    for group in peer_groups(shape):
        coords = [coords_of(r, shape) for r in group]
        assert len({(c["p"], c["c"]) for c in coords}) == 1
        assert sorted(c["d"] for c in coords) == [0, 1, 2]


@given(st.dictionaries(st.sampled_from("dstpce"), st.integers(1, 4), max_size=6), st.permutations("dstpce"))
def test_groups_partition_the_world(shape, order):
    groups = peer_groups(shape, order)
    world = 1
    for v in shape.values():
        world *= v
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world))
    axis = "d" if shape.get("d", 1) > 1 else "s"
    for g in groups:
        coords = [coords_of(r, shape, order) for r in g]
        for other in "dstpce":
            if other != axis:
                assert len({c[other] for c in coords}) == 1


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="unknown axes"):
        peer_groups({"x": 2})
    with pytest.raises(ValueError, match=">= 1"):
        peer_groups({"d": 0})
    with pytest.raises(ValueError, match="permutation"):
        peer_groups({"d": 2}, order=("d", "d", "t", "p", "c", "e"))
    with pytest.raises(ValueError):
        coords_of(8, {"d": 4, "t": 2})


def _mesh(shape, names):
    return DeviceMesh("cpu", torch.arange(int(torch.tensor(shape).prod())).reshape(shape),
                      mesh_dim_names=names, _init_backend=False, _rank=0)


def test_groups_from_device_mesh_match_shape_rule():
    mesh = _mesh((4, 2), ("dp_replicate", "tp"))
    assert peer_groups_from_mesh(mesh) == peer_groups({"d": 4, "t": 2})
    hsdp = _mesh((4, 4), ("dp_replicate", "dp_shard"))
    assert peer_groups_from_mesh(hsdp) == peer_groups({"d": 4, "s": 4})
    fsdp_tp = _mesh((2, 4, 2), ("pp", "fsdp", "tp"))
    assert peer_groups_from_mesh(fsdp_tp) == peer_groups({"p": 2, "s": 4, "t": 2}, order=("p", "s", "t", "d", "c", "e"))
    tp_only = _mesh((4,), ("tp",))
    assert peer_groups_from_mesh(tp_only) == [(0,), (1,), (2,), (3,)]


def test_device_mesh_needs_known_names():
    with pytest.raises(ValueError, match="mesh_dim_names"):
        peer_groups_from_mesh(DeviceMesh("cpu", torch.arange(4), _init_backend=False, _rank=0))
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        peer_groups_from_mesh(_mesh((2, 2), ("dp", "wat")))


def test_group_size_semantics():
    assert attribution_scope(1) is AttributionScope.NONE
    assert attribution_scope(2) is AttributionScope.GROUP
    assert attribution_scope(3) is AttributionScope.RANK
    assert attribution_scope(1000) is AttributionScope.RANK
    with pytest.raises(ValueError):
        attribution_scope(0)


# --- cross-process-group intersection (paper Figure 3) ----------------------------------------

ORDER = ("t", "d", "s", "p", "c", "e")
SHAPE = {"t": 2, "d": 4, "s": 2}


def _fig3(slow_ranks_fsdp=(), slow_ranks_tp=()):
    fsdp = axis_groups(SHAPE, "s", ORDER)
    tp = axis_groups(SHAPE, "t", ORDER)
    obs = [GroupTiming("fsdp", g, any(r in slow_ranks_fsdp for r in g)) for g in fsdp]
    obs += [GroupTiming("tp", g, any(r in slow_ranks_tp for r in g)) for g in tp]
    return obs, hosts_by_group(tp, prefix="node")


def test_figure3_groups():
    assert (4, 5) in axis_groups(SHAPE, "s", ORDER)
    assert (4, 12) in axis_groups(SHAPE, "t", ORDER)


def test_figure3_names_r4_machine():
    obs, hosts = _fig3(slow_ranks_fsdp=(4,), slow_ranks_tp=(4,))
    loc = localize_slow_groups(obs, hosts)
    assert loc.scope == "machine" and loc.ranks == (4,) and loc.hosts == (hosts[4],)
    assert hosts[4] == hosts[12]


def test_slow_tp_group_alone_is_intra_machine():
    obs, hosts = _fig3(slow_ranks_tp=(6,))
    loc = localize_slow_groups(obs, hosts)
    assert loc.scope == "machine" and loc.hosts == (hosts[6],)


def test_slow_fsdp_groups_alone_report_groups():
    obs, hosts = _fig3(slow_ranks_fsdp=(2, 10))
    loc = localize_slow_groups(obs, hosts)
    assert loc.scope == "peer_group"
    assert {g for _, g in loc.slow_groups} == {(2, 3), (10, 11)}


def test_many_slow_groups_without_common_machine_is_job_level():
    obs, hosts = _fig3(slow_ranks_fsdp=(0, 4, 10, 14), slow_ranks_tp=(1, 7))
    loc = localize_slow_groups(obs, hosts)
    assert loc.scope == "job"


def test_no_slow_group():
    obs, hosts = _fig3()
    assert localize_slow_groups(obs, hosts).scope == "none"


def test_missing_host_raises():
    obs, hosts = _fig3(slow_ranks_fsdp=(4,))
    del hosts[5]
    with pytest.raises(ValueError, match="no host"):
        localize_slow_groups(obs, hosts)
    with pytest.raises(ValueError, match="two groups"):
        hosts_by_group([(0, 1), (1, 2)])
