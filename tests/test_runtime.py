"""The composition root over real gloo ranks: one enable(), every key read, clean close, actions, skips."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from scout_core import config as config_module
from scout_core import config_schema
from scout_core.testing.launcher import RankContext, launch


def _leaf_keys(klass: type, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(klass):
        factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if factory is not None and dataclasses.is_dataclass(factory):
            out |= _leaf_keys(factory, f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def _section_of() -> dict[type, str]:
    out = {}

    def walk(klass: type, prefix: str) -> None:
        out[klass] = prefix
        for f in dataclasses.fields(klass):
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if factory is not None and dataclasses.is_dataclass(factory):
                walk(factory, f"{prefix}{f.name}.")

    walk(config_module.ScoutConfig, "")
    return out


def _record_reads() -> set[str]:
    """Record config attribute reads made OUTSIDE scout_core.config and its schema (validation reads everything)."""
    reads: set[str] = set()
    sections = _section_of()
    for klass, prefix in sections.items():
        names = {f.name for f in dataclasses.fields(klass)}

        def getattribute(self, name, _prefix=prefix, _names=names, _orig=object.__getattribute__):
            reader = sys._getframe(1).f_globals.get("__name__")
            if name in _names and reader not in (config_module.__name__, config_schema.__name__):
                reads.add(_prefix + name)
            return _orig(self, name)

        klass.__getattribute__ = getattribute
    return reads


def _children() -> set[int]:
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return {int(p) for p in fh.read().split()}


def _own_shm() -> list[str]:
    """This process's files in /dev/shm (other ranks of the test share the directory)."""
    return sorted(n for n in os.listdir("/dev/shm") if f"-p{os.getpid()}" in n)


