"""``scout try megatron``: a new user's first run, as the README's first screen gives it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_scout_try_megatron_names_the_defective_rank_at_the_shipped_settings(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "scout_core", "try", "megatron", "--fault", "sdc",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "SCOUT on: run" in out and "4 ranks" in out, out[-4000:]
    assert "SCOUT found silent data corruption on rank 1 (rank)" in out, out[-4000:]
    assert "as it should: SCOUT named rank 1 and stopped the job" in out, out[-4000:]
