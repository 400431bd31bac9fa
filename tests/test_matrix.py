"""The fault matrix's summary and plot (scout_core.testing.matrix), from cell reports; every 16-rank cell has a
place in it (smaller cells may have one too)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scout_core.cli import main
from scout_core.testing.cells import CellReport, CellSpec, MatrixPlace, load_cells
from scout_core.testing.matrix import false_positives, matrix_plot, matrix_summary, time_to_verdict

ROOT = Path(__file__).resolve().parents[1]


def _spec(name: str, layout: str, fault: str) -> CellSpec:
    return CellSpec(name=name, target="m:f", matrix=MatrixPlace(layout, fault))


def _record(kind: str, scope: str, ranks: list[int], ttv: float | None = 0.5) -> dict:
    return {"kind": kind, "scope": scope, "ranks": ranks, "hosts": [], "surface": "s", "time_to_verdict_s": ttv}


def _bitflip(rank: int) -> list[dict]:
    return [{"kind": "bitflip", "rank": rank, "surface": "layers.1.output"}]


SPECS = {s.name: s for s in (
    _spec("ddp-clean", "ddp", "clean"), _spec("ddp-sdc", "ddp", "sdc"), _spec("fsdp2-sdc", "fsdp2", "sdc"),
    _spec("hsdp-clean", "hsdp", "clean"), _spec("moe-hang", "moe", "hang"))}
REPORTS = [
    CellReport(name="ddp-clean", verdict="PASS", world_size=16, injected=[], reported=[]),
    CellReport(name="ddp-sdc", verdict="PASS", world_size=16, injected=_bitflip(9),
               reported=[_record("sdc", "rank", [9], 1.5), {"kind": "decision", "scope": "verified", "ranks": []}]),
    CellReport(name="fsdp2-sdc", verdict="FAIL", world_size=16, injected=_bitflip(3),
               reported=[_record("sdc", "rank", [4])], details="named ranks [4], expected [3]\nmore"),
    CellReport(name="hsdp-clean", verdict="FAIL", world_size=16, injected=[],
               reported=[_record("straggler", "peer_group", list(range(16)))], details="kinds ['straggler']"),
    CellReport(name="moe-hang", verdict="PASS", world_size=16, injected=[{"kind": "freeze", "rank": 5, "surface": "x"}],
               reported=[_record("hang", "rank", [5], None)], time_to_verdict_s=2.5),
]


def test_the_summary_counts_passes_per_layout_and_fault_class_and_names_false_positives():
    md = matrix_summary(SPECS, REPORTS)
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["fault class"].split("|")[2:7] == [" ddp ", " fsdp2 ", " hsdp ", " moe ", " passed / run "]
    assert "| 1/1 | - | 0/1 **FAIL** | - | 1/2 | straggler/peer_group | - | - | 1 |" in rows["clean"]
    assert "| 1/1 | 0/1 **FAIL** | - | - | 1/2 | sdc/rank | - | - | 1 |" in rows["sdc"]
    assert "| - | - | - | 1/1 | 1/1 | hang/rank | - | - | 0 |" in rows["hang"]
    assert "3 of 5 cells passed" in md
    assert "- `fsdp2-sdc`: named ranks [4], expected [3]" in md and "more" not in md
    assert "- `hsdp-clean`: straggler/peer_group r0-15" in md and "- `fsdp2-sdc`: sdc/rank r4" in md


def test_false_positives_and_time_to_verdict():
    assert false_positives(REPORTS[0]) == [] and false_positives(REPORTS[1]) == []  # the decision is no verdict
    assert [f["ranks"] for f in false_positives(REPORTS[2])] == [[4]]
    assert len(false_positives(REPORTS[3])) == 1  # anything a clean cell reports
    assert time_to_verdict(REPORTS[1]) == 1.5 and time_to_verdict(REPORTS[4]) == 2.5
    assert time_to_verdict(REPORTS[0]) is None


def test_the_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "m" / "matrix.png"
    matrix_plot(SPECS, REPORTS, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_every_16_rank_cell_has_a_place_in_the_matrix():
    specs = load_cells(ROOT / "configs" / "cells.yaml")
    assert [n for n, s in specs.items() if s.world_size == 16 and s.matrix is None] == []
    layouts = {s.matrix.layout for s in specs.values() if s.matrix}
    assert {"ddp", "fsdp2", "hsdp", "moe", "titan", "megatron", "deepspeed", "hf"} <= layouts


KNOWN_GAPS: list[tuple[str, str]] = []
"""Places of the grid without a passing cell, each with its reason in the README ("Known gaps")."""


def test_the_grid_the_paper_asks_for_is_complete():
    """Every parallelism layout x fault class of the paper's Table 3 (and issue 15) has a cell, but the known
    gaps (a gap closed must leave the list too)."""
    specs = load_cells(ROOT / "configs" / "cells.yaml")
    placed = {(s.matrix.layout, s.matrix.fault) for s in specs.values() if s.matrix}
    missing = [(lay, f) for lay in ("ddp", "fsdp2", "hsdp", "moe")
               for f in ("clean", "sdc", "compute_straggler", "comm_straggler", "hang", "input_stall", "recovery")
               if (lay, f) not in placed]
    assert missing == KNOWN_GAPS


def test_a_bad_matrix_place_is_refused(tmp_path):
    cells = tmp_path / "cells.yaml"
    cells.write_text("cells:\n  x:\n    target: m:f\n    matrix: {layout: tpu, fault: sdc}\n")
    with pytest.raises(ValueError, match="cell 'x': matrix"):
        load_cells(cells)


def test_scout_cells_matrix_refuses_cells_outside_it(tmp_path, capsys):
    cells = tmp_path / "configs" / "cells.yaml"
    cells.parent.mkdir()
    cells.write_text("cells:\n  x:\n    target: m:f\n")
    assert main(["cells", "matrix", "x", "--cells", str(cells)]) == 2
    assert "not in the matrix ['x']" in capsys.readouterr().err


def test_the_cell_table_summarises_what_was_reported():
    from scout_core.testing.cells import format_cell_table

    surfaces = ";".join(f"layers.1.x{v}.{s}" for v in ("0.1", "1", "10")
                        for s in ("output", "grad_input", "grad_param"))
    many = [dict(_record("sdc", "rank", [9]), surface=surfaces) for _ in range(3)]
    slow = [dict(_record("straggler", "machine", [8, 9]), hosts=["node1", "node1"])]
    decision = [{"kind": "decision", "scope": "verified", "ranks": [], "surface": "4"}]
    report = CellReport(name="c", verdict="PASS", world_size=16, injected=_bitflip(9), reported=many + slow + decision)
    table = format_cell_table([report], width=200)
    assert "sdc/rank r9 x3 layers.1.x0.1.output; straggler/machine r8,9 node1 s; restore verified gen 4" in table
    assert max(len(line) for line in format_cell_table([report], width=40).splitlines()) < 130
    machine = CellReport(name="hang-machine-lost", verdict="PASS", world_size=16, reported=slow * 2,
                         injected=[{"kind": "kill", "rank": r, "surface": "step.start"} for r in range(8, 16)])
    assert "kill@r8-15:step.start  straggler/machine r8,9 node1 x2" in format_cell_table([machine], width=120)
    assert max(len(line) for line in format_cell_table([report, machine], width=100).splitlines()) <= 100


def test_faults_a_cell_injects_through_its_parameters_are_no_false_positive():
    busy = CellSpec(name="busy", target="m:f", params={"expect": [{"kind": "hang", "ranks": [0]}]},
                    matrix=MatrixPlace("ddp", "hang"))
    named = CellReport(name="busy", verdict="PASS", world_size=16, injected=[], reported=[_record("hang", "rank", [0])])
    assert false_positives(named, busy) == [] and len(false_positives(named)) == 1
    machine = CellReport(name="m", verdict="FAIL", world_size=16, injected=_bitflip(9),
                         reported=[_record("straggler", "machine", [0, 1, 2, 3])])
    assert len(false_positives(machine)) == 1  # the wrong machine counts


_FAKE_TARGETS = '''
import subprocess
import sys

from scout_core.testing.cells import CellReport, fault_dicts


def cell(spec, world_size, workdir):
    if spec.params.get("noise"):  # a framework's banner, from this process and from one it starts
        print("NOISE from the parent " + spec.name)
        subprocess.run([sys.executable, "-c", "import sys; print('NOISE from a rank', file=sys.stderr)"], check=True)
    reported = [{"kind": "sdc", "scope": "rank", "ranks": [9], "hosts": [], "surface": "s"}] * spec.params["records"]
    return CellReport(name=spec.name, verdict="PASS", world_size=world_size, injected=fault_dicts(spec.faults),
                      reported=reported)
'''


def _matrix_of(tmp_path, cells: str) -> Path:
    (tmp_path / "fake_matrix_cells.py").write_text(_FAKE_TARGETS)
    path = tmp_path / "configs" / "cells.yaml"
    path.parent.mkdir()
    path.write_text("cells:\n" + cells)
    return path


_SDC = "    faults: [{surface: layers.1.output, rank: 9, kind: bitflip}]\n"


@pytest.mark.parametrize(("clean_records", "sdc_records", "code"), [(0, 1, 0), (1, 1, 1), (0, 0, 1)])
def test_scout_cells_matrix_fails_a_clean_cell_that_reports_and_a_faulty_one_that_does_not(
        tmp_path, capsys, clean_records, sdc_records, code):
    """Beside its own expectations every cell is held to run_cells' rule (a verdict of PASS from a clean cell that
    reported something, or a faulty one that reported nothing, is a FAIL), and any FAIL fails the command (CI)."""
    cells = _matrix_of(tmp_path, (
        f"  a-clean:\n    target: fake_matrix_cells:cell\n    matrix: {{layout: ddp, fault: clean}}\n"
        f"    params: {{records: {clean_records}}}\n"
        f"  a-sdc:\n    target: fake_matrix_cells:cell\n    matrix: {{layout: ddp, fault: sdc}}\n{_SDC}"
        f"    params: {{records: {sdc_records}}}\n"))
    out = tmp_path / "runs"
    assert main(["cells", "matrix", "--cells", str(cells), "--out", str(out)]) == code
    text = capsys.readouterr().out
    if clean_records:
        assert "FAIL a-clean" in text and "a clean cell must report nothing" in text
    if not sdc_records:
        assert "FAIL a-sdc" in text and "a faulty cell must report something" in text
    assert (out / "matrix.json").exists() and (out / "matrix.md").exists()


def test_a_cell_run_prints_one_line_per_cell_and_keeps_what_the_ranks_print(tmp_path, capfd):
    """What the cells' processes print (the frameworks' banners and warnings) goes to each cell's output.log, not
    the terminal; a failed cell shows its last lines. Fails if the output is not redirected at the file
    descriptors the processes inherit."""
    cells = _matrix_of(tmp_path, (
        "  quiet:\n    target: fake_matrix_cells:cell\n    matrix: {layout: ddp, fault: clean}\n"
        "    params: {records: 0, noise: true}\n"
        f"  loud:\n    target: fake_matrix_cells:cell\n    matrix: {{layout: ddp, fault: sdc}}\n{_SDC}"
        "    params: {records: 0, noise: true}\n"))
    work = tmp_path / "work"
    assert main(["cells", "run", "quiet", "loud", "--cells", str(cells), "--workdir", str(work)]) == 1
    captured = capfd.readouterr()
    terminal = captured.out + captured.err
    assert "[1/2] PASS quiet" in terminal and "[2/2] FAIL loud" in terminal
    assert "NOISE from the parent quiet" not in terminal and terminal.count("NOISE from a rank") == 1
    assert f"last lines the cell printed ({work / 'loud' / 'output.log'})" in terminal
    for name in ("quiet", "loud"):
        log = (work / name / "output.log").read_text()
        assert f"NOISE from the parent {name}" in log and "NOISE from a rank" in log
    main(["cells", "run", "quiet", "--cells", str(cells), "--show-output"])
    assert "NOISE from a rank" in capfd.readouterr().err


def test_steps_to_verdict_counts_from_the_fault_onset_to_the_first_verdict_at_or_after_it():
    from scout_core.testing.matrix import steps_to_verdict

    onset = [{"kind": "bitflip", "rank": 9, "surface": "x", "schedule": {"start": 4, "stop": None}}]
    early = dict(_record("sdc", "rank", [3]), step=2)  # before the fault: not its verdict
    wrong = dict(_record("sdc", "rank", [4]), step=5)  # a wrong rank: a false positive, not a detection
    named = [early, wrong, dict(_record("sdc", "rank", [9]), step=6), dict(_record("sdc", "rank", [9]), step=7),
             {"kind": "decision", "scope": "verified", "ranks": [], "step": 4}]
    report = CellReport(name="c", verdict="PASS", world_size=16, injected=onset, reported=named)
    assert steps_to_verdict(report) == 2
    assert steps_to_verdict(CellReport(name="c", verdict="PASS", world_size=16, injected=onset, reported=[])) is None
    assert steps_to_verdict(CellReport(name="c", verdict="PASS", world_size=16, injected=[], reported=named)) is None
    summary = matrix_summary({"c": _spec("c", "ddp", "sdc")}, [report])
    assert "| sdc | 1/1 | 1/1 | sdc/rank | 2 | - | 2 |" in summary  # steps 2; the early and the wrong are false ones
    shipped = dataclasses.replace(_spec("c", "ddp", "sdc"), tags=("shipped",))  # run at every shipped setting
    assert "| sdc | 1/1 | 1/1 | sdc/rank | 2 | 2 | 2 |" in matrix_summary({"c": shipped}, [report])


def test_a_handler_a_framework_keeps_on_stdout_still_writes_in_the_next_cell(tmp_path):
    """DeepSpeed's logger keeps a StreamHandler on the sys.stdout it saw at import, which happens inside the first
    cell's capture: the next cell's output must still reach its own log, not a closed file."""
    import subprocess
    import sys

    script = f'''
import logging, sys
from pathlib import Path
from scout_core.testing.cells import _output_to
log = logging.getLogger("framework")
with _output_to(Path({str(tmp_path / "a.log")!r})):
    log.addHandler(logging.StreamHandler(sys.stdout))
    log.warning("first cell")
with _output_to(Path({str(tmp_path / "b.log")!r})):
    log.warning("second cell")
'''
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "first cell" in (tmp_path / "a.log").read_text()
    assert (tmp_path / "b.log").read_text() == "second cell\n"  # not a "--- Logging error ---" about a closed file


def test_the_slowest_cells_are_listed_slowest_first():
    from scout_core.testing.matrix import slowest_cells

    text = slowest_cells(REPORTS, count=2)
    lines = text.strip().splitlines()
    assert lines[0].startswith("2 slowest cells") and len(lines) == 3
    walls = [float(line.split()[0]) for line in lines[1:]]
    assert walls == sorted((r.wall_s for r in REPORTS), reverse=True)[:2]
