"""The fork launcher and the C3 transport over real gloo process groups."""

from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from scout_core.consensus import C3Status, StatisticalRule, c3_exchange, c3_exchange_unless_failed
from scout_core.replay.guard import DiagnosisGuard
from scout_core.testing.launcher import RankContext, init_gloo, launch


def _allreduce(ctx: RankContext) -> float:
    init_gloo(ctx)
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    mode = ctx.args.get("mode")
    if mode == "raise" and ctx.rank == 2:
        raise RuntimeError("rank two broke")
    if mode == "hang" and ctx.rank == 1:
        time.sleep(600)
    if mode == "spawn_child":
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        return pid
    return float(t)


def _shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _children():
    out = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == me:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def test_sixteen_ranks_return_values_without_leaks():
    before = _shm()
    result = launch(_allreduce, 16, timeout_s=60)
    assert result.ok, result.failures()
    assert result.values() == [120.0] * 16
    assert all(o.exitcode == 0 for o in result.outcomes)
    assert _children() == []
    assert _shm() <= before


def _early_to_the_store(ctx: RankContext) -> bool:
    if ctx.rank == 0:
        time.sleep(0.5)  # every other rank reaches the store's port before rank 0 serves it
        connected = True
    else:
        try:  # refused unless the port already listens (the launcher's socket, handed to rank 0)
            socket.create_connection(("127.0.0.1", ctx.master_port), timeout=5).close()
            connected = True
        except ConnectionRefusedError:
            connected = False
    init_gloo(ctx)
    dist.barrier()
    return connected


def test_the_stores_port_listens_before_rank_0_serves_it():
    # The launcher listens on the store's port before it forks, as torchrun's agent does: a rank that comes first
    # waits in the backlog. When rank 0 bound it, early ranks were refused or reset and retried; a third of 16-rank
    # launches took 5.3 s instead of 0.3 s.
    result = launch(_early_to_the_store, 8, timeout_s=60)
    assert result.ok, result.failures()
    assert result.values() == [True] * 8


def test_exception_returns_traceback_and_kills_blocked_peers():
    result = launch(_allreduce, 4, timeout_s=60, args={"mode": "raise"})
    assert not result.ok and not result.timed_out
    assert "rank two broke" in result.outcomes[2].error
    assert _children() == []


def test_timeout_kills_every_worker():
    start = time.monotonic()
    result = launch(_allreduce, 4, timeout_s=3, args={"mode": "hang"})
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < 20
    assert "killed at timeout" in result.outcomes[1].error
    assert result.outcomes[1].exitcode == -9
    assert _children() == []


def test_grandchildren_die_with_their_worker():
    result = launch(_allreduce, 2, timeout_s=30, args={"mode": "spawn_child"})
    assert result.ok, result.failures()
    time.sleep(0.2)
    for pid in result.values():
        assert _state(pid) in (None, "Z"), f"grandchild {pid} still running"  # dead; init may reap late


