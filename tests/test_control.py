"""Runtime control (``scout ctl``): commands reach every rank at the same step boundary, only with the run's
secret, and only for keys that can change live."""

from __future__ import annotations

import json
import os
import stat
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import scout_core
from integrations_tests.models import batches, start_rank
from scout_core.cli import main
from scout_core.config import ScoutConfig, load
from scout_core.control import ControlError, RunControl, check_live, send_command
from scout_core.testing.launcher import RankContext, launch

WORLD, STEPS = 4, 12


def _control(tmp_path, run_id: str = "run-a") -> RunControl:
    cfg = SimpleNamespace(control=SimpleNamespace(every_steps=2, directory=str(tmp_path)))
    return RunControl(cfg, run_id=run_id, rank=0, world_control=None)


def test_only_live_keys_with_values_the_configuration_accepts():
    assert check_live("replay.cadence.hidden", "25") == 25
    assert check_live("actions.on_verdict", "stop") == "stop"
    with pytest.raises(ControlError, match="observer.enabled cannot change in a running job"):
        check_live("observer.enabled", "false")
    with pytest.raises(ControlError, match="kappa"):
        check_live("consensus.kappa", "-1")
    with pytest.raises(ControlError, match="on_verdict"):
        check_live("actions.on_verdict", "explode")
    job = ScoutConfig()
    job.checkpoint.enabled = True
    for recipe in ("embedding", "output", "optimizer", "expert"):
        setattr(job.replay.cadence, recipe, 0)
    with pytest.raises(ControlError, match="checkpoint.enabled"):  # the job's own cross-field rules hold
        check_live("replay.cadence.hidden", "0", job)


def test_the_folder_is_the_owners_and_a_restart_starts_clean(tmp_path):
    control = _control(tmp_path)
    assert stat.S_IMODE(os.stat(control.folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(control.folder / "secret").st_mode) == 0o600
    send_command(str(control.folder), "pause")
    again = _control(tmp_path)
    assert list((again.folder / "commands").iterdir()) == [] and again._secret != control._secret
    again.close()
    assert not again.folder.exists()


def test_scout_ctl_sends_and_refuses(tmp_path, capsys):
    control = _control(tmp_path, "run-b")
    assert main(["ctl", "run-b", "--dir", str(tmp_path), "set", "replay.cadence.hidden=7"]) == 0
    assert main(["ctl", str(control.folder), "pause"]) == 0
    assert main(["ctl", "run-b", "--dir", str(tmp_path), "set", "observer.enabled=false"]) == 2
    assert "cannot change in a running job" in capsys.readouterr().err
    assert main(["ctl", "no-such-run", "--dir", str(tmp_path), "resume"]) == 2
    assert "no running job 'no-such-run'" in capsys.readouterr().err
    forged = control.folder / "commands" / "9-forged.json"
    forged.write_text(json.dumps({"id": "forged", "op": "resume", "secret": "guess"}))
    read = control._read()
    assert [(c["op"], c.get("bad")) for c in read] == [
        ("set", None), ("pause", None), ("resume", "wrong secret: only the job's owner can steer it")]
    assert all("secret" not in c for c in read) and list((control.folder / "commands").iterdir()) == []


def _raw_command(folder: str, command: dict[str, Any]) -> None:
    """A command file written by hand, with the run's secret: the job checks it again."""
    with open(os.path.join(folder, "secret")) as fh:
        secret = fh.read().strip()
    path = os.path.join(folder, "commands", f"{time.time_ns()}-raw.json")
    with open(path, "w") as fh:
        json.dump({"id": "raw", **command, "secret": secret}, fh)


def _steered_rank(ctx: RankContext) -> dict[str, Any]:
    a, _injector, par, opt = start_rank(ctx)
    cfg = load(None, ["replay.cadence.hidden=1", "control.every_steps=4", f"control.directory={a['dir']}",
                      "report.run_id=steered", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    folder = os.path.join(a["dir"], "steered")
    for step, (x, y) in enumerate(batches(ctx.rank, STEPS, seed=0), start=1):
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if ctx.rank == 0 and step == 2:  # the operator, while the job runs
            send_command(folder, "pause")
            _raw_command(folder, {"op": "set", "key": "observer.enabled", "value": "false"})  # past the CLI's check
        if ctx.rank == 0 and step == 6:
            send_command(folder, "set", "replay.cadence.hidden", "3")
            send_command(folder, "set", "actions.on_verdict", "stop")
            send_command(folder, "resume")
        dist.barrier()  # the commands are in the folder before any rank reaches the next control boundary
    checks = [r.step for r in handle.replay.history]
    cadence = handle.config.replay.cadence.hidden
    answers = open(os.path.join(folder, "applied.jsonl")).read() if ctx.rank == 0 else ""
    observers_see = handle.tracker.record.live()  # what this rank's observer reads at its next verdict
    handle.close()
    return {"checks": checks, "cadence": cadence, "answers": answers, "gone": not os.path.exists(folder),
            "observers_see": observers_see}


def test_every_rank_applies_the_commands_at_the_same_step(tmp_path):
    result = launch(_steered_rank, WORLD, timeout_s=120,
                    args={"faults": [], "seed": 0, "layout": "ddp", "dir": str(tmp_path)})
    assert result.ok, result.failures()
    out = result.values()
    # Checks at 1-4; paused at step 4's boundary (after its check); cadence 3 and resumed at step 8's.
    assert all(o["checks"] == [1, 2, 3, 4, 9, 12] and o["cadence"] == 3 for o in out), [o["checks"] for o in out]
    answers = [json.loads(line) for line in out[0]["answers"].splitlines()]
    assert [(a["op"], a["key"], a["step"], a["status"]) for a in answers] == [
        ("pause", "", 4, "applied"), ("set", "observer.enabled", 4, "refused"),
        ("set", "replay.cadence.hidden", 8, "applied"), ("set", "actions.on_verdict", 8, "applied"),
        ("resume", "", 8, "applied")]
    assert all(o["observers_see"] == ("stop", None) for o in out)  # not only rank 0's trainer
    assert "cannot change in a running job" in answers[1]["reason"]
    assert out[0]["gone"]  # the folder and its secret go with the job


def test_a_key_the_framework_adapter_fixed_at_attach_is_refused():
    """DeepSpeed's adapter turns the optimizer check off for an optimizer replay cannot reproduce: `scout ctl set`
    must not turn it back on (each check would fail, or start a subprocess in the optimizer's constructor)."""
    from types import SimpleNamespace

    from scout_core.config import ScoutConfig
    from scout_core.live_control import LiveControl

    fake = SimpleNamespace(config=ScoutConfig(),
                           adapter=SimpleNamespace(pinned={"replay.cadence.optimizer": "off: DeepSpeedCPUAdam"}))
    live = LiveControl(fake.config, pinned=fake.adapter.pinned)
    status, reason = live.apply({"op": "set", "key": "replay.cadence.optimizer", "value": "1"})
    assert status == "refused" and "fixed when SCOUT attached" in reason and "DeepSpeedCPUAdam" in reason
    assert fake.config.replay.cadence.optimizer == ScoutConfig().replay.cadence.optimizer