def _model_hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())
    return n + len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def _train(model, opt, steps, rank):
    from integrations_tests.models import batches

    for x, y in batches(rank, steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _lifecycle(ctx: RankContext):
    import scout_core
    from integrations_tests.models import start_rank
    from scout_core.config import load

    a, _, par, opt = start_rank(ctx)
    reads = _record_reads()
    d = a["dir"]
    cfg = load(None, ["replay.cadence.embedding=1", "replay.cadence.hidden=1", "replay.cadence.output=1",
                      "replay.cadence.optimizer=1", "observer.silence_threshold_s=30", "checkpoint.enabled=true",
                      f"checkpoint.directory={d}/ckpt", f"checkpoint.memory_dir={d}/shm",
                      f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    reads.clear()  # loading reads every key (OmegaConf builds the objects): only what SCOUT's parts read counts
    dist.barrier()
    before = {"hooks": _model_hooks(par.model, opt), "threads": threading.active_count(),
              "children": len(_children()), "shm": _own_shm(),
              "groups": len(dist.distributed_c10d._world.pg_map), "all_reduce": dist.all_reduce}
    handle = scout_core.enable(par.model, opt, config=cfg)
    during = {"children": len(_children()), "hooks": _model_hooks(par.model, opt)}
    second = None
    try:
        scout_core.enable(par.model, opt, config=cfg)
    except RuntimeError as exc:
        second = str(exc)
    handle.resume()
    _train(par.model, opt, 3, ctx.rank)
    handle.close(discard_snapshots=True)
    handle.close()  # idempotent
    after = {"hooks": _model_hooks(par.model, opt), "threads": threading.active_count(),
             "children": len(_children()), "shm": _own_shm(),
             "groups": len(dist.distributed_c10d._world.pg_map), "all_reduce": dist.all_reduce}
    again = scout_core.enable(par.model, opt, config=cfg)  # allowed once the first handle is closed
    again.close(discard_snapshots=True)
    leftovers = sorted(os.listdir(f"{d}/shm")) if os.path.isdir(f"{d}/shm") else []
    return {"before": {k: v for k, v in before.items() if k != "all_reduce"},
            "after": {k: v for k, v in after.items() if k != "all_reduce"},
            "same_all_reduce": before["all_reduce"] is after["all_reduce"], "during": during, "second": second,
            "reads": sorted(reads), "leftovers": leftovers}


READ_AT_FRAMEWORK_RESTART = {"checkpoint.load_rejected"}
"""Read where a framework's restart names its checkpoint (the plugins' load paths, each with its test), never in
this job's lifecycle."""


def test_enable_builds_everything_reads_every_key_and_close_removes_everything(tmp_path):
    result = launch(_lifecycle, 2, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                        "dir": str(tmp_path)})
    assert result.ok, result.failures()
    for v in result.values():
        assert v["second"] and "already enabled" in v["second"]
        assert v["during"]["children"] == v["before"]["children"] + 1  # the observer
        assert v["during"]["hooks"] > v["before"]["hooks"]
        assert v["after"] == v["before"], "close() must leave no hook, thread, process, /dev/shm file or group"
        assert v["same_all_reduce"]
        assert v["leftovers"] == []
    unread = _leaf_keys(config_module.ScoutConfig) - set(result.values()[0]["reads"]) - READ_AT_FRAMEWORK_RESTART
    assert not unread, f"configuration keys that nothing reads: {sorted(unread)}"


def test_a_clean_run_leaves_start_and_end_records_that_scout_report_reads(tmp_path, capsys):
    """A run that found nothing writes no incident record; rank 0's life-cycle records say what ran and what was
    checked, and ``scout report`` answers with them instead of "no such file"."""
    from scout_core.cli import main
    from scout_core.run_log import read_run_log

    result = launch(_lifecycle, 2, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                        "dir": str(tmp_path)})
    assert result.ok, result.failures()
    assert not (tmp_path / "inc.jsonl").exists()
    records = read_run_log(str(tmp_path / "inc.run.jsonl"))
    assert [r["record"] for r in records] == ["start", "end", "start", "end"]  # rank 0 only; two launches
    start, end = records[0], records[1]
    assert start["world_size"] == 2 and start["parts"]["observer"] and start["parts"]["snapshots"]
    assert start["recipes"] == ["embedding every 1", "hidden every 1", "output every 1", "optimizer every 1"]
    assert (end["ended"], end["steps"], end["checks"], end["agreed"]) == ("closed", 3, 3, 3)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "inc.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "ended (closed) after 3 steps, 3 replay checks (3 agreed by every peer)" in out
    assert "no incidents recorded" in out
    assert main(["report", str(tmp_path / "elsewhere.jsonl")]) == 2  # a wrong path is still an error
    assert "no SCOUT run wrote its records here" in capsys.readouterr().err


def _verdict_log(ctx: RankContext):
    import scout_core
    from integrations_tests.models import install_block_faults, start_rank
    from scout_core.config import load
    from scout_core.runtime import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"host{ctx.rank // 2}"
    a, injector, par, opt = start_rank(ctx)
    state = {"step": 0}
    install_block_faults(par, injector, ctx.rank, state)
    d = a["dir"]
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=true",
                      f"checkpoint.directory={d}/ckpt", f"report.jsonl_path={d}/inc.jsonl",
                      "report.log_level=ERROR", "actions.on_verdict=log"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    steps = 0
    from integrations_tests.models import batches

    for step, (x, y) in enumerate(batches(ctx.rank, 9), start=1):
        state["step"] = step
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        handle.flush()  # each capture written before the next boundary: exact generations, no "busy" skip
        steps += 1
    decision = handle.last_decision
    handle.close(discard_snapshots=True)
    return {"steps": steps, "decision": (decision.source, decision.generation) if decision else None}


def test_log_action_keeps_training_and_writes_decision_and_hosts_to_exclude(tmp_path):
    from scout_core.testing.inject import Fault

    # Coverage is the three blocks (one a step): candidate 3, verified 3 at step 6; block 1 is replayed at step 8.
    faults = [Fault.from_dict({"surface": "layers.1.output", "rank": 2, "kind": "bitflip", "bit": 22, "from_step": 8})]
    result = launch(_verdict_log, 4, timeout_s=120, args={"faults": faults, "seed": 0, "layout": "ddp",
                                                          "dir": str(tmp_path)})
    assert result.ok, result.failures()
    assert [v["steps"] for v in result.values()] == [9] * 4  # log: training goes on
    assert {v["decision"] for v in result.values()} == {("verified", 3)}
    excluded = json.loads((tmp_path / "ckpt" / "exclude_hosts.json").read_text())
    assert excluded["hosts"] == ["host1"] and excluded["ranks"] == [2] and excluded["drain"] == ["host1"]
    assert [v["kind"] for v in excluded["verdicts"]] == ["sdc"]


class _LayerDrop(torch.nn.Module):
    """A conditional block (layer drop / early exit): skipped entirely at the given steps."""

    def __init__(self, block, skip_steps, state):
        super().__init__()
        self.block, self.skip_steps, self.state = block, skip_steps, state

    def forward(self, x):
        return x if self.state["step"] in self.skip_steps else self.block(x)


def _conditional(ctx: RankContext):
    import scout_core
    from integrations_tests.models import TinyModel, batches
    from scout_core.config import load
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx)
    torch.manual_seed(0)
    state = {"step": 0}
    inner = TinyModel()
    blocks = list(inner.layers)
    inner.layers = torch.nn.ModuleList(blocks)
    sampled = blocks[1]
    original_forward = inner.forward

    def forward(x):  # block 1 does not run at step 2, when the engine samples it
        h = inner.embed(x)
        for i, layer in enumerate(inner.layers):
            if i == 1 and state["step"] == 2:
                continue
            h = layer(h)
        return inner.head(h)

    inner.forward = forward
    model = torch.nn.parallel.DistributedDataParallel(inner, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    d = ctx.args["dir"]
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=true",
                      f"checkpoint.directory={d}/ckpt", f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    handle = scout_core.enable(model, opt, config=cfg)
    for step, (x, y) in enumerate(batches(ctx.rank, 4), start=1):
        state["step"] = step
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {"history": [(r.step, r.skipped) for r in handle.replay.history],
           "certifier": [h[1] for h in handle.checkpoint.certifier.history], "sampled": sampled is blocks[1]}
    inner.forward = original_forward
    handle.close(discard_snapshots=True)
    return out


def test_sampled_layer_that_did_not_run_skips_the_check_on_every_peer(tmp_path):
    result = launch(_conditional, 4, timeout_s=120, args={"dir": str(tmp_path)})
    assert result.ok, result.failures()
    for v in result.values():
        skipped = {s: why for s, why in v["history"] if why}
        assert list(skipped) == [2] and "did not run on the source" in skipped[2]
        assert "skip: evidence missing (this check's units do not count)" in v["certifier"]
    assert not (tmp_path / "inc.jsonl").exists()  # a skip is not an incident, and not an error


def test_small_shm_falls_back_to_disk_and_says_so(tmp_path, monkeypatch, caplog):
    from scout_core.checkpoint.memory import MemorySlots

    slots = MemorySlots(str(tmp_path / "shm"), rank=0, hosts={0: "h"}, fallback=str(tmp_path / "disk"))

    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free, like a container's small /dev/shm

    monkeypatch.setattr(os, "statvfs", lambda _p: Tiny())
    with caplog.at_level("WARNING", logger="scout"):
        slots.ensure_space(10 * 2**20, copies=2)
    assert slots.root == str(tmp_path / "disk") and os.path.isdir(slots.dir)
    assert "using" in slots.fell_back and "MiB" in slots.fell_back
    assert any("/dev/shm" in r.getMessage() for r in caplog.records)
    slots2 = MemorySlots(str(tmp_path / "shm2"), rank=0, hosts={0: "h"}, fallback=str(tmp_path / "disk2"))
    monkeypatch.setattr(os, "statvfs", lambda _p: type("Big", (), {"f_bavail": 2**30, "f_frsize": 4096})())
    slots2.ensure_space(10 * 2**20, copies=2)
    assert slots2.fell_back == "" and slots2.root == str(tmp_path / "shm2")


def _resume_equals_uninterrupted(ctx: RankContext):
    import scout_core
    from integrations_tests.models import batches, start_rank
    from scout_core.config import load
    from scout_core.signature import sign_many

    a, _, par, opt = start_rank(ctx)
    if a["phase"] == "resumed":  # other initial weights: everything must come from the snapshot
        with torch.no_grad():
            for p in par.model.parameters():
                p.add_(1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    d = a["dir"]
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=true",
                      f"checkpoint.directory={d}/{a['phase'] != 'uninterrupted'}",
                      f"checkpoint.memory_dir={d}/shm-{a['phase'] != 'uninterrupted'}", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg, state={"scheduler": sched})
    start = handle.resume().next_step
    lrs = []
    data = list(batches(ctx.rank, 6))
    for x, y in handle.wrap_dataloader(data[start:a["stop_after"]]):
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()  # after the optimizer step, as every training loop does
        lrs.append(opt.param_groups[0]["lr"])
    handle.close(discard_snapshots=a["phase"] != "interrupted")
    return {"start": start, "lrs": lrs, "params": [s.signature for s in sign_many(
        [p.detach() for p in par.model.parameters()])], "adam": [s.signature for s in sign_many(
        [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)])]}


