"""The check every plugin's try-out test makes: ``scout try PLUGIN --fault F`` as a new user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["check_tryout"]


def check_tryout(plugin: str, fault: str, workdir: Path, *, root: Path) -> None:
    """Run ``scout try`` for ``plugin`` with ``fault`` (``sdc`` or ``hang``) and assert what it promises: the attach
    line, exactly one verdict and on rank 1, torchrun's own summary naming it, under 3 minutes, and for a hang the
    stuck rank's stacks showing the try-out's line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "scout_core", "try", plugin, "--fault", fault, "--out", str(workdir)],
                         env=env, capture_output=True, text=True, timeout=400, cwd=workdir)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "SCOUT on: run" in out and "4 ranks" in out, out[-4000:]
    found = re.findall(r"^SCOUT found (.*)$", run.stdout, flags=re.M)
    kind = "silent data corruption" if fault == "sdc" else "a hang"
    assert len(found) == 1 and found[0].startswith(f"{kind} on rank 1 (rank)"), out[-4000:]  # one verdict, no other
    assert "torchrun's root cause: SCOUT stopped this job" in run.stdout and f"{kind} on rank 1" in run.stdout
    assert "as it should: SCOUT named rank 1 and stopped the job" in run.stdout, out[-4000:]
    seconds = float(re.search(r"torchrun ended with status \d+ after (\d+) s", run.stdout).group(1))
    assert seconds < 180, f"the try-out took {seconds:.0f} s (promised: under 3 minutes)"
    if fault == "hang":  # the stuck rank's stacks, written before the stop, show where the try-out holds it
        stacks = re.findall(r"rank 1's stacks at the verdict: (/\S+)$", run.stdout, flags=re.M)
        assert len(stacks) == 1 and "tryout.py" in Path(stacks[0]).read_text(), out[-4000:]
