"""Observer robustness: its own crash, a killed observer, a lost peer, exit with the trainer."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import scout_core
from scout_core.config import load
from scout_core.progress import observer as observer_mod
from scout_core.progress.record import pid_alive
from scout_core.report import read_incidents
from scout_core.testing.launcher import RankContext, init_gloo, launch

WORLD = 4


def _job(ctx: RankContext):
    init_gloo(ctx, timeout_s=300)
    a = ctx.args
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = load(None, ["observer.silence_threshold_s=1.5", "observer.gather_timeout_s=2.5",
                      f"report.jsonl_path={a['jsonl']}", "report.log_level=DEBUG"])
    handle = scout_core.enable(model, opt, config=cfg, on_incident=a.get("on_incident"))
    if a["mode"] == "process":  # what its observer is: a fresh interpreter, or a fork carrying torch
        with open(f"/proc/{handle.observer_pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode()
        with open(f"/proc/{handle.observer_pid}/maps") as fh:
            torch_mapped = "libtorch" in fh.read()
        handle.close()
        return {"cmdline": cmdline, "torch_mapped": torch_mapped, "startup_s": handle.observer_startup_s}
    for step in range(a.get("steps", 6)):
        if step == 2 and ctx.rank == a.get("victim"):
            if a["mode"] == "kill_observer":
                os.kill(handle.observer_pid, signal.SIGKILL)
                time.sleep(0.2)
            if a["mode"] == "lost":
                os.kill(handle.observer_pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGSTOP)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(a.get("step_sleep", 0.0))
    dist.barrier()
    handle.close()
    return handle.observer_startup_s


def _run(mode, timeout_s=60, stop_records=0, **extra):
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "incidents.jsonl")

        def enough():
            return os.path.exists(jsonl) and len(list(read_incidents(jsonl))) >= stop_records

        result = launch(_job, WORLD, timeout_s=timeout_s, args={"mode": mode, "jsonl": jsonl, **extra},
                        stop_when=enough if stop_records else None)
        incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
    return result, incidents


def test_observer_crash_reports_itself_once(monkeypatch, forked_observers):
    real_loop = observer_mod._Observer._loop

    def crashing_loop(self):
        if self.spec.rank == 2:
            raise RuntimeError("observer blew up")
        return real_loop(self)

    monkeypatch.setattr(observer_mod._Observer, "_loop", crashing_loop)
    result, incidents = _run("crash", step_sleep=0.05)
    assert result.ok, result.failures()
    assert [(i.kind.value, i.scope.value, i.ranks, i.reporter_rank) for i in incidents] == [
        ("observer_failure", "rank", [2], 2)]
    assert "observer blew up" in incidents[0].reason


def test_observer_is_a_fresh_interpreter_without_torch():
    result, _ = _run("process", on_incident="integrations_tests.cell_callbacks:record_incident")
    assert result.ok, result.failures()
    for seen in result.values():
        assert "scout_core.progress.spawn" in seen["cmdline"] and not seen["torch_mapped"], seen


def test_observer_of_a_callback_without_an_import_path_is_forked():
    result, _ = _run("process", on_incident=lambda inc: None)
    assert result.ok, result.failures()
    for seen in result.values():
        assert "scout_core.progress.spawn" not in seen["cmdline"] and seen["torch_mapped"], seen


def test_killed_observer_is_reported_by_its_trainer():
    result, incidents = _run("kill_observer", victim=1)
    assert result.ok, result.failures()
    assert [(i.kind.value, i.ranks, i.reporter_rank) for i in incidents] == [("observer_failure", [1], 1)]
    assert incidents[0].evidence["exit"] == -signal.SIGKILL


@pytest.mark.waits  # it mostly sleeps: CI runs it side by side with other waiting tests (docker/test.sh)
def test_peer_whose_processes_died_is_named_lost_not_the_reporter():
    result, incidents = _run("lost", victim=3, stop_records=1, timeout_s=60)
    assert result.stopped, result.failures()
    assert [(i.kind.value, i.scope.value, i.ranks, i.evidence["class"]) for i in incidents] == [
        ("hang", "rank", [3], "lost")]
    assert incidents[0].reporter_rank != 3


def _orphan(ctx: RankContext):
    init_gloo(ctx)
    cfg = load(None, ["observer.silence_threshold_s=30"])
    handle = scout_core.enable(torch.nn.Linear(2, 2), None, config=cfg)
    return {"observer": handle.observer_pid, "record": handle.tracker.record.path}


def _orphan_and_die(ctx: RankContext):
    info = _orphan(ctx)
    # Hand the facts to the parent, then die without any cleanup, as a crashed trainer does.
    with open(ctx.args["out"], "w") as fh:
        fh.write(f"{info['observer']} {info['record']}")
    os._exit(0)


@pytest.mark.waits  # it mostly sleeps: CI runs it side by side with other waiting tests (docker/test.sh)
def test_observer_exits_and_cleans_up_when_its_trainer_dies(tmp_path):
    out = tmp_path / "pid"
    pid = os.fork()
    if pid == 0:  # a one-rank job outside the launcher, so nothing else kills the observer
        try:
            from scout_core.testing.launcher import RankContext as Ctx
            from scout_core.testing.launcher import free_port

            _orphan_and_die(Ctx(rank=0, world_size=1, master_port=free_port(), args={"out": str(out)}))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    observer, record = out.read_text().split()
    deadline = time.monotonic() + 5
    while pid_alive(int(observer)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(int(observer)), "observer outlived its trainer"
    assert not os.path.exists(record), "observer left the dead trainer's record behind"


def _enable_in_a_thread_then_die(ctx: RankContext):
    import threading

    box = {}
    setup = threading.Thread(target=lambda: box.update(_orphan(ctx)))  # enable() from a set-up thread
    setup.start()
    setup.join()  # ... which is gone now; the trainer lives on
    time.sleep(1.5)
    with open(ctx.args["out"], "w") as fh:
        fh.write(f"{box['observer']} {box['record']} {int(pid_alive(box['observer']))}")
    os._exit(0)  # then the trainer dies without clean-up


@pytest.mark.waits  # it mostly sleeps: CI runs it side by side with other waiting tests (docker/test.sh)
def test_observer_started_from_a_thread_lives_with_the_trainer_not_the_thread(tmp_path):
    out = tmp_path / "pid"
    pid = os.fork()
    if pid == 0:
        try:
            from scout_core.testing.launcher import RankContext as Ctx
            from scout_core.testing.launcher import free_port

            _enable_in_a_thread_then_die(Ctx(rank=0, world_size=1, master_port=free_port(),
                                             args={"out": str(out)}))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    observer, record, alive_after_thread = out.read_text().split()
    assert alive_after_thread == "1", "the observer died with the thread that started it"
    deadline = time.monotonic() + 5
    while pid_alive(int(observer)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(int(observer)), "observer outlived its trainer"
    assert not os.path.exists(record)


@pytest.mark.parametrize("bad", ["observer.silence_threshold_s=0", "observer.store_port=-1"])
def test_bad_observer_config_is_refused(bad):
    from scout_core.config import ConfigError

    with pytest.raises(ConfigError):
        load(None, [bad])