def test_resumed_job_continues_bitwise_like_an_uninterrupted_one(tmp_path):
    args = {"faults": [], "seed": 0, "layout": "ddp", "dir": str(tmp_path)}
    whole = launch(_resume_equals_uninterrupted, 2, timeout_s=120,
                   args={**args, "phase": "uninterrupted", "stop_after": 6})
    first = launch(_resume_equals_uninterrupted, 2, timeout_s=120, args={**args, "phase": "interrupted",
                                                                            "stop_after": 4})
    second = launch(_resume_equals_uninterrupted, 2, timeout_s=120, args={**args, "phase": "resumed",
                                                                             "stop_after": 6})
    for r in (whole, first, second):
        assert r.ok, r.failures()
    for w, f, s in zip(whole.values(), first.values(), second.values()):
        # Usually step 4; earlier when a capture was skipped because the previous one was still being written.
        assert 1 <= s["start"] <= 4
        assert f["lrs"][:s["start"]] + s["lrs"] == w["lrs"]  # the scheduler resumed where it was at that step
        assert s["params"] == w["params"] and s["adam"] == w["adam"]


def _output_only(ctx: RankContext):
    import scout_core
    from integrations_tests.models import batches, start_rank
    from scout_core.config import load

    a, _injector, par, opt = start_rank(ctx)
    state = {"step": 0}

    def flip(_m, _a, out):  # a defective unit in the LM head's matmul on rank 2, from step 2 on
        if ctx.rank == 2 and state["step"] >= 2:
            with torch.no_grad():
                out.view(torch.int32).view(-1)[0] ^= 1 << 22

    par.inner.head.register_forward_hook(flip)
    d = a["dir"]
    # The output recipe on its own cadence: steps 2 and 4 check only the head, never a hidden layer.
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=3", "replay.cadence.output=2",
                      "replay.cadence.optimizer=0", "observer.enabled=false",
                      f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    for step, (x, y) in enumerate(batches(ctx.rank, 2), start=1):
        state["step"] = step
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    recipes = [(r.step, r.recipes) for r in handle.replay.history]
    handle.close()
    return recipes


