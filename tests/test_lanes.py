"""Cells tagged ``waits`` run side by side in forked lanes; every other cell runs alone, in this process."""

from __future__ import annotations

import os
import sys
import time

import pytest

from scout_core.testing.cells import CellReport, CellSpec, run_cells
from scout_core.testing.lanes import WAITS_TAG, run_in_lanes


def _spec(name: str, *tags: str) -> CellSpec:
    return CellSpec(name=name, target="fake_lane_cells:cell", tags=tags)


def _report(spec: CellSpec) -> CellReport:
    return CellReport(name=spec.name, verdict="PASS", world_size=spec.world_size, injected=[], reported=[],
                      metrics={"pid": float(os.getpid())})


def _failed(spec: CellSpec, details: str) -> CellReport:
    return CellReport(name=spec.name, verdict="FAIL", world_size=spec.world_size, injected=[], reported=[],
                      details=details)


def _lanes(specs, lanes, run_one, on_result=None) -> list[CellReport]:
    return run_in_lanes(specs, lanes, run_one, to_dict=CellReport.to_dict, from_dict=lambda d: CellReport(**d),
                        failed=_failed, on_result=on_result)


def test_lanes_run_at_once_and_the_reports_come_in_the_specs_order():
    def sleepy(spec: CellSpec) -> CellReport:
        time.sleep(1.0)
        return _report(spec)

    specs = [_spec(f"c{i}") for i in range(6)]
    seen: list[str] = []
    start = time.monotonic()
    reports = _lanes(specs, 3, sleepy, lambda r: seen.append(r.name))
    elapsed = time.monotonic() - start
    assert [r.name for r in reports] == [s.name for s in specs] and sorted(seen) == sorted(s.name for s in specs)
    assert elapsed < 4.5, elapsed  # two rounds of three, not six in a row
    pids = {r.metrics["pid"] for r in reports}
    assert len(pids) == 3 and os.getpid() not in pids


def test_a_lane_that_dies_fails_its_cell_and_the_queued_cells_still_run():
    def dies_on_b(spec: CellSpec) -> CellReport:
        if spec.name == "b":
            os._exit(3)  # a crash that no except clause sees
        return _report(spec)

    specs = [_spec(name) for name in "abcdefg"]
    for lanes in (1, 3):  # one lane (the queue waits for its replacement) and several (a dead one is replaced)
        reports = _lanes(specs, lanes, dies_on_b)
        assert [(r.name, r.verdict) for r in reports] == [(n, "FAIL" if n == "b" else "PASS") for n in "abcdefg"]
        assert "ended without its report (wait status 768)" in reports[1].details  # exit 3


def test_a_cell_that_raises_in_its_lane_fails_with_its_traceback():
    def raises_on_c(spec: CellSpec) -> CellReport:
        if spec.name == "c":
            raise RuntimeError("the cell's own error")
        return _report(spec)

    reports = _lanes([_spec("a"), _spec("c"), _spec("d")], 2, raises_on_c)
    assert [r.verdict for r in reports] == ["PASS", "FAIL", "PASS"]
    assert "RuntimeError: the cell's own error" in reports[1].details and "Traceback" in reports[1].details


_FAKE_TARGET = '''
import os
from scout_core.testing.cells import CellReport

def cell(spec, world_size, workdir):
    return CellReport(name=spec.name, verdict="PASS", world_size=world_size, injected=[], reported=[],
                      metrics={"pid": float(os.getpid())})
'''


def test_run_cells_puts_only_the_waiting_cells_in_lanes(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # run_cells puts the cells' root on it
    (tmp_path / "fake_lane_cells.py").write_text(_FAKE_TARGET)
    specs = [_spec("busy-1"), _spec("wait-1", WAITS_TAG), _spec("busy-2"), _spec("wait-2", WAITS_TAG)]
    order: list[str] = []
    reports = run_cells(specs, root=tmp_path, lanes=2, on_result=lambda r: order.append(r.name))
    assert [r.name for r in reports] == [s.name for s in specs]
    assert set(order[:2]) == {"wait-1", "wait-2"}  # the waiting cells first, then the others one at a time
    pid = {r.name: r.metrics["pid"] for r in reports}
    assert pid["busy-1"] == pid["busy-2"] == os.getpid()
    assert os.getpid() not in (pid["wait-1"], pid["wait-2"])
    alone = run_cells(specs, root=tmp_path)  # lanes=1: everything here, in the specs' order
    assert {r.metrics["pid"] for r in alone} == {float(os.getpid())}
