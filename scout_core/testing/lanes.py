"""Cells that mostly wait, run side by side: forked lanes that each take the next such cell when done.

A hang or stall cell spends most of its wall time asleep (its ranks blocked, its observers polling): on 2 cores
one of them uses 8-33 % of the machine. Run one at a time, a suite of them costs its sleep in full; three lanes at
once cost about the longest lane. Only cells tagged :data:`WAITS_TAG` go into lanes, and never beside a cell that
computes: a busy neighbour is what moves a straggler's timing or a replay's pace.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["WAITS_TAG", "run_in_lanes"]

WAITS_TAG = "waits"
"""The tag of a cell that mostly waits (a hang, a stall, a timeout), using a small share of the machine: with
``lanes`` above 1 such cells run that many at a time, side by side, and never beside other cells."""

Spec = TypeVar("Spec")
Report = TypeVar("Report")

_POLL_S = 1.0
_END_GRACE_S = 60.0
"""How long an interrupted lane gets to end its cell's ranks (the launcher reaps each rank) before it is killed."""


class _Lane:
    """One forked process that runs the cells the parent hands it, one at a time, and answers with their reports."""

    def __init__(self, serve: Callable[[int, int], None], others: Sequence[_Lane]) -> None:
        task_read, self._task_write = os.pipe()
        self.result_read, result_write = os.pipe()
        sys.stdout.flush()  # what this process buffered would otherwise be printed again by the lane
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the lane: never returns to the caller (a test runner's frames live above it)
            status = 1
            try:
                signal.signal(signal.SIGINT, _interrupt_once)
                for lane in others:  # another lane's task pipe held open here would never reach its end
                    lane.close()
                os.close(self._task_write)
                os.close(self.result_read)
                serve(task_read, result_write)
                status = 0
            finally:
                os._exit(status)
        os.close(task_read)
        os.close(result_write)
        os.set_blocking(self.result_read, False)
        self.running: int | None = None
        self.started = False
        """The lane said it began the cell it holds (one it never began goes back to the queue if it dies)."""
        self.buffer = b""
        self.status: int | None = None
        self.at_end = False
        """Every writer of the lane's results has closed it (the lane has ended)."""

    def hand(self, index: int | None) -> None:
        """Give the lane cell ``index`` to run, or (None) tell it that no cell is left."""
        self.running, self.started = index, False
        try:
            if index is None:
                os.close(self._task_write)
                self._task_write = -1
            else:
                os.write(self._task_write, f"{index}\n".encode())
        except OSError:  # the lane is gone (or was told already): its end is seen by reap()
            pass

    def close(self) -> None:
        for fd in (self._task_write, self.result_read):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._task_write = self.result_read = -1

    def reap(self) -> bool:
        """Whether the lane's process has ended (it is then reaped and its wait status kept)."""
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid == self.pid:
                self.status = status
        return self.status is not None

    def read(self) -> list[dict[str, Any]]:
        """The messages the lane has written so far and this process has not read (never blocks)."""
        while True:
            try:
                chunk = os.read(self.result_read, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.at_end = True
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines]


def _interrupt_once(signum: int, frame: Any) -> None:
    """Ctrl-C reaches the lanes from the terminal and again from the parent's clean-up: the first one interrupts
    the cell (whose launcher then ends its ranks), the second must not interrupt that clean-up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _serve(run_one: Callable[[Spec], Report], specs: Sequence[Spec], to_dict: Callable[[Report], dict],
           failed: Callable[[Spec, str], Report], task_read: int, result_write: int) -> None:
    with os.fdopen(task_read, "r") as tasks, os.fdopen(result_write, "w") as results:
        for line in tasks:
            index = int(line)
            results.write(json.dumps({"started": index}) + "\n")
            results.flush()
            try:
                answer = to_dict(run_one(specs[index]))
            except Exception:  # noqa: BLE001 - one cell's crash is its FAIL, as when run alone
                answer = to_dict(failed(specs[index], traceback.format_exc()))
            results.write(json.dumps({"report": answer}, default=repr) + "\n")
            results.flush()


def run_in_lanes(specs: Sequence[Spec], lanes: int, run_one: Callable[[Spec], Report], *,
                 to_dict: Callable[[Report], dict], from_dict: Callable[[dict], Report],
                 failed: Callable[[Spec, str], Report],
                 on_result: Callable[[Report], None] | None = None) -> list[Report]:
    """``run_one(spec)`` for every spec, in ``lanes`` processes forked from this one; the reports in the specs'
    order. Reports cross the pipe as JSON (``to_dict`` / ``from_dict``); ``failed(spec, details)`` makes the report
    of a cell whose lane died running it. A cell a dying lane was handed but never began goes to another lane."""
    reports: list[Report | None] = [None] * len(specs)
    queue = list(range(len(specs)))
    live: list[_Lane] = []
    selector = selectors.DefaultSelector()

    def serve(task_read: int, result_write: int) -> None:
        _serve(run_one, specs, to_dict, failed, task_read, result_write)

    def take(lane: _Lane, message: dict[str, Any]) -> None:
        if "started" in message:
            lane.started = True
            return
        report = from_dict(message["report"])
        reports[lane.running] = report
        lane.running = None
        if on_result:
            on_result(report)

    def start_lane() -> None:
        lane = _Lane(serve, live)
        live.append(lane)
        selector.register(lane.result_read, selectors.EVENT_READ, lane)
        lane.hand(queue.pop(0))

    def retire(lane: _Lane) -> None:
        if lane.result_read in selector.get_map():
            selector.unregister(lane.result_read)
        live.remove(lane)
        lane.close()

    try:
        while queue and len(live) < lanes:
            start_lane()
        while any(r is None for r in reports):
            for key, _ in selector.select(timeout=_POLL_S):
                lane = key.data
                for message in lane.read():
                    take(lane, message)
                    if lane.running is None and "report" in message:
                        lane.hand(queue.pop(0) if queue else None)
                if lane.at_end:  # a pipe at its end reads as ready for ever
                    selector.unregister(key.fileobj)
            for lane in [lane for lane in live if lane.running is not None and lane.reap()]:
                for message in lane.read():  # written before it ended, not yet read
                    take(lane, message)
                if lane.running is not None and not lane.started:
                    queue.insert(0, lane.running)  # handed, never begun: another lane runs it
                elif lane.running is not None:
                    reports[lane.running] = report = failed(
                        specs[lane.running], f"the lane process running this cell ended without its report (wait "
                                             f"status {lane.status})")
                    if on_result:
                        on_result(report)
                retire(lane)
                if queue and len(live) < lanes:
                    start_lane()
    finally:
        _end(live, interrupt=any(r is None for r in reports))
        selector.close()
    return [r for r in reports if r is not None]


def _end(lanes: Sequence[_Lane], *, interrupt: bool) -> None:
    """Tell every lane that no cell is left and wait for it to end. Where this run stops early (an exception here)
    the lanes are interrupted as Ctrl-C would (their cells then end their ranks), and killed if still there a minute
    later."""
    for lane in lanes:
        if interrupt and not lane.reap():
            os.kill(lane.pid, signal.SIGINT)
        lane.hand(None)
    deadline = time.monotonic() + (_END_GRACE_S if interrupt else 10.0)
    for lane in lanes:
        while not lane.reap() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not lane.reap():
            try:
                os.kill(lane.pid, signal.SIGKILL)
                os.waitpid(lane.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        lane.close()
