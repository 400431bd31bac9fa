"""``scout try deepspeed``: a new user's first run, as the README's first screen gives it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("fault", ["sdc", "hang"])
def test_scout_try_deepspeed_names_the_faulty_rank_at_the_shipped_settings(tmp_path, fault):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "scout_core", "try", "deepspeed", "--fault", fault,
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
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
        (stacks,) = re.findall(r"rank 1's stacks at the verdict: (\S+)$", run.stdout, flags=re.M)
        assert "tryout.py" in Path(stacks).read_text(), out[-4000:]
