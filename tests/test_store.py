"""The durable store: atomic commits, checksums, weights_only loads, rank vote, SIGKILL at any point."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from scout_core.checkpoint.store import DurableStore, agree_on_generation
from scout_core.testing.launcher import RankContext, init_gloo, launch


def _state(seed: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": [{"w": torch.randn(n, generator=g)}], "step": seed, "rng": {"cpu": torch.get_rng_state()},
            "optim": [{"state": {0: {"exp_avg": torch.randn(n, generator=g), "step": torch.tensor(3.0)}},
                       "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "foreach": None}]}]}


def test_write_load_round_trip_and_roles(tmp_path):
    st = DurableStore(tmp_path, rank=1, world_size=4)
    st.write(5, _state(5))
    assert st.local_generations() == {5: "candidate"}
    st.set_role(5, "verified")
    assert st.local_generations() == {5: "verified"}
    loaded = st.load(5)
    assert torch.equal(loaded["model"][0]["w"], _state(5)["model"][0]["w"])
    assert loaded["optim"][0]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert (os.stat(os.path.join(tmp_path, "gen-000000005", "rank-00001.pt")).st_mode & 0o777) == 0o600
    with pytest.raises(ValueError):
        st.write(6, _state(6), role="golden")
    with pytest.raises(FileNotFoundError):
        st.set_role(9, "verified")


def test_corruption_is_never_selectable(tmp_path):
    st = DurableStore(tmp_path, rank=0, world_size=1)
    st.write(1, _state(1))
    shard = os.path.join(tmp_path, "gen-000000001", "rank-00000.pt")
    with open(shard, "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0x01]))  # one flipped bit on disk
    assert st.local_generations() == {}
    with pytest.raises(FileNotFoundError, match="corrupt"):
        st.load(1)


def test_weights_only_refuses_code(tmp_path):
    st = DurableStore(tmp_path, rank=0, world_size=1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    st.write(2, {"x": Evil()})
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        st.load(2)


def test_prune_keeps_listed_generations(tmp_path):
    st = DurableStore(tmp_path, rank=0, world_size=1)
    for g in (1, 2, 3):
        st.write(g, _state(g, 10))
    st.prune({2, 3})
    assert sorted(st.local_generations()) == [2, 3]
    assert not os.path.exists(os.path.join(tmp_path, "gen-000000001"))


def _killable_writer(root: str, generation: int, seed: int) -> None:
    st = DurableStore(root, rank=0, world_size=1)
    st.write(generation, _state(seed, 200_000))  # ~1.6 MB: several syscalls to interrupt
    st.set_role(generation, "verified")
    os._exit(0)


def test_sigkill_at_random_points_never_leaves_a_selectable_corrupt_generation(tmp_path):
    rng = random.Random(1234)
    root = str(tmp_path)
    DurableStore(root, 0, 1).write(0, _state(0, 200_000))  # a good generation to fall back to
    kills = completed = 0
    for attempt in range(60):
        gen = attempt + 1
        pid = os.fork()
        if pid == 0:
            try:
                _killable_writer(root, gen, gen)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.03))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == -signal.SIGKILL:
            kills += 1
        else:
            completed += 1
        st = DurableStore(root, 0, 1)
        for g, role in st.local_generations().items():
            loaded = st.load(g)  # every selectable generation loads and is exactly what was written
            assert torch.equal(loaded["model"][0]["w"], _state(g, 200_000)["model"][0]["w"])
            assert role in ("candidate", "verified")
    assert kills >= 20, f"only {kills} writers were killed mid-way; the test did not exercise crashes"
    assert 0 in DurableStore(root, 0, 1).local_generations()


def _vote(ctx: RankContext):
    init_gloo(ctx)
    st = DurableStore(ctx.args["root"], ctx.rank, ctx.world_size)
    for g in (1, 2, 3):
        if g == 3 and ctx.rank == 2:
            continue  # rank 2 never committed generation 3
        st.write(g, {"rank": torch.tensor(ctx.rank), "g": torch.tensor(g)})
        if g <= 2:
            st.set_role(g, "verified")
    return agree_on_generation(st), agree_on_generation(st, "verified"), agree_on_generation(st, "candidate")


def test_rank_consistency_vote(tmp_path):
    result = launch(_vote, 4, timeout_s=60, args={"root": str(tmp_path)})
    assert result.ok, result.failures()
    assert set(result.values()) == {(2, 2, None)}


def test_a_failed_write_leaves_no_temporary(tmp_path):
    from scout_core.checkpoint.store import atomic_stream

    def emit(out):
        out.write(b"half a shard")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_stream(str(tmp_path / "shard.pt"), emit)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rewrite_of_a_generation_leaves_no_older_commit_of_it_selectable(tmp_path):
    """A run that restarted from scratch reaches a step an earlier run left verified (kept for forensics): if this
    rank's write of it fails, its old shard must not be chosen beside the other ranks' new ones."""
    st = DurableStore(tmp_path, rank=0, world_size=2)
    st.write(5, _state(5), role="verified")

    def emit(out):
        out.write(b"half a shard")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        st._commit(5, "candidate", emit)
    assert st.local_generations() == {}
    st.write(5, _state(6))
    assert st.local_generations() == {5: "candidate"} and st.load(5)["step"] == 6


def test_temporaries_of_killed_writers_are_removed_and_live_ones_kept(tmp_path):
    import subprocess

    from scout_core import durable_files as store_module

    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 2 * store_module.STALE_TMP_S
    stale = tmp_path / f"own-r00001-s000000004-w00004.pt.tmp-{dead.pid}"
    fresh = tmp_path / f"own-r00002-s000000004-w00004.pt.tmp-{dead.pid + 1_000_000}"  # no such pid, just written
    live = tmp_path / f"own-r00003-s000000004-w00004.pt.tmp-{os.getpid()}"  # a writer that is running
    for f in (stale, fresh, live):
        f.write_bytes(b"x")
    os.utime(stale, (old, old))
    os.utime(live, (old, old))
    assert store_module.remove_stale_temporaries(str(tmp_path)) == [stale.name]
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([fresh.name, live.name])