def test_a_check_without_the_hidden_recipe_still_records_its_sdc(tmp_path):
    from scout_core.report import read_incidents

    result = launch(_output_only, 4, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                         "dir": str(tmp_path)})
    assert result.ok, result.failures()
    assert result.values()[0] == [(2, ("output",))]
    got = [(i.kind.value, i.ranks, i.step) for i in read_incidents(tmp_path / "inc.jsonl")]
    assert got == [("sdc", [2], 2)]


def _dirty_sweep(ctx: RankContext):
    import scout_core
    from integrations_tests.models import batches, start_rank
    from scout_core.config import load
    from scout_core.signature import sign_many

    a, _, par, opt = start_rank(ctx)
    phase = a["phase"]
    if phase != "first":  # the restarted job's own initial weights: what a dirty sweep must leave loaded
        with torch.no_grad():
            for p in par.model.parameters():
                p.add_(1.0)
    state = {"step": 0}

    def flip(_m, _a, out):  # rank 2's block 2 is defective from step 3 on; only block 0 is ever sampled
        if ctx.rank == 2 and phase != "third" and (phase == "second" or state["step"] >= 3):
            with torch.no_grad():
                out.view(torch.int32).view(-1)[0] ^= 1 << 22

    par.inner.layers[2].fc.register_forward_hook(flip)
    d = a["dir"]
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=4", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=true",
                      # coverage needs every block (three checks): the one check of the first job verifies nothing
                      f"checkpoint.directory={d}/ckpt", f"checkpoint.memory_dir={d}/shm",
                      f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    before = [s.signature for s in sign_many([p.detach() for p in par.model.parameters()])]
    out = {}
    if phase == "first":  # trains 4 steps (one clean check at step 4 captures the only snapshot), then dies
        for step, (x, y) in enumerate(batches(ctx.rank, 4), start=1):
            state["step"] = step
            torch.nn.functional.mse_loss(par.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            handle.flush()
        out["inventory"] = handle.checkpoint.memory.inventory()
    else:
        result = handle.resume()
        out["step"], out["reason"] = result.step, result.reason
        out["unchanged"] = before == [s.signature for s in sign_many([p.detach() for p in par.model.parameters()])]
        dist.barrier()  # the machine's folder is shared: every rank has dropped its slots
        out["inventory"] = handle.checkpoint.memory.inventory()
    handle.close()  # a crash keeps the slots: no discard
    return out


def test_a_dirty_emergency_sweep_without_a_verified_generation_leaves_nothing_unsafe(tmp_path):
    from scout_core.report import read_incidents

    args = {"faults": [], "seed": 0, "layout": "ddp", "dir": str(tmp_path)}
    first = launch(_dirty_sweep, 4, timeout_s=120, args={**args, "phase": "first"})
    assert first.ok, first.failures()
    assert {v["inventory"]["own"] for v in first.values()} == {4}
    second = launch(_dirty_sweep, 4, timeout_s=120, args={**args, "phase": "second"})
    assert second.ok, second.failures()
    for v in second.values():
        assert v["step"] is None and "nothing restored" in v["reason"], v["reason"]
        assert v["unchanged"], "the suspect latest state stayed loaded after a dirty sweep"
        assert v["inventory"] == {"own": None, "replicas": {}}
    swept = [(i.kind.value, tuple(i.ranks)) for i in read_incidents(tmp_path / "inc.jsonl")]
    assert swept and set(swept) == {("sdc", (2,))}
    third = launch(_dirty_sweep, 4, timeout_s=120, args={**args, "phase": "third"})  # a second restart
    assert third.ok, third.failures()
    assert {(v["step"], v["unchanged"]) for v in third.values()} == {(None, True)}


def _crashing_step(ctx: RankContext):
    import scout_core
    from integrations_tests.models import start_rank
    from scout_core.config import load

    a, _, par, opt = start_rank(ctx)
    d = a["dir"]
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.silence_threshold_s=30", "checkpoint.enabled=true",
                      f"checkpoint.directory={d}/ckpt", f"checkpoint.memory_dir={d}/shm",
                      f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    before = {"hooks": _model_hooks(par.model, opt), "threads": threading.active_count(),
              "children": len(_children()), "shm": _own_shm()}

    class Broken:  # a data loader whose position cannot be read
        def state_dict(self):
            raise ValueError("the caller's state cannot be read")

        def load_state_dict(self, _state):
            pass

    handle = scout_core.enable(par.model, opt, config=cfg, state={"loader": Broken()})
    real_close = handle.replay.close

    def failing_close():  # one clean-up step fails: the others must still run, the training error must win
        real_close()
        raise RuntimeError("replay clean-up failed")

    handle.replay.close = failing_close
    raised = None
    start = time.monotonic()
    try:
        try:
            _train(par.model, opt, 2, ctx.rank)
            # The training step after a boundary fails (a bug or out of memory in the forward) on every rank.
            raise MemoryError("training ran out of memory")
        finally:
            handle.close()  # in the exception handler: must not wait for peers nor skip clean-up
    except MemoryError as exc:
        raised = str(exc)
    after = {"hooks": _model_hooks(par.model, opt), "threads": threading.active_count(),
             "children": len(_children()), "shm": _own_shm()}
    again = scout_core.enable(par.model, opt, config=cfg)  # the handle was released
    again.close()
    return {"raised": raised, "same": before == after, "before": before, "after": after,
            "close_s": time.monotonic() - start}


def test_close_in_an_exception_handler_cleans_up_and_lets_the_error_through(tmp_path):
    result = launch(_crashing_step, 2, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                           "dir": str(tmp_path)})
    assert result.ok, result.failures()
    values = result.values()
    for v in values:
        assert v["raised"] == "training ran out of memory"
        assert v["same"], (v["before"], v["after"])


