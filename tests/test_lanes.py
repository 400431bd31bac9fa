"""Cells tagged ``waits`` run side by side in forked lanes; every other cell runs alone, in this process."""

from __future__ import annotations

import os
import time

from scout_core.testing.cells import CellReport, CellSpec, run_cells
from scout_core.testing.lanes import WAITS_TAG, run_in_lanes


def _spec(name: str, *tags: str) -> CellSpec:
    return CellSpec(name=name, target="fake_lane_cells:cell", tags=tags)


def _report(spec: CellSpec) -> CellReport:
    return CellReport(name=spec.name, verdict="PASS", world_size=spec.world_size, injected=[], reported=[],
                      metrics={"pid": float(os.getpid())})


def test_lanes_run_at_once_and_the_reports_come_in_the_specs_order():
    def sleepy(spec: CellSpec) -> CellReport:
        time.sleep(1.0)
        return _report(spec)

    specs = [_spec(f"c{i}") for i in range(6)]
    seen: list[str] = []
    start = time.monotonic()
    reports = run_in_lanes(specs, 3, sleepy, lambda r: seen.append(r.name))
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

    reports = run_in_lanes([_spec("a"), _spec("b"), _spec("c"), _spec("d")], 1, dies_on_b)
    assert [(r.name, r.verdict) for r in reports] == [("a", "PASS"), ("b", "FAIL"), ("c", "PASS"), ("d", "PASS")]
    assert "ended without its report" in reports[1].details


_FAKE_TARGET = '''
import os
from scout_core.testing.cells import CellReport

def cell(spec, world_size, workdir):
    return CellReport(name=spec.name, verdict="PASS", world_size=world_size, injected=[], reported=[],
                      metrics={"pid": float(os.getpid())})
'''


def test_run_cells_puts_only_the_waiting_cells_in_lanes(tmp_path):
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
