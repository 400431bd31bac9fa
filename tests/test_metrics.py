"""Prometheus metrics (``report.prometheus``) scraped over real HTTP from a 4-rank job with a real fault."""

from __future__ import annotations

import os
import socket
import urllib.request
from typing import Any

import pytest
import torch
import torch.distributed as dist

import scout_core
from integrations_tests.models import batches, install_block_faults, start_rank
from scout_core.config import load
from scout_core.testing.inject import Fault, FaultKind, Schedule
from scout_core.testing.launcher import RankContext, free_port_block, launch

pytest.importorskip("prometheus_client")

WORLD = 4
STEPS = 8
SDC_RANK, SDC_STEP = 2, 3


def _scrape(port: int) -> dict[str, float]:
    """One scrape, as Prometheus makes it: ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _metrics_rank(ctx: RankContext) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(ctx.rank)  # four ranks on this machine: ports base .. base + 3
    a, injector, par, opt = start_rank(ctx)
    state = {"step": 0}
    install_block_faults(par, injector, ctx.rank, state)
    # Checks at every second step: the boundaries between them must count nothing.
    cfg = load(None, ["replay.cadence.hidden=2", f"report.jsonl_path={a['dir']}/incidents.jsonl",
                      f"report.prometheus.port={a['port']}", f"report.prometheus.textfile_dir={a['dir']}/prom",
                      "report.prometheus.textfile_interval_s=0.001", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    port = a["port"] + ctx.rank
    bound = handle.metrics.server.server_address[0]
    scrapes: dict[int, Any] = {}
    for step, (x, y) in enumerate(batches(ctx.rank, STEPS, seed=0), start=1):
        state["step"] = step
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if ctx.rank == 0 and step in (3, STEPS):  # a scraper reads every rank's endpoint while the job runs
            scrapes[step] = [_scrape(a["port"] + r) for r in range(WORLD)]
        dist.barrier()
    textfile = handle.metrics.textfile_path
    with open(textfile) as fh:
        text = fh.read()
    checks = [(r.step, bool(r.incidents or r.incidents_global)) for r in handle.replay.history]
    handle.close()
    with socket.socket() as s:  # the endpoint is gone with the handle, and so is the textfile
        closed = s.connect_ex(("127.0.0.1", port)) != 0 and not os.path.exists(textfile)
    return {"scrapes": scrapes, "bound": bound, "closed": closed, "textfile": text, "checks": checks,
            "textfile_name": os.path.basename(textfile)}


def test_every_rank_exports_its_checks_incidents_and_state(tmp_path):
    faults = [Fault(surface="layers.1.output", rank=SDC_RANK, kind=FaultKind.BITFLIP, bit=12,
                    schedule=Schedule(start=SDC_STEP))]
    args = {"faults": faults, "seed": 0, "layout": "ddp", "dir": str(tmp_path), "port": free_port_block(WORLD)}
    result = launch(_metrics_rank, WORLD, timeout_s=120, args=args)
    assert result.ok, result.failures()
    out = result.values()
    checks = out[0]["checks"]
    assert [s for s, _ in checks] == [2, 4, 6, 8]
    found = [s for s, f in checks if f]
    assert len(found) == 1 and found[0] > SDC_STEP  # the sampled block rotates: block 1 is checked once
    scrapes = out[0]["scrapes"]
    for r in range(WORLD):
        early, late = scrapes[3][r], scrapes[STEPS][r]
        label = f'{{rank="{r}"}}'
        assert early[f"scout_replay_checks_total{label}"] == 1  # step 2 only; step 3's boundary checks nothing
        assert early[f"scout_replay_checks_agreed_total{label}"] == 1
        assert late[f"scout_replay_checks_total{label}"] == 4
        assert late[f"scout_replay_checks_agreed_total{label}"] == 3
        assert late[f"scout_replay_checks_skipped_total{label}"] == 0
        assert 0 < late[f"scout_seconds_since_clean_check{label}"] < late[f"scout_uptime_seconds{label}"]
        assert late[f"scout_last_clean_check_timestamp_seconds{label}"] > early[
            f"scout_last_clean_check_timestamp_seconds{label}"] > 0
        assert late[f"scout_observer_up{label}"] == 1
        assert late[f"scout_step{label}"] == STEPS
        assert late[f'scout_certification_step{{rank="{r}",state="verified"}}'] == -1  # checkpoints are off
        assert late[f"scout_overhead_seconds_total{label}"] > 0
        assert any(k.startswith("scout_info{") and f'rank="{r}"' in k and "run_id=" in k for k in late)
        assert out[r]["bound"] == "127.0.0.1" and out[r]["closed"]
        assert f"scout_replay_checks_total{label} 4.0" in out[r]["textfile"]
        assert out[r]["textfile_name"].endswith(f"_rank{r}.prom") and out[r]["textfile_name"] != f"scout_rank{r}.prom"
    sdc = [late[f'scout_incidents_total{{kind="sdc",rank="{r}",scope="rank"}}']
           for r, late in enumerate(scrapes[STEPS])]
    assert sum(sdc) == 1  # one record of the one verdict, counted by the rank that wrote it
    assert all(s[f'scout_incidents_total{{kind="sdc",rank="{r}",scope="rank"}}'] == 0  # present at 0 before
               for r, s in enumerate(scrapes[3]))


def _taken_rank(ctx: RankContext) -> str:
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx)
    os.environ["LOCAL_RANK"] = "0"  # misconfigured: both ranks want the same port
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cfg = load(None, [f"report.prometheus.port={ctx.args['port']}", "observer.enabled=false"])
    try:
        scout_core.enable(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    except RuntimeError as exc:
        return str(exc)
    return "enabled"


def test_a_port_taken_fails_every_rank_at_enable_naming_it():
    port = free_port_block(1)
    result = launch(_taken_rank, 2, timeout_s=60, args={"port": port})
    assert result.ok, result.failures()
    assert all(f"127.0.0.1:{port}" in v and "cannot serve metrics" in v for v in result.values())


def test_the_documented_dashboard_and_alerts_read_metrics_that_exist():
    """docs/metrics.md and docs/grafana-dashboard.json name only series a rank exports."""
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from scout_core.config import PrometheusConfig
    from scout_core.metrics import ScoutMetrics

    docs = Path(__file__).resolve().parents[1] / "docs"
    metrics = ScoutMetrics(PrometheusConfig(), rank=0)
    metrics.describe(run_id="r", host="h")
    assert "scout_observer_up{" not in generate_latest(metrics.registry).decode()  # only where an observer runs
    metrics.observer_up.labels("0").set(1)
    exported = set(re.findall(r"^(scout_\w+)", generate_latest(metrics.registry).decode(), re.M))
    dashboard = json.loads((docs / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append((docs / "metrics.md").read_text())
    named = {m for e in exprs for m in re.findall(r"\b(scout_[a-z_]+)", e)} - {"scout_rank"}  # the textfile
    assert named and named <= exported, named - exported


def test_the_textfile_is_named_after_the_job_so_a_restart_rewrites_it(monkeypatch):
    from scout_core.metrics import job_name

    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(name, raising=False)
    assert job_name("a1b2") == "a1b2"  # nothing stable: each launch its own files
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default rendezvous id names no job
    assert job_name("a1b2") == "a1b2"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/7")
    assert job_name("a1b2") == "torchrun-job-7" and job_name("c3d4") == "torchrun-job-7"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert job_name("a1b2") == "slurm-4242"
    monkeypatch.setenv("SLURM_STEP_ID", "3")  # the steps of one allocation (a sweep) never share a file
    assert job_name("a1b2") == "slurm-4242.3"
    assert job_name("mine", configured=True) == "mine"  # report.run_id set by the user wins


_EXIT_WITHOUT_CLOSE = '''
import sys
from scout_core.config import PrometheusConfig
from scout_core.metrics import ScoutMetrics
from scout_core.report import Incident
m = ScoutMetrics(PrometheusConfig(textfile_dir=sys.argv[1]), rank=3)
m.describe(run_id="r1", host="h")
m.emit(Incident(kind="sdc", scope="rank", ranks=[5], hosts=["h"], step=4, reason="x"))
raise SystemExit(75)  # a verdict's stop that never reached close()
'''


def test_a_rank_that_exits_without_close_leaves_a_textfile_that_says_it_stopped(tmp_path, monkeypatch):
    """The verdict that stopped the job stays readable, and scout_running 0 keeps a stall alert quiet; close()
    (a clean end) removes the file."""
    import subprocess
    import sys

    from scout_core.config import PrometheusConfig
    from scout_core.metrics import ScoutMetrics

    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    run = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 75, run.stderr
    text = (tmp_path / "scout_r1_rank3.prom").read_text()
    assert 'scout_running{rank="3"} 0.0' in text
    assert 'scout_incidents_total{kind="sdc",rank="3",scope="rank"} 1.0' in text
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    metrics = ScoutMetrics(PrometheusConfig(textfile_dir=str(tmp_path)), rank=3)
    metrics.describe(run_id="r1", host="h")  # the job's next launch: the same file
    metrics.write_textfile()
    assert 'scout_running{rank="3"} 1.0' in (tmp_path / "scout_r1_rank3.prom").read_text()
    metrics.close()
    assert not (tmp_path / "scout_r1_rank3.prom").exists()
    metrics = ScoutMetrics(PrometheusConfig(textfile_dir=str(tmp_path)), rank=3)
    metrics.describe(run_id="r1", host="h")
    metrics.close(keep_textfile=True)  # what handle.close() does for a rank that stopped for a verdict or failed
    assert 'scout_running{rank="3"} 0.0' in (tmp_path / "scout_r1_rank3.prom").read_text()


def _stopped_rank(ctx: RankContext) -> dict[str, Any]:
    from scout_core.actions import ScoutStop

    a, injector, par, opt = start_rank(ctx)
    state = {"step": 0}
    install_block_faults(par, injector, ctx.rank, state)
    cfg = load(None, ["replay.cadence.hidden=1", "actions.on_verdict=stop", "observer.enabled=false",
                      f"report.prometheus.textfile_dir={a['dir']}/prom", "report.run_id=stopjob",
                      "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg)
    stopped_at = None
    try:
        for step, (x, y) in enumerate(batches(ctx.rank, STEPS, seed=0), start=1):
            state["step"] = step
            torch.nn.functional.mse_loss(par.model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except ScoutStop:
        stopped_at = state["step"]
    finally:
        handle.close()  # as every plugin does on the way out
    with open(os.path.join(a["dir"], "prom", f"scout_stopjob_rank{ctx.rank}.prom")) as fh:
        return {"stopped_at": stopped_at, "textfile": fh.read()}


def test_a_rank_stopped_by_a_verdict_keeps_its_last_textfile_through_close(tmp_path):
    """close() after a verdict's stop (every plugin closes on the way out) keeps the file with scout_running 0 and
    the verdict counted, rather than removing it with the evidence."""
    faults = [Fault(surface="layers.1.output", rank=SDC_RANK, kind=FaultKind.BITFLIP, bit=12,
                    schedule=Schedule(start=SDC_STEP))]
    result = launch(_stopped_rank, WORLD, timeout_s=120,
                    args={"faults": faults, "seed": 0, "layout": "ddp", "dir": str(tmp_path)})
    assert result.ok, result.failures()
    out = result.values()
    assert all(o["stopped_at"] is not None for o in out)
    assert all(f'scout_running{{rank="{r}"}} 0.0' in o["textfile"] for r, o in enumerate(out))
    counted = [f'scout_incidents_total{{kind="sdc",rank="{r}",scope="rank"}} 1.0' in o["textfile"]
               for r, o in enumerate(out)]
    assert sum(counted) == 1
