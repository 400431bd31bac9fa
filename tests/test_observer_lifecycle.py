"""The observer's end of life: close() waits for it while it is busy, it holds none of the trainer's files, and a
closing rank is counted out once."""

from __future__ import annotations

import os
import signal
import socket
import time
import types

import pytest
import torch.distributed as dist

from scout_core.observer_link import ObserverLink
from scout_core.progress.control import ControlPlane, closed_ranks
from scout_core.progress.episode import CLOSED_LIST
from scout_core.progress.observer import ObserverSpec, _Closing, _Observer, _release_inherited_files
from scout_core.progress.record import Phase, ProgressRecord, create_record
from scout_core.progress.sealed import unseal_entries


def _child(busy_s: float, then_s: float, record_path: str) -> int:
    """A stand-in observer: busy (in an episode) for busy_s, then its closing messages for then_s."""
    pid = os.fork()
    if pid == 0:
        try:
            rec = ProgressRecord(record_path, owner=False)
            rec.set_observer_busy(busy_s > 0)
            time.sleep(busy_s)
            rec.set_observer_busy(False)
            time.sleep(then_s)
        finally:
            os._exit(0)
    return pid


def _reap(pid: int, record: ProgressRecord) -> tuple[int, float]:
    """Run close()'s reaper on a stand-in observer; (its exit status as the reaper saw it, seconds taken)."""
    stub = types.SimpleNamespace(observer_pid=pid, tracker=types.SimpleNamespace(record=record), rank=0,
                                 _episode_bound_s=4.0, OBSERVER_EXIT_S=1.0)
    status: dict[int, int] = {}
    real_waitpid = os.waitpid

    def recording_waitpid(p, flags):
        done, st = real_waitpid(p, flags)
        if done:
            status[p] = os.waitstatus_to_exitcode(st)
        return done, st

    os.waitpid = recording_waitpid
    start = time.monotonic()
    try:
        ObserverLink.reap(stub)  # type: ignore[arg-type]
    finally:
        os.waitpid = real_waitpid
    return status[pid], time.monotonic() - start


def test_close_waits_for_a_busy_observer_and_then_for_its_closing_messages(tmp_path):
    record = create_record("reap", 0, directory=str(tmp_path))
    # Busy for 1.6 s (past the 1 s idle limit), then 0.6 s of closing messages: it must exit on its own.
    code, took = _reap(_child(1.6, 0.6, record.path), record)
    assert code == 0, "killed although it was busy, or right after its busy stretch ended"
    assert 2.0 <= took < 3.5


def test_close_kills_an_observer_idle_past_the_limit_and_never_blocks(tmp_path):
    record = create_record("reap2", 0, directory=str(tmp_path))
    code, took = _reap(_child(0.0, 30.0, record.path), record)
    assert code == -9 and took < 2.5


def test_the_observer_holds_none_of_the_trainers_files():
    """An inherited socket is released (its peer sees the end when the trainer lets go), and its number stays
    taken, so an inherited object finalized later cannot close a file of the observer's that reused it."""
    mine, inherited = socket.socketpair()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _release_inherited_files(keep={0, 1, 2, write_end})
            fresh = os.open(os.devnull, os.O_RDONLY)  # a number that was free: not one of the trainer's
            os.write(write_end, b"1" if fresh not in (mine.fileno(), inherited.fileno()) else b"0")
            time.sleep(5)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"1"
        inherited.close()  # the trainer's copy: the observer's must not keep the connection open
        mine.settimeout(3.0)
        assert mine.recv(1) == b"", "the peer of a socket the trainer closed still sees it open"
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        mine.close()
        os.close(read_end)


def test_a_closing_rank_is_counted_out_once(tmp_path):
    record = create_record("count", 3, directory=str(tmp_path))
    spec = ObserverSpec(run_id="count", rank=3, world_size=4, record_path=record.path,
                        control=ControlPlane("localhost", 1, "daemon", secret="c0" * 16), peer_groups=[[0, 1, 2, 3]],
                        hosts={},
                        devices={}, silence_threshold_s=1.0, gather_timeout_s=1.0, startup_timeout_s=1.0,
                        jsonl_path=None)
    store = dist.PrefixStore("scout/count", dist.HashStore())
    observer = _Observer(spec, ready_fd=-1)
    observer.record = ProgressRecord(record.path, owner=False)
    observer.store = store
    observer._answer_closed()
    observer._closed_messages(store)  # a retry after the first attempt was cut off
    assert closed_ranks(store.underlying_store, "c0" * 16) == {"3"}  # the daemon's own list, sealed
    assert unseal_entries("c0" * 16, CLOSED_LIST, store.get(CLOSED_LIST)) == ["3", "3"]  # the retry: still rank 3
    assert record.observer_busy, "the closing messages keep close() waiting until the observer exits"
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_closing_sigterm_inside_an_episode_waits_for_its_end_and_a_second_one_is_ignored(tmp_path):
    record = create_record("sig", 0, directory=str(tmp_path))
    spec = ObserverSpec(run_id="sig", rank=0, world_size=2, record_path=record.path,
                        control=ControlPlane("localhost", 1, "daemon"), peer_groups=[[0, 1]], hosts={}, devices={},
                        silence_threshold_s=1.0, gather_timeout_s=1.0, startup_timeout_s=1.0, jsonl_path=None)
    observer = _Observer(spec, ready_fd=-1)
    observer.record = ProgressRecord(record.path, owner=False)
    record.publish(1, 0, Phase.CLOSED)
    previous = signal.signal(signal.SIGTERM, observer._on_sigterm)
    finished = False
    try:
        with pytest.raises(_Closing):
            with observer._critical_section():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                assert record.observer_busy and observer._close_pending
                finished = True  # the episode ran to its end
        assert finished and not record.observer_busy
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: nothing may cut the closing messages short
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_closing_is_not_an_exception_a_guard_could_swallow():
    assert issubclass(_Closing, BaseException) and not issubclass(_Closing, Exception)


