"""``scout report --html``: one self-contained page (timeline, per-rank timings with the flagged ranks marked,
certification history), every record string escaped, rendered by a real headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from scout_core.cli import main
from scout_core.report import Incident, JsonlSink
from scout_core.report_html import render_html, timing_rounds

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def _timing(values: list[float], flagged: int, surface: str = "replay.compute_s") -> dict:
    return {"surfaces": {surface: {"status": "attributed", "bitmap": [int(r == flagged) for r in range(len(values))],
                                   "evidence": values, "peer_ranks": list(range(len(values))), "surface": surface,
                                   "reference": sorted(values)[len(values) // 2]}}}


def _records(t0: float = 1_764_000_000.0) -> list[Incident]:
    slow = [0.010] * 16
    slow[9] = 0.031
    return [
        Incident(kind="sdc", scope="rank", ranks=[9], hosts=["node1"], step=5, surface=f"layers.1.x1.output{HOSTILE}",
                 evidence={"surfaces": {"layers.1.x1.output": {  # signatures are numbers, never timings
                     "status": "attributed", "bitmap": [0, 1], "evidence": [11400714819323199225, 42],
                     "peer_ranks": [8, 9]}},
                     # the check's round of timings, kept beside the signatures: nobody slow, rank 9 named
                     "timing": {"replay.compute_s": _timing([0.010] * 16, -1)["surfaces"]["replay.compute_s"]}},
                 reason=f"signature differs {HOSTILE}", run_id="job-7", time_unix=t0),
        Incident(kind="sdc", scope="rank", ranks=[9], hosts=["node1"], step=8, surface="layers.1.x1.output",
                 reason="signature differs", run_id="job-7", time_unix=t0 + 30),
        Incident(kind="straggler", scope="rank", ranks=[9], hosts=["node1"], step=11, surface="replay.compute_s",
                 evidence=_timing(slow, 9), reason="replay compute slower", run_id="job-7", time_unix=t0 + 60),
        Incident(kind="hang", scope="rank", ranks=[3], hosts=[HOSTILE], step=20, reason="frozen", run_id="job-7",
                 time_unix=t0 + 120),
    ]


def _decisions(path: Path) -> None:
    rows = [{"record": "decision", "time_unix": 1_764_000_061.0, "source": "verified", "generation": 4,
             "reason": f"confirmed SDC {HOSTILE}", "failure": "sdc", "binding": True,
             "certifier": {"latest": 10, "candidate": 8, "verified": 4}},
            {"record": "resume", "time_unix": 1_764_000_090.0, "source": "verified", "generation": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn")


def test_the_page_shows_every_part_and_escapes_every_record_string():
    page = render_html(_records(), decisions=[{"record": "decision", "reason": HOSTILE, "certifier": {}}])
    assert "<script" not in page and "onerror=alert" not in page.replace("onerror=alert(1)&gt;", "")
    assert "&lt;script&gt;" in page
    for part in ("Timeline", "Replay timings per rank", "Certification and retrieval", "Machines to drain"):
        assert f"<h2>{part}</h2>" in page
    assert page.count("<circle") == 4  # one marker per record on the timeline
    assert page.count('stroke="#000"') == 2  # rank 9 outlined in the SDC check's round and its slow round
    assert page.count("<rect") == 32
    assert "<p>node1</p>" in page  # the SDC's machine is the one to drain; the hang's is not
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched


def test_timing_rounds_read_only_numeric_peer_timings():
    rounds = timing_rounds(_records())
    assert [r["kind"] for r in rounds] == ["sdc", "straggler"]
    assert rounds[0]["flagged"] == {9} and rounds[0]["ratio"][9] == 1.0  # the SDC record names rank 9
    assert rounds[1]["flagged"] == {9} and round(rounds[1]["ratio"][9], 2) == 3.1


def test_scout_report_html_writes_the_page_with_the_decisions_beside_it(tmp_path, capsys):
    records = tmp_path / "incidents.jsonl"
    sink = JsonlSink(records)
    for inc in _records():
        sink.emit(inc)
    _decisions(tmp_path / "decisions.jsonl")
    out = tmp_path / "report.html"
    assert main(["report", str(records), "--html", str(out)]) == 0
    captured = capsys.readouterr()
    assert "4 records, 2 decisions" in captured.out and "decisions.jsonl:3: not a decision record" in captured.err
    page = out.read_text()
    assert "confirmed SDC &lt;script&gt;" in page and "10 / 8 / 4" in page
    assert main(["report", str(records), "--html", str(out), "--decisions", str(tmp_path / "none.jsonl")]) == 2


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("SCOUT_REQUIRE_BROWSER"):
        pytest.fail("SCOUT_REQUIRE_BROWSER is set but no chromium is installed (.ci/run installs Debian's)")
    return found


def test_the_page_renders_in_headless_chromium(tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium here (.ci/run installs Debian's and requires it)")
    page = tmp_path / "report.html"
    page.write_text(render_html(_records(), title="SCOUT render check"))
    shot = tmp_path / "report.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "SCOUT render check" in dom.stdout and dom.stdout.count("<circle") == 4
    assert dom.stdout.count("<rect") == 32  # the heatmap's two rounds of 16 ranks
    assert "<script" not in dom.stdout  # the hostile strings stayed text after parsing
    run = subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1400,1600", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", run.stderr[-2000:]
    from matplotlib.image import imread  # the bench extra, installed with the tests

    pixels = imread(shot)[..., :3]
    assert pixels.std() > 0.05, "a blank page"
    sdc_red = (abs(pixels - [0xD6 / 255, 0x27 / 255, 0x28 / 255]).max(axis=-1) < 0.05).sum()
    assert sdc_red > 20, "the timeline's SDC markers were not drawn"
    keep = os.environ.get("SCOUT_SCREENSHOT_DIR")
    if keep:  # for a person to look at
        shutil.copy(shot, Path(keep) / "report.png")
