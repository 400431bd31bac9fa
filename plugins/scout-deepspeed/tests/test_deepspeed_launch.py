"""The real launcher: ``torchrun`` on 4 gloo ranks runs a DeepSpeed script as users write one (its config file
with a "scout" section, named by ``--deepspeed_config``; DeepSpeed builds the optimizer from it) under ZeRO-3."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from scout_core.report import read_incidents

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve().parent / "ds_train.py"


def _config(tmp_path: Path, **scout: object) -> Path:
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "scout": {"enabled": True, "replay": {"cadence": {"hidden": 1}},
                  "report": {"jsonl_path": str(tmp_path / "incidents.jsonl"), "log_level": "ERROR"}, **scout},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


def _torchrun(tmp_path: Path, config: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT),
           "--deepspeed", "--deepspeed_config", str(config), "--out", str(tmp_path / "out"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_torchrun_deepspeed_script_names_the_faulty_rank_and_stops(tmp_path):
    run = _torchrun(tmp_path, _config(tmp_path, actions={"on_verdict": "stop"}), "--fault-rank", "2")
    assert run.returncode != 0, "the job should have stopped on the verdict"
    assert re.search(r"exitcode\s*:\s*75", run.stderr), run.stderr[-3000:]  # SCOUT's stop status
    # torchrun's own summary names the verdict (SCOUT's error file), not a bare exit status
    assert "SCOUT stopped this job (exit status 75) on its verdict: silent data corruption on rank 2" in \
        run.stderr.rpartition("Root Cause")[2], run.stderr[-3000:]
    incidents = list(read_incidents(tmp_path / "incidents.jsonl"))
    assert incidents and {(i.kind.value, i.scope.value, tuple(i.ranks)) for i in incidents} == {("sdc", "rank", (2,))}


def test_torchrun_deepspeed_script_clean_run_checks_at_optimizer_steps_only(tmp_path):
    report = {"jsonl_path": str(tmp_path / "incidents.jsonl"), "log_level": "WARNING"}
    run = _torchrun(tmp_path, _config(tmp_path, report=report), "--steps", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    # One attach line, from rank 0, whatever DeepSpeed did to logging (it showed none before)
    assert len(re.findall(r"^SCOUT on: run \w+, 4 ranks in 1 peer group\(s\) of 4; hang observer, replay "
                          r"\([^)]*hidden every 1[^)]*\)", run.stderr, flags=re.M)) == 1, run.stderr[-3000:]
    for rank in range(4):
        result = json.loads((tmp_path / "out" / f"rank-{rank}.json").read_text())
        # 4 optimizer steps of 2 micro-batches each: one check per optimizer step, none skipped
        assert result["steps"] == 4 and [c[0] for c in result["checks"]] == [1, 2, 3, 4], result
        assert not any(c[2] for c in result["checks"]), result
    assert not (tmp_path / "incidents.jsonl").exists() or list(read_incidents(tmp_path / "incidents.jsonl")) == []
    from scout_core.cli import main

    assert main(["report", str(tmp_path / "incidents.jsonl")]) == 0  # a clean run is reported as one

