"""Fork safety of the observer: forked while other trainer threads hold the locks it could meet.

The observer is forked from a live trainer. Only the forking thread exists in the child; a lock that another
thread held at the fork stays held there forever. These tests fork the observer while other threads of the
trainer hold the logging module's lock and a handler's lock, run intra-op work, and block inside a c10d store
call, then stall the trainer: the observer must still start, diagnose and write its records.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.distributed as dist

import scout_core
from scout_core.config import load
from scout_core.report import read_incidents
from scout_core.testing.launcher import RankContext, init_gloo, launch


def _busy_trainer(ctx: RankContext) -> float:
    init_gloo(ctx, timeout_s=300)
    stop = threading.Event()
    handler = logging.getLogger("scout").handlers[0] if logging.getLogger("scout").handlers else None

    def hold_logging_locks() -> None:
        while not stop.is_set():
            with logging._lock:  # type: ignore[attr-defined]  # the module lock every getLogger takes
                if handler is not None:
                    with handler.lock:
                        time.sleep(0.002)
                else:
                    time.sleep(0.002)

    def intra_op_work() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a = torch.tanh(a @ a)

    def blocked_in_store() -> None:
        from datetime import timedelta

        # Its own client of the job's store (the default store's client is shared: blocking it would block
        # enable()'s own group creation, which is not what this test is about).
        store = dist.TCPStore("127.0.0.1", ctx.master_port, None, False, timeout=timedelta(seconds=60))
        try:
            store.wait([f"never-{ctx.rank}"], timedelta(seconds=60))
        except Exception:
            pass

    threads = [threading.Thread(target=f, daemon=True) for f in (hold_logging_locks, intra_op_work, blocked_in_store)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # the locks are being taken and released in a loop when enable() forks
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = load(None, ["observer.silence_threshold_s=1", "observer.gather_timeout_s=3",
                      f"report.jsonl_path={ctx.args['jsonl']}", "report.log_level=INFO",
                      "observer.start_method=fork"])  # what this test is about: a fork while locks are held
    start = time.monotonic()
    handle = scout_core.enable(model, opt, config=cfg)
    startup = time.monotonic() - start
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    with open(os.path.join(os.path.dirname(ctx.args["jsonl"]), f"startup-{ctx.rank}"), "w") as fh:
        fh.write(repr(handle.observer_startup_s))
    stop.set()
    if ctx.rank == 1:
        while True:  # rank 1's training thread stops; rank 0 waits in the next all-reduce
            time.sleep(3600)
    model(torch.randn(2, 4)).sum().backward()
    return startup


def test_observer_forked_while_trainer_threads_hold_locks_still_diagnoses(tmp_path):
    jsonl = tmp_path / "incidents.jsonl"

    def verdict() -> bool:
        return jsonl.exists() and any(i.kind.value == "hang" for i in read_incidents(jsonl))

    result = launch(_busy_trainer, 2, timeout_s=120, args={"jsonl": str(jsonl)}, stop_when=verdict)
    assert result.stopped, result.failures()
    incidents = list(read_incidents(jsonl))
    assert [i.kind.value for i in incidents] == ["hang"], [i.reason for i in incidents]
    startups = [float((tmp_path / f"startup-{r}").read_text()) for r in range(2)]
    assert max(startups) < 5.0  # start-up is a fork plus one connection; a deadlocked child never gets ready