def _unhealthy(ctx: RankContext):
    import scout_core
    from integrations_tests.models import batches, start_rank
    from scout_core.config import load
    from scout_core.replay.optimizer import OptimizerSlice

    a, _, par, opt = start_rank(ctx)
    d = a["dir"]
    if a["case"] == "optimizer":  # the optimizer replay cannot work for this optimizer, on one rank
        real = OptimizerSlice.after_step

        def after_step(self):
            if ctx.rank == 1:
                raise ValueError("this optimizer cannot be replayed on a slice")
            return real(self)

        OptimizerSlice.after_step = after_step
    else:  # blocks called around their hooks, as code compiled before enable() does: captures never fire
        inner = par.inner

        def forward(x):
            h = inner.embed(x)
            for layer in inner.layers:
                h = layer.forward(h)
            return inner.head(h)

        inner.forward = forward
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=1", "replay.optimizer_slice_elems=64", "observer.enabled=false",
                      f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    for x, y in batches(ctx.rank, 6):
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = [(r.step, r.recipes, r.skipped) for r in handle.replay.history]
    handle.close()
    return out


def test_a_recipe_that_always_fails_is_switched_off_and_the_others_go_on(tmp_path):
    from scout_core.replay.health import FAILURES_BEFORE_OFF
    from scout_core.report import read_incidents

    result = launch(_unhealthy, 4, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                       "dir": str(tmp_path), "case": "optimizer"})
    assert result.ok, result.failures()
    for history in result.values():
        assert [s for s, _, why in history if why] == list(range(1, FAILURES_BEFORE_OFF + 1))
        assert [(s, r) for s, r, why in history if not why] == [
            (s, ("hidden",)) for s in range(FAILURES_BEFORE_OFF + 1, 7)]
    records = [(i.kind.value, i.scope.value, i.ranks, i.surface) for i in read_incidents(tmp_path / "inc.jsonl")]
    assert records[-1] == ("diagnosis_error", "job", [], "replay:optimizer")
    assert {r[2][0] for r in records[:-1]} == {1} and len(records) == FAILURES_BEFORE_OFF + 1


