"""The caller's state is checked at the first capture: a restart's torch.load(weights_only=True) must load it."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from scout_core.checkpoint.loadable import CallerStateCheck, refused
from scout_core.testing.launcher import RankContext, launch


class Scheduler:
    """A scheduler-like object whose state_dict() holds a numpy array and a slice (or only plain values)."""

    def __init__(self, clean: bool = False) -> None:
        self.clean, self.last_epoch = clean, 0

    def state_dict(self):
        if self.clean:
            return {"last_epoch": self.last_epoch, "base_lrs": [0.1], "window": (0, 4)}
        return {"last_epoch": self.last_epoch, "base_lrs": [0.1], "decay": np.array([0.5, 0.25]),
                "window": slice(0, 4)}

    def load_state_dict(self, state):
        self.last_epoch = state["last_epoch"]

    def step(self):
        self.last_epoch += 1


def test_the_check_names_the_state_key_the_key_path_and_the_type():
    check = CallerStateCheck()
    problem = check.check({"sched": Scheduler().state_dict(), "data": {"epoch": 1}})
    assert problem is not None
    assert "state['sched'] at ['decay']: numpy.ndarray" in problem
    assert "state['sched'] at ['window']: slice" in problem
    assert "data" not in problem  # the clean object is not named
    assert check.check({"sched": Scheduler(clean=True).state_dict()}) is None  # a clean state passes
    assert check.passed == {frozenset({"sched"})}  # ... and its set of keys is trusted from then on
    nested = refused({"sampler": {"perm": [1, np.int64(2)], np.int64(3): "x"}})
    assert nested[0] == ("['sampler']['perm'][1]", "numpy.int64")
    assert nested[1][0].startswith("['sampler'][") and nested[1][0].endswith("(the key)") and len(nested) == 2
    assert check.first_report(problem) and not check.first_report(problem)  # one record per problem


def _enabled(ctx: RankContext):
    import scout_core
    from integrations_tests.models import batches, start_rank
    from scout_core.config import load

    a, _, par, opt = start_rank(ctx)
    out = {}
    for kind in ("numpy", "clean"):
        d = os.path.join(a["dir"], kind)
        cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                          "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=true",
                          # every capture after a layer check is persisted (as verified): the first one at
                          # step 1, which no earlier write can make busy, whatever the machine's load
                          "checkpoint.certify=last_check_only",
                          f"checkpoint.directory={d}/ckpt", f"checkpoint.memory_dir={d}/shm",
                          f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
        sched = Scheduler(clean=kind == "clean")
        handle = scout_core.enable(par.model, opt, config=cfg, state={"sched": sched})
        handle.resume()
        for x, y in handle.wrap_dataloader(list(batches(ctx.rank, 3))):
            torch.nn.functional.mse_loss(par.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        handle.close()
        records = [json.loads(line) for line in open(f"{d}/inc.jsonl")] if os.path.exists(f"{d}/inc.jsonl") else []
        out[kind] = {"errors": [(r["step"], r["evidence"]["message"]) for r in records
                                if r["kind"] == "diagnosis_error" and r["ranks"] == [ctx.rank]],
                     "slots": sorted(name for _, _, names in os.walk(f"{d}/shm") for name in names),
                     "store": handle.checkpoint.store.local_generations()}
    return out


def test_unloadable_caller_state_is_reported_at_the_first_capture_and_never_kept(tmp_path):
    result = launch(_enabled, 2, timeout_s=180, args={"faults": [], "seed": 0, "layout": "ddp",
                                                      "dir": str(tmp_path)})
    assert result.ok, result.failures()
    for v in result.values():
        bad = v["numpy"]
        assert len(bad["errors"]) == 1, bad["errors"]  # once, at the first capture, not at each one
        step, message = bad["errors"][0]
        assert step == 1, bad["errors"]
        assert "state['sched'] at ['decay']: numpy.ndarray" in message and "['window']: slice" in message
        assert "torch.load(weights_only=True)" in message
        assert bad["store"] == {}  # nothing a restart would fail to load was written
        assert not any(name.startswith("own-") for name in bad["slots"]), bad["slots"]
        clean = v["clean"]
        assert clean["errors"] == [] and clean["store"], clean
        assert any(name.startswith("own-") for name in clean["slots"]), clean["slots"]  # the walk finds slots