def test_the_observer_acts_on_what_the_trainer_changed_live(tmp_path):
    """A hang verdict stops the job if `actions.on_verdict` was set to stop live (the observer was forked with
    log), and its records are logged at the live level."""
    from scout_core.report import LoggingSink

    record = create_record("live", 0, directory=str(tmp_path))
    spec = ObserverSpec(run_id="live", rank=0, world_size=2, record_path=record.path,
                        control=ControlPlane("localhost", 1, "daemon"), peer_groups=[[0, 1]], hosts={}, devices={},
                        silence_threshold_s=1.0, gather_timeout_s=1.0, startup_timeout_s=1.0, jsonl_path=None)
    observer = _Observer(spec, ready_fd=-1)
    observer.record = ProgressRecord(record.path, owner=False)
    assert observer._live_settings() is False
    record.set_live(on_verdict="stop", log_level=40)
    assert observer._live_settings() is True
    assert [s.level for s in observer.reporter.sinks if isinstance(s, LoggingSink)] == [40]
    record.set_live(on_verdict="log")
    assert observer._live_settings() is False


@pytest.mark.parametrize(("resumed", "own_moved", "kind"), [
    (True, False, "resolved"), (False, False, "shutdown"), (None, False, "shutdown"), (False, True, "resolved")])
def test_a_job_that_ends_while_a_verdict_stands_is_not_called_resolved(tmp_path, resumed, own_moved, kind):
    """Ctrl-C on a job still hung closed every trainer and was written as "progress resumed". Only progress after
    the verdict makes a ``resolved`` record: a rank silent at the verdict moved again, or the reporter's own trainer
    got past where it was (a rank that moved and closed within one look of its observer posts nothing); otherwise
    (or when the store is gone with the job) the record says the job ended with the verdict standing."""
    import contextlib

    from scout_core.progress.delivery import VerdictReporting
    from scout_core.report import Incident, IncidentKind, IncidentScope, JsonlSink, Reporter, read_incidents

    class Protocol:
        def resumed(self, n: int) -> bool:
            if resumed is None:
                raise ConnectionError("the job's store is gone")
            return resumed

    class Observer(VerdictReporting):
        pass

    class Record:
        def read(self) -> types.SimpleNamespace:
            return types.SimpleNamespace(coordinate=(6 if own_moved else 5, 3, 1))

        def live(self) -> tuple[None, None]:
            return None, None

    obs = Observer()
    obs.spec = types.SimpleNamespace(stop_on_verdict=False)
    obs.record = Record()
    obs._watch_from = (5, 3)
    obs.proto = Protocol()
    obs.reporter = Reporter([JsonlSink(str(tmp_path / "incidents.jsonl"))], run_id="r", rank=0)
    obs._critical_section = contextlib.nullcontext
    hang = Incident(kind=IncidentKind.HANG, scope=IncidentScope.RANK, ranks=[2], step=5,
                    evidence={"class": "lagging"}, reason="rank 2 stopped publishing")
    obs._watch = (0, [hang], time.monotonic())
    obs._closed_while_watching()
    (record,) = read_incidents(tmp_path / "incidents.jsonl")
    assert (record.kind.value, record.ranks, record.evidence["verdict"]) == (kind, [2], "hang")
    assert obs._watch is None
    obs._closed_while_watching()  # written once
    assert len(list(read_incidents(tmp_path / "incidents.jsonl"))) == 1


def test_a_named_ranks_stack_is_read_from_its_trainer_through_the_armed_signal(tmp_path):
    """The trainer arms faulthandler on a signal of its own into an in-memory file; its observer empties the file,
    signals and reads every thread's stack, and finds the training thread's innermost frames."""
    from scout_core.progress.stacks import arm_trainer_stacks, capture_stacks, main_thread_frames

    arm = arm_trainer_stacks()
    assert arm is not None
    try:
        for _ in range(2):  # a second request reads a fresh dump, not the first one's
            dump = capture_stacks(os.getpid(), arm.fd, arm.sig)
            assert dump.count("most recent call first") >= 1, dump
            frames = main_thread_frames(dump, arm.main_thread)
            assert frames and "capture_stacks" in frames[0], dump
            assert "test_a_named_ranks_stack_is_read" in " ".join(main_thread_frames(dump, arm.main_thread, 9))
        assert arm_trainer_stacks() is None  # the signal has a handler now: never taken over twice
    finally:
        arm.disarm()
    assert "no stack" in capture_stacks(os.getpid(), arm.fd, arm.sig, answer_s=0.2)  # disarmed: says so