def test_a_run_of_skipped_checks_is_reported_once(tmp_path):
    from scout_core.replay.health import SKIPS_BEFORE_RECORD
    from scout_core.report import read_incidents

    result = launch(_unhealthy, 4, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                       "dir": str(tmp_path), "case": "uncaptured"})
    assert result.ok, result.failures()
    assert all(why for v in result.values() for _, _, why in v)  # nothing could be checked
    records = [(i.kind.value, i.surface, i.step) for i in read_incidents(tmp_path / "inc.jsonl")]
    assert records == [("diagnosis_error", "replay:coverage", SKIPS_BEFORE_RECORD)]


def test_replica_groups_must_be_unions_of_peer_groups_that_partition_the_ranks():
    from scout_core.runtime import _check_replica_groups

    peers = [[0, 2], [1, 3]]
    assert _check_replica_groups([[0, 1, 2, 3]], peers, 4) == [[0, 1, 2, 3]]
    assert _check_replica_groups(None, peers, 4) is None
    assert _check_replica_groups([[2, 0], [3, 1]], peers, 4) is None  # the peer groups themselves: nothing added
    with pytest.raises(ValueError, match="not a union of peer groups"):
        _check_replica_groups([[0, 1], [2, 3]], peers, 4)
    with pytest.raises(ValueError, match="partition ranks 0..3"):
        _check_replica_groups([[0, 1, 2]], peers, 4)


