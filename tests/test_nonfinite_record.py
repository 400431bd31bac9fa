"""A state gone non-finite on every replica is recorded at the shipped defaults (checkpoints off): once per episode,
naming no host to exclude, and again in a later episode."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

import scout_core
from integrations_tests.models import batches, start_rank
from scout_core.config import load
from scout_core.report import read_incidents
from scout_core.testing.launcher import RankContext, launch, prepare_parent

NAN_FROM = {3: 6, 8: 10}  # two episodes: steps 3-5 (the state restored after step 5) and steps 8-9


def _rank(ctx: RankContext) -> dict[str, Any]:
    a, _injector, par, opt = start_rank(ctx)
    cfg = load(None, ["replay.cadence.hidden=1", "replay.cadence.embedding=1", "replay.cadence.output=1",
                      "replay.cadence.optimizer=1", "observer.enabled=false", "report.log_level=ERROR",
                      f"report.jsonl_path={a['dir']}/incidents.jsonl"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    head = par.inner.head.weight
    healthy = None
    for step, (x, y) in enumerate(batches(ctx.rank, 9, seed=0), start=1):
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # every replica alike, as averaged NaN gradients leave them
            if step + 1 in NAN_FROM:  # NaN from the next step on: the loss, then every weight
                healthy = ([p.detach().clone() for p in par.model.parameters()], copy.deepcopy(opt.state_dict()))
                head[0, 0] = float("nan")
            elif step + 1 in NAN_FROM.values():  # restored, as a restart would: a new episode may begin
                for p, w in zip(par.model.parameters(), healthy[0], strict=True):
                    p.copy_(w)
                opt.load_state_dict(healthy[1])
    handle.close()
    return {"exclusions": os.path.exists(os.path.join(a["dir"], "exclude_hosts.json"))}


def test_a_state_gone_non_finite_is_recorded_once_per_episode(tmp_path):
    prepare_parent()
    result = launch(_rank, 2, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp", "dir": str(tmp_path)})
    assert result.ok, result.failures()
    records = [i for i in read_incidents(tmp_path / "incidents.jsonl") if i.surface == "state.nonfinite"]
    assert [(i.step, i.kind.value, i.scope.value, i.ranks) for i in records] == [
        (3, "inconclusive", "job", [0, 1]), (8, "inconclusive", "job", [0, 1])]  # not at 4, 5 or 9
    assert "replay cannot name its cause" in records[0].reason and "checkpoints are off" in records[0].reason
    assert not any(v["exclusions"] for v in result.values())  # a job-scoped record excludes no host
