"""The demo (``nox -s demo``), at 4 ranks and 60 steps: a defective unit named, the job stopped by its action,
torchrun's restart resumed from the verified checkpoint, the table and the HTML report written. The demo checks its
own story and exits 1 when any part of it does not happen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_tells_the_whole_story(tmp_path):
    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--out", str(out), "--ranks", "4",
                          "--steps", "80", "--fault-rank", "3", "--fault-step", "61"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    tail = run.stdout[-3000:] + "\n" + (out / "torchrun.log").read_text()[-3000:] if (out / "torchrun.log").exists() \
        else run.stdout[-3000:]
    assert run.returncode == 0, tail
    assert "restart 1: restored the verified checkpoint of step 30" in run.stdout
    assert "sdc   rank   3" in run.stdout and "Machines to drain: node0" in run.stdout
    page = (out / "report.html").read_text()
    assert page.count("<circle") == 1
    assert page.count("<rect") == 4 and page.count('stroke="#000"') == 1  # the SDC check's round, rank 3 outlined