def _verdict_before_the_first_save(ctx: RankContext):
    import scout_core
    from integrations_tests.models import batches, install_block_faults, start_rank
    from scout_core.config import load

    a, injector, par, opt = start_rank(ctx)
    state = {"step": 0}
    install_block_faults(par, injector, ctx.rank, state)
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=false",
                      "report.log_level=ERROR", "actions.on_verdict=log"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    handle.certify_framework_checkpoints()  # what a plugin that learns the folder at the first save does
    labels = None
    for step, (x, y) in enumerate(batches(ctx.rank, 8), start=1):
        state["step"] = step
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 6:  # the framework's first save, after the verdict of step 2
            labels = handle.label_framework_checkpoints(a["dir"])
            labels.saved(step, os.path.join(a["dir"], f"global_step{step}"), handle.certifier)
    handle.close()
    return {s: e["label"] for s, e in labels.entries.items()}


def test_a_verdict_before_the_first_framework_save_rejects_what_is_saved_after_it(tmp_path):
    """A one-off bit flip at step 2 reaches every replica through the gradient all-reduce; the checks after it
    agree again. A framework checkpoint saved at step 6 must not be verified by them (DeepSpeed learns its folder
    only at the first save: the verdict came before the labels existed)."""
    from scout_core.testing.inject import Fault

    faults = [Fault.from_dict({"surface": "layers.1.output", "rank": 2, "kind": "bitflip", "bit": 22, "step": 2})]
    result = launch(_verdict_before_the_first_save, 4, timeout_s=120,
                    args={"faults": faults, "seed": 0, "layout": "ddp", "dir": str(tmp_path)})
    assert result.ok, result.failures()
    assert [v for v in result.values()] == [{6: "rejected"}] * 4


def _handle_fails_to_build(ctx: RankContext):
    import scout_core
    from integrations_tests.models import start_rank
    from scout_core import runtime
    from scout_core.config import load
    from scout_core.handle import ScoutHandle

    a, _, par, opt = start_rank(ctx)
    cfg = load(None, ["observer.enabled=false", "report.log_level=ERROR"])
    real = runtime.new_handle

    def broken(parts):
        raise RuntimeError("the handle could not be built")

    runtime.new_handle = broken
    try:
        scout_core.enable(par.model, opt, config=cfg)
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        runtime.new_handle = real
    held_after_failure = ScoutHandle.is_open()
    handle = scout_core.enable(par.model, opt, config=cfg)  # the claim was released
    try:
        handle.stop_on_verdict = True
    except AttributeError as exc:
        write = str(exc)
    else:
        write = "accepted"
    handle.close()
    return {"raised": raised, "held": held_after_failure, "write": write}


def test_a_handle_that_fails_to_build_releases_the_claim_and_handle_attributes_are_read_only(tmp_path):
    result = launch(_handle_fails_to_build, 2, timeout_s=120, args={"faults": [], "seed": 0, "layout": "ddp",
                                                                   "dir": str(tmp_path)})
    assert result.ok, result.failures()
    for v in result.values():
        assert v["raised"] == "the handle could not be built" and not v["held"]
        assert "read-only" in v["write"] and "handle.boundary" in v["write"], v["write"]


def test_the_inner_optimizer_of_a_wrapper_that_is_an_optimizer_is_found():
    """Accelerate's ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` around the one that steps (without
    its state): SCOUT's boundary hook goes on the inner one, which steps only where gradients were synchronized."""
    from scout_core.adapter import find_inner_optimizers

    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):  # as Accelerate's: no Optimizer.__init__
            self.optimizer = optimizer

    assert find_inner_optimizers(Wrapper(inner)) == [inner]
    assert find_inner_optimizers(inner) == [inner]


def test_embedding_and_head_a_model_declares_are_found_where_no_name_matches():
    """A BERT-style model keeps its embedding and head under names SCOUT does not look for: the modules its
    ``get_input_embeddings`` / ``get_output_embeddings`` return are taken (a method that raises: nothing)."""
    from scout_core.adapter import torch_adapter

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.ModuleDict({"tokens": torch.nn.Embedding(8, 4)})
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.cls = torch.nn.Sequential(torch.nn.Linear(4, 8))

        def get_input_embeddings(self):
            return self.body["tokens"]

        def get_output_embeddings(self):
            raise NotImplementedError

    model = Encoder()
    adapter = torch_adapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert adapter.embedding is model.body["tokens"] and adapter.output is None