def _exchange(ctx: RankContext):
    init_gloo(ctx)
    out = {}
    sigs = [100, 200, 300]
    if ctx.rank == 3:
        sigs[1] = 999
    out["exact"] = [r.to_dict() for r in c3_exchange(sigs, surfaces=["a", "b", "c"])]
    timing = 1.0 if ctx.rank != 4 else 3.0
    out["timing"] = c3_exchange([timing], rule=StatisticalRule(min_delta=0.0))[0].to_dict()
    # A 3-rank subgroup (ranks 0, 2, 4): peer order maps to global ranks.
    groups = [[0, 2, 4], [1, 3, 5]]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    value = 7 if ctx.rank != 4 else 8
    out["sub"] = c3_exchange([value], group=mine, surfaces=["x"])[0].to_dict()
    try:
        c3_exchange([1] * (1 if ctx.rank else 2), surfaces=None)
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    # A member that already failed joins with None (and other surfaces than its peers would send): nobody
    # compares, nobody raises, and the group goes on to its next collective.
    failed = c3_exchange_unless_failed(None if ctx.rank == 5 else [1, 2], surfaces=["a"] if ctx.rank == 5 else
                                       ["a", "b"])
    healthy = c3_exchange_unless_failed([ctx.rank == 3], surfaces=["flag"])
    # Evidence of one member's that cannot travel (not plain data) fails on that member alone, after it joined.
    try:
        unsendable = c3_exchange_unless_failed([object() if ctx.rank == 2 else 1], surfaces=["x"])
    except Exception as exc:  # noqa: BLE001 - which error is the wire's business; that it is raised here is ours
        unsendable = type(exc).__name__
    out["unless_failed"] = [failed, [r.status.value for r in healthy], unsendable]
    # Members that sent other surfaces fail every member alike inside a check: one record, by the group's first rank.
    records: list = []
    guard = DiagnosisGuard(None, rank=ctx.rank, reporter=SimpleNamespace(emit=records.append))
    guard.attempt("evidence exchange", lambda: c3_exchange_unless_failed([1] * (2 if ctx.rank == 2 else 1)))
    out["agreed"] = guard.agree(7)
    out["records"] = [(i.ranks, i.reason) for i in records]
    # An optional part with a collective (replay's timed all-reduce) is run by every rank or by none.
    fresh = DiagnosisGuard(None, rank=ctx.rank, reporter=None)
    out["asked"] = [fresh.agree_and_ask(8, skip=False, ask=ctx.rank == 3),
                    fresh.agree_and_ask(9, skip=False, ask=False),
                    fresh.agree_and_ask(10, skip=ctx.rank == 1, ask=ctx.rank != 1)]
    return out


def test_c3_exchange_k_surfaces_identical_everywhere():
    result = launch(_exchange, 6, timeout_s=60)
    assert result.ok, result.failures()
    values = result.values()
    for v in values[1:]:
        assert v["exact"] == values[0]["exact"] and v["timing"] == values[0]["timing"]
    a, b, c = values[0]["exact"]
    assert (a["status"], b["status"], c["status"]) == ("agree", "attributed", "agree")
    assert b["bitmap"] == [0, 0, 0, 1, 0, 0] and b["surface"] == "b"
    assert values[0]["timing"]["bitmap"] == [0, 0, 0, 0, 1, 0]
    assert values[0]["sub"]["peer_ranks"] == [0, 2, 4] and values[0]["sub"]["bitmap"] == [0, 0, 1]
    assert values[1]["sub"]["peer_ranks"] == [1, 3, 5] and values[1]["sub"]["status"] == C3Status.AGREE.value
    assert all("mismatch" in (v["mismatch"] or "") for v in values)
    assert len({v["mismatch"] for v in values}) == 1, "every member says the same of a mismatch"
    assert [v["agreed"] for v in values] == [False] * 6
    assert [len(v["records"]) for v in values] == [1, 0, 0, 0, 0, 0]
    assert "ranks [2] sent 2 surfaces" in values[0]["records"][0][1] and values[0]["records"][0][0] == [0]
    assert all(v["unless_failed"][:2] == [None, ["attributed"]] for v in values)
    assert all(v["asked"] == [("ok", True), ("ok", False), ("skip", False)] for v in values)
    assert [v["unless_failed"][2] is None for v in values] == [True, True, False, True, True, True]


def _nap(ctx):
    import time as _time

    _time.sleep(1.0)
    return ctx.rank


def test_the_heartbeat_runs_on_the_launching_thread_while_ranks_run(monkeypatch):
    import threading

    from scout_core.testing import launcher as launcher_module

    beats = []
    monkeypatch.setattr(launcher_module, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(launcher_module, "heartbeat", lambda: beats.append(threading.current_thread().name))
    result = launcher_module.launch(_nap, 2, timeout_s=30)
    assert result.ok and sorted(result.values()) == [0, 1]
    assert len(beats) >= 3 and set(beats) == {threading.current_thread().name}
