"""The coordinator over real gloo ranks: job-wide agreement, replicas, persistence, decisions."""

from __future__ import annotations

import json
import os

import torch

from scout_core.checkpoint.certify import BoundaryEvidence, Certifier
from scout_core.checkpoint.coordinator import CheckpointCoordinator, load_latest, memory_dir_for, partners
from scout_core.checkpoint.snapshot import SnapshotEngine, restore_state
from scout_core.checkpoint.store import DurableStore, agree_on_generation
from scout_core.launcher import RankContext, init_gloo, launch
from scout_core.signature import sign_many


def test_partners_cross_machines_for_any_world_size():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}
    p = partners(hosts)
    assert all(hosts[r] != hosts[p[r]] for r in hosts)
    assert sorted(p) == [0, 1, 2, 3, 4]
    assert partners({0: "a", 1: "a", 2: "a"}) == {0: 1, 1: 2, 2: 0}
    assert partners({0: "solo"}) == {}


def _sig(net):
    return [s.signature for s in sign_many([p.detach() for p in net.parameters()])]


def _job(ctx: RankContext):
    init_gloo(ctx)
    a = ctx.args
    torch.manual_seed(ctx.rank)
    net = torch.nn.Linear(6, 6)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    hosts = {r: "hostA" if r < 2 else "hostB" for r in range(ctx.world_size)}
    store = DurableStore(a["root"], ctx.rank, ctx.world_size)
    coord = CheckpointCoordinator(SnapshotEngine([net], [opt]), store, Certifier(recipes_per_cycle=2),
                                  run_id=a["run"], hosts=hosts, decisions_path=a["decisions"])
    sigs, actions = {}, []
    for step in range(1, 6):
        net(torch.randn(3, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        sigs[step] = _sig(net)
        local = BoundaryEvidence(sdc=(step == 5 and ctx.rank == 1))
        actions.append(coord.on_boundary(step, local).value)
    coord.flush()
    decision = coord.decide("sdc", incident={"ranks": [1]})
    gen = agree_on_generation(store, "verified")
    fresh = torch.nn.Linear(6, 6)
    restore_state([fresh], [torch.optim.AdamW(fresh.parameters(), lr=0.1)], store.load(gen))
    latest = load_latest(a["run"], ctx.rank)
    disagree = None
    try:  # a rank that believes it is at a cycle boundary while the others do not
        coord.certifier.q = 1 if ctx.rank == 3 else 0
        coord.on_boundary(6, BoundaryEvidence())
    except RuntimeError as exc:
        disagree = str(exc)
    replicas = sorted(f for f in os.listdir(memory_dir_for(a["run"])) if "replica" in f)
    return {"actions": actions, "decision": (decision.source, decision.generation), "gen": gen,
            "restored_ok": _sig(fresh) == sigs[gen], "latest_step": latest["step"], "disagree": disagree,
            "roles": store.local_generations(), "replicas": replicas}


def test_coordinator_end_to_end(tmp_path):
    run = f"coordtest{os.getpid()}"
    args = {"root": str(tmp_path / "store"), "run": run, "decisions": str(tmp_path / "decisions.jsonl")}
    try:
        result = launch(_job, 4, timeout_s=120, args=args)
    finally:
        import shutil

        shutil.rmtree(memory_dir_for(run), ignore_errors=True)
    assert result.ok, result.failures()
    for v in result.values():
        assert v["actions"] == ["capture", "capture_and_persist", "capture", "capture_and_persist", "recover"]
        assert v["decision"] == ("verified", 2) and v["gen"] == 2 and v["restored_ok"]
        assert v["latest_step"] == 4
        assert "disagree" in v["disagree"]
        assert v["roles"] == {2: "verified", 4: "candidate"}
    assert len(result.values()[0]["replicas"]) >= 4  # every rank's snapshot has a replica
    records = [json.loads(line) for line in open(args["decisions"])]
    assert len(records) == 1 and records[0]["source"] == "verified" and "SDC" in records[0]["reason"]
