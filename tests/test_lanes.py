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


def test_every_guard_that_runs_beside_others_re_runs_only_cells_that_wait():
    """A guard marked ``waits`` runs three at a time in CI: the cells it re-runs must be tagged ``waits`` too (a
    cell that computes beside others is what moves a straggler's timing or a replay's pace), and every guard of a
    waiting cell is marked (else it runs alone, which costs only time)."""
    import ast
    import re
    from pathlib import Path

    from scout_core.testing.cells import load_cells

    root = Path(__file__).resolve().parents[1]
    specs = load_cells(root / "configs" / "cells.yaml")
    source = (root / "integrations_tests" / "test_cells.py").read_text()
    marked, unmarked = {}, {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and node.name != "test_cell_passes":
            cells = set(re.findall(r'SPECS\["([^"]+)"\]', ast.get_source_segment(source, node)))
            waits = any("waits" in ast.get_source_segment(source, d) for d in node.decorator_list)
            (marked if waits else unmarked)[node.name] = cells
    assert marked and all(cells and all(WAITS_TAG in specs[c].tags for c in cells) for cells in marked.values())
    assert not [name for name, cells in unmarked.items() if cells and all(WAITS_TAG in specs[c].tags for c in cells)]


def test_scout_cells_run_with_lanes_prints_one_line_per_cell(tmp_path, capfd, monkeypatch: pytest.MonkeyPatch):
    from scout_core.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "fake_lane_cells.py").write_text(_FAKE_TARGET)
    cells = tmp_path / "configs" / "cells.yaml"
    cells.parent.mkdir()
    cells.write_text("cells:\n" + "".join(
        f"  {name}:\n    target: fake_lane_cells:cell\n    tags: [{tag}]\n"
        for name, tag in (("w1", "waits"), ("c1", "fast"), ("w2", "waits"))))
    assert main(["cells", "run", "w1", "c1", "w2", "w1", "--cells", str(cells), "--lanes", "2"]) == 0
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == 3 and lines[2].startswith("[3/3] PASS c1"), out  # waiting cells first; w1 once
    table = out.split("\n\n", 1)[1]
    assert table.index("w1 ") < table.index("c1 ") < table.index("w2 ")  # the table keeps the order asked
