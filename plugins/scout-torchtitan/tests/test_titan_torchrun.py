"""The user's command line, on the real launcher: ``torchrun -m torchtitan.train`` on 4 gloo ranks trains
TorchTitan's llama3 debug model with SCOUT switched on by flags alone, in both forms:

* ``--module <registry> --config llama3_debugmodel --scout.enable --scout.<key> VALUE``;
* an unchanged TorchTitan config plus ``--override.imports scout_torchtitan.override.scout={...}``.

``--module titan_cpu`` (tests/cpu_site) is the plugin's registry made runnable on this CPU machine; on a GPU
machine the same flags go with ``--module scout_torchtitan``. A bit flip in rank 1's block is named (rank 1,
SDC) through the override form here, through the first form in ``scout try torchtitan`` (test_titan_tryout.py);
without the switch nothing of SCOUT runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 6


def _train(tmp_path: Path, config: str, *flags: str, flip: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "torchtitan.train", "--module", "titan_cpu", "--config", config,
           "--dump_folder", str(out), "--training.steps", str(STEPS), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_CPU_FLIP": "1" if flip else "0",
           "PYTHONPATH": os.pathsep.join([str(HERE / "cpu_site"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return run, out


def _why(run: subprocess.CompletedProcess) -> str:
    own = [ln for ln in run.stderr.splitlines() if any(k in ln for k in ("Error", "error:", "what():"))]
    return "\n".join(own[:30]) + "\n...\n" + run.stderr[-3000:]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_override_form_names_a_bit_flip(tmp_path):
    """The ``--module ... --scout.enable`` form runs in ``scout try torchtitan`` (test_titan_tryout.py: a bit flip
    named at the shipped settings, exactly one verdict); this is the other form."""
    jsonl = tmp_path / "incidents.jsonl"
    keys = {"replay.cadence.hidden": 1, "report.jsonl_path": str(jsonl)}
    flags = ["llama3_debugmodel_plain", "--override.imports", f"scout_torchtitan.override.scout={json.dumps(keys)}"]
    run, _ = _train(tmp_path, *flags, flip=True)
    assert run.returncode == 0, _why(run)
    assert "SCOUT attached" in run.stdout + run.stderr, run.stderr[-2000:]
    records = _records(jsonl)
    assert records and {(r["kind"], r["scope"], tuple(r["ranks"])) for r in records} == {("sdc", "rank", (1,))}


def test_without_the_switch_nothing_of_scout_runs(tmp_path):
    run, out = _train(tmp_path, "llama3_debugmodel")
    assert run.returncode == 0, _why(run)
    assert "SCOUT attached" not in run.stdout + run.stderr
