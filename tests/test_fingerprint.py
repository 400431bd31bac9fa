"""Collective fingerprints: what is compared, and the compatibility rule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from scout_core.progress.fingerprint import CollectiveFingerprint, fingerprint_call
from scout_core.testing.launcher import RankContext, init_gloo, launch


def _fp(**kw):
    base = dict(op="all_reduce", group=(4, 0, 1, 2, 3), shapes=((10,),), dtypes=("float32",), reduce_op="SUM")
    base.update(kw)
    return CollectiveFingerprint(**base)


def test_metadata_changes_change_the_key():
    ref = _fp()
    for other in (_fp(shapes=((11,),)), _fp(dtypes=("float64",)), _fp(reduce_op="MAX"), _fp(op="broadcast"),
                  _fp(group=(2, 0, 1)), _fp(root=1)):
        assert other.key() != ref.key() and other.hash64() != ref.hash64()


def test_all_to_all_splits_are_not_compared():
    a = _fp(op="all_to_all_single", shapes=((7, 16), (9, 16)), reduce_op=None)
    b = _fp(op="all_to_all_single", shapes=((3, 16), (12, 16)), reduce_op=None)
    assert a.key() == b.key()
    c = _fp(op="all_to_all_single", shapes=((3, 32), (12, 32)), reduce_op=None)
    assert a.key() != c.key()  # trailing dims still count


def test_p2p_peer_is_reported_not_compared():
    a = _fp(op="send", reduce_op=None, peer=3)
    b = _fp(op="send", reduce_op=None, peer=5)
    assert a.key() == b.key() and "peer=3" in a.text()


def _calls(ctx: RankContext):
    init_gloo(ctx)
    groups = [[0, 1], [2, 3]]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    t = torch.zeros(5)
    out = {
        "world": fingerprint_call("all_reduce", (t,), {}),
        "sub": fingerprint_call("all_reduce", (t,), {"group": mine}),
        "max": fingerprint_call("all_reduce", (t, dist.ReduceOp.MAX), {}),
        "bcast": fingerprint_call("broadcast", (t,), {"src": 0}),
        "bcast_default": fingerprint_call("broadcast", (t, 0), {}),
        "gather": fingerprint_call("all_gather_into_tensor", (torch.zeros(20), t), {}),
    }
    return {k: (v.key(), v.text()) for k, v in out.items()}


def test_fingerprints_of_real_calls_on_real_groups():
    result = launch(_calls, 4, timeout_s=60)
    assert result.ok, result.failures()
    v = result.values()
    # Corresponding subgroups of different replicas ({0,1} and {2,3}) compare equal.
    assert v[0]["sub"][0] == v[2]["sub"][0]
    assert v[0]["world"][0] == v[3]["world"][0]
    assert v[0]["sub"][0] != v[0]["world"][0]
    assert v[0]["max"][0] != v[0]["world"][0] and "op=MAX" in v[0]["max"][1]
    assert v[0]["bcast"][0] == v[0]["bcast_default"][0] and "root=0" in v[0]["bcast"][1]
    assert "shapes=20;5" in v[1]["gather"][1]
