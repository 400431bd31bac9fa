"""Cells that mostly wait, run side by side: forked lanes that each take the next such cell when done.

A hang or stall cell spends most of its wall time asleep (its ranks blocked, its observers polling): on 2 cores
one of them uses 8-17 % of the machine. Run one at a time, a suite of them costs its sleep in full; three lanes at
once cost about the longest lane. Only cells tagged :data:`WAITS_TAG` go into lanes, and never beside a cell that
computes: a busy neighbour is what moves a straggler's timing or a replay's pace.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scout_core.testing.cells import CellReport, CellSpec

__all__ = ["WAITS_TAG", "run_in_lanes"]

WAITS_TAG = "waits"
"""The tag of a cell that mostly waits (a hang, a stall, a timeout), using a small share of the machine: with
``lanes`` above 1 such cells run that many at a time, side by side, and never beside other cells."""

_POLL_S = 1.0


class _Lane:
    """One forked process that runs the cells the parent hands it, one at a time, and answers with their reports."""

    def __init__(self, run_one: Callable[[CellSpec], CellReport], specs: Sequence[CellSpec],
                 others: Sequence[_Lane]) -> None:
        task_read, self._task_write = os.pipe()
        self.result_read, result_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the lane: never returns to the caller (a test runner's frames live above it)
            status = 1
            try:
                for lane in others:  # another lane's task pipe held open here would never reach its end
                    lane.close()
                os.close(self._task_write)
                os.close(self.result_read)
                _serve(run_one, specs, task_read, result_write)
                status = 0
            finally:
                os._exit(status)
        os.close(task_read)
        os.close(result_write)
        self.running: int | None = None
        self.buffer = b""
        self.exited = False
        self.at_end = False
        """Every writer of the lane's results has closed it (the lane has ended)."""

    def hand(self, index: int | None) -> None:
        """Give the lane cell ``index`` to run, or (None) tell it that no cell is left."""
        self.running = index
        try:
            if index is None:
                os.close(self._task_write)
                self._task_write = -1
            else:
                os.write(self._task_write, f"{index}\n".encode())
        except OSError:  # the lane is gone: its missing report is told when its exit is seen
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
        """Whether the lane's process has ended (it is then reaped)."""
        if not self.exited:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid = self.pid
            self.exited = pid == self.pid
        return self.exited

    def read_reports(self) -> list[dict]:
        """The reports the lane has written so far and this process has not read (never blocks)."""
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


def _serve(run_one: Callable[[CellSpec], CellReport], specs: Sequence[CellSpec], task_read: int,
           result_write: int) -> None:
    with os.fdopen(task_read, "r") as tasks, os.fdopen(result_write, "w") as results:
        for line in tasks:
            report = run_one(specs[int(line)])
            results.write(json.dumps(report.to_dict()) + "\n")
            results.flush()


def run_in_lanes(specs: Sequence[CellSpec], lanes: int, run_one: Callable[[CellSpec], CellReport],
                 on_result: Callable[[CellReport], None] | None = None) -> list[CellReport]:
    """``run_one(spec)`` for every spec, in ``lanes`` processes forked from this one; the reports in the specs'
    order. A lane that dies with a cell in hand fails that cell, and a new lane takes its place."""
    from scout_core.testing.cells import CellReport, fault_dicts

    reports: list[CellReport | None] = [None] * len(specs)
    queue = list(range(len(specs)))
    live: list[_Lane] = []
    selector = selectors.DefaultSelector()

    def record(lane: _Lane, report: CellReport) -> None:
        reports[lane.running] = report
        lane.running = None
        if on_result:
            on_result(report)

    def start_lane() -> None:
        lane = _Lane(run_one, specs, live)
        os.set_blocking(lane.result_read, False)
        live.append(lane)
        selector.register(lane.result_read, selectors.EVENT_READ, lane)
        lane.hand(queue.pop(0))

    try:
        while queue and len(live) < lanes:
            start_lane()
        while any(r is None for r in reports):
            for key, _ in selector.select(timeout=_POLL_S):
                for answer in key.data.read_reports():
                    record(key.data, CellReport(**answer))
                    key.data.hand(queue.pop(0) if queue else None)
                if key.data.at_end:  # a pipe at its end reads as ready for ever
                    selector.unregister(key.fileobj)
            for lane in [lane for lane in live if lane.running is not None and lane.reap()]:
                for answer in lane.read_reports():  # written before it ended, not yet read
                    record(lane, CellReport(**answer))
                if lane.running is not None:
                    spec = specs[lane.running]
                    record(lane, CellReport(
                        name=spec.name, verdict="FAIL", world_size=spec.world_size,
                        injected=fault_dicts(spec.faults), reported=[],
                        details=f"the lane process running cell {spec.name!r} ended without its report"))
                if not lane.at_end:
                    selector.unregister(lane.result_read)
                live.remove(lane)
                lane.close()
                if queue:
                    start_lane()
    finally:
        _end(live, interrupt=any(r is None for r in reports))
        selector.close()
    return [r for r in reports if r is not None]


def _end(lanes: Sequence[_Lane], *, interrupt: bool) -> None:
    """Tell every lane that no cell is left and wait for it to end. Where this run stops early (an exception here)
    the lanes are interrupted as Ctrl-C would (their cells then end their ranks), and killed if still there 10 s
    later."""
    for lane in lanes:
        if interrupt and not lane.reap():
            os.kill(lane.pid, signal.SIGINT)
        lane.hand(None)
    deadline = time.monotonic() + 10.0
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
