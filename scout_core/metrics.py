"""Per-rank Prometheus metrics (``report.prometheus.*``): what an operator's dashboard and alerts read.

Each rank keeps its own registry (never the process-global one: the training job may export its own metrics,
and SCOUT's must go away with :meth:`ScoutHandle.close`) and serves it on ``port + LOCAL_RANK`` at the configured
address, loopback by default, and/or rewrites ``scout_rank<R>.prom`` in a node exporter's textfile directory.

Incidents are counted where they are recorded: every record goes through one rank's reporter, so the sum over
ranks counts each verdict once. Hang verdicts are reached by the out-of-band observers, separate processes
without an endpoint of their own: they appear in the incident file, and a hung trainer cannot serve metrics
anyway (its ``scout_boundary_timestamp_seconds`` stops moving, which is what an alert on a stall reads).

Everything here runs on the trainer's own thread at the step boundary, except the scrape, which only reads;
a failure inside never reaches training (the boundary logs it once and goes on).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import tempfile
import time
from typing import Any

from scout_core.config import PrometheusConfig
from scout_core.private_dir import shared_dir
from scout_core.report import Incident, IncidentKind, IncidentScope
from scout_core.run_log import check_outcome

__all__ = ["JOB_ID_ENV", "LOCAL_RANK_ENV", "ScoutMetrics", "job_name", "local_rank", "start_metrics"]

_log = logging.getLogger("scout")

CERT_STATES = ("latest", "candidate", "verified")

LOCAL_RANK_ENV = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""Where a rank's index on its machine is found: torchrun, then Slurm's srun, Open MPI and MPICH / Intel MPI."""

_VERDICTS = {IncidentKind.SDC, IncidentKind.STRAGGLER, IncidentKind.HANG, IncidentKind.DATA_STALL,
             IncidentKind.CHECKPOINT_STALL}


def local_rank() -> int:
    for name in LOCAL_RANK_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class ScoutMetrics:
    """The metrics of one rank; :meth:`emit` is an incident sink, :meth:`boundary` runs after each step."""

    def __init__(self, cfg: PrometheusConfig, *, rank: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Info
        except ImportError as exc:
            raise RuntimeError("report.prometheus needs prometheus-client: pip install 'scout-core[prometheus]'"
                               ) from exc
        self.cfg = cfg
        self.rank = str(rank)
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.info = Info("scout", "This rank's SCOUT run", ["rank"], registry=reg)
        self.incidents = Counter("scout_incidents", "Incident records this rank wrote, by kind and scope",
                                 ["rank", "kind", "scope"], registry=reg)
        self.checks = Counter("scout_replay_checks", "Replay checks this rank took part in", ["rank"], registry=reg)
        self.agreed = Counter("scout_replay_checks_agreed", "Replay checks in which every peer agreed",
                              ["rank"], registry=reg)
        self.skipped = Counter("scout_replay_checks_skipped",
                               "Replay checks skipped on every peer (SCOUT's own failure, or nothing to replay)",
                               ["rank"], registry=reg)
        self.last_clean = Gauge("scout_last_clean_check_timestamp_seconds",
                                "Unix time of the last replay check in which every peer agreed", ["rank"],
                                registry=reg)
        self.since_clean = Gauge("scout_seconds_since_clean_check",
                                 "Seconds since the last replay check in which every peer agreed (since start "
                                 "before the first)", ["rank"], registry=reg)
        self.cert_step = Gauge("scout_certification_step",
                               "Step of each certification generation (latest, candidate, verified); -1: none",
                               ["rank", "state"], registry=reg)
        self.cert_generations = Counter("scout_certified_generations",
                                        "Generations that became verified", ["rank"], registry=reg)
        self.cert_latency = Gauge("scout_capture_to_verified_steps",
                                  "Steps from the capture of the verified generation to its promotion; -1: none "
                                  "yet, or a restored one", ["rank"], registry=reg)
        self.observer_up = Gauge("scout_observer_up", "1 while this rank's out-of-band observer runs", ["rank"],
                                 registry=reg)
        self.overhead = Counter("scout_overhead_seconds",
                                "Wall seconds SCOUT's step boundary took (replay, certification, snapshots)",
                                ["rank"], registry=reg)
        self.uptime = Gauge("scout_uptime_seconds", "Seconds since SCOUT was enabled on this rank", ["rank"],
                            registry=reg)
        self.boundary_time = Gauge("scout_boundary_timestamp_seconds",
                                   "Unix time of this rank's last step boundary (stops moving when training stalls)",
                                   ["rank"], registry=reg)
        self.step = Gauge("scout_step", "The optimizer step of the last boundary", ["rank"], registry=reg)
        self.running = Gauge("scout_running", "1 while this rank trains with SCOUT on; 0 once it stopped (a "
                             "verdict's stop, an exit): a stall alert reads only running ranks", ["rank"],
                             registry=reg)
        self.running.labels(self.rank).set(1)
        self._start = time.time()
        self._last_clean: float | None = None
        self._verified: int | None = None
        self._counted: Any = None
        self._job = ""
        self._last_textfile = 0.0
        self._failed = False
        self.server: Any = None
        self._thread: Any = None
        self.since_clean.labels(self.rank).set_function(
            lambda: time.time() - (self._last_clean if self._last_clean is not None else self._start))
        self.uptime.labels(self.rank).set_function(lambda: time.time() - self._start)
        # Every series exists from the start (at 0), so a dashboard or an alert reads 0, not "no data", and the
        # first incident of a kind is an increase (a series born at 1 reads as no increase). Observer health
        # appears only where an observer runs.
        for metric in (self.checks, self.agreed, self.skipped, self.cert_generations, self.overhead,
                       self.last_clean, self.boundary_time, self.step):
            metric.labels(self.rank)
        for kind in IncidentKind:
            for scope in IncidentScope:
                self.incidents.labels(self.rank, kind.value, scope.value)
        for state in CERT_STATES:
            self.cert_step.labels(self.rank, state).set(-1)
        self.cert_latency.labels(self.rank).set(-1)

    def describe(self, *, run_id: str, host: str, configured_run_id: bool = False) -> None:
        """What the start-up exchange decided: the run id and this rank's machine (``scout_info``). The textfile
        is named after the job (:func:`job_name`), so a restart of the job rewrites its files, never adds more."""
        from scout_core import __version__

        self._job = job_name(run_id, configured=configured_run_id)
        self.info.labels(self.rank).info({"run_id": run_id, "host": host, "version": __version__})
        if self.cfg.textfile_dir:
            atexit.register(self._at_exit)

    # -- the sink and the boundary (trainer thread) ---------------------------------------------------------

    def emit(self, incident: Incident) -> None:
        self.incidents.labels(self.rank, incident.kind.value, incident.scope.value).inc()
        if self.cfg.textfile_dir and incident.kind in _VERDICTS:
            # At once, not at the next interval: a job stopped by the verdict may never reach another boundary.
            try:
                self.write_textfile()
            except OSError as exc:
                _log.warning("rank %s: SCOUT metrics textfile not written: %s", self.rank, exc)

    def boundary(self, handle: Any, elapsed_s: float) -> None:
        """After each step boundary: never raises (a metrics failure is logged once)."""
        try:
            self._boundary(handle, elapsed_s)
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            if not self._failed:
                self._failed = True
                _log.warning("rank %s: SCOUT metrics could not be updated: %s: %s", self.rank,
                             type(exc).__name__, exc)

    def _boundary(self, handle: Any, elapsed_s: float) -> None:
        now = time.time()
        r = self.rank
        self.overhead.labels(r).inc(max(elapsed_s, 0.0))
        self.boundary_time.labels(r).set(now)
        result, expert = handle.last_result, getattr(handle, "last_expert", None)
        if result is not None and result is not self._counted:  # a boundary without replay leaves the last one
            self._counted = result
            self.step.labels(r).set(result.step)
            outcome = check_outcome(result, expert)
            if outcome == "skipped":
                self.skipped.labels(r).inc()
            elif outcome is not None:
                self.checks.labels(r).inc()
                if outcome == "agreed":  # a check without evidence vouches for nothing
                    self.agreed.labels(r).inc()
                    self._last_clean = now
                    self.last_clean.labels(r).set(now)
        cert = handle.certifier
        if cert is not None:
            for state in CERT_STATES:
                value = getattr(cert, state)
                self.cert_step.labels(r, state).set(-1 if value is None else value)
            if cert.verified is not None and cert.verified != self._verified:
                self._verified = cert.verified
                self.cert_generations.labels(r).inc()
            self.cert_latency.labels(r).set(-1 if cert.verified_after is None else cert.verified_after)
        if handle.observer_pid is not None:  # no series where no observer runs (observer.enabled: false)
            self.observer_up.labels(r).set(0 if handle._observer_reported else 1)
        if self.cfg.textfile_dir and now - self._last_textfile >= self.cfg.textfile_interval_s:
            self.write_textfile()
            self._last_textfile = now

    # -- export ---------------------------------------------------------------------------------------------

    @property
    def textfile_path(self) -> str:
        """One file per job and rank (two jobs on one machine never share one; a job's restarts share it)."""
        job = f"{self._job}_" if self._job else ""
        return os.path.join(self.cfg.textfile_dir, f"scout_{job}rank{self.rank}.prom")

    def stopped(self) -> None:
        """This rank stops training (a verdict's stop, or the process exits without :meth:`close`): the last
        textfile says so (``scout_running`` 0) and keeps the counts, the verdict that stopped the job included,
        for the scrape to read; the job's next launch rewrites it. Never raises."""
        try:
            self.running.labels(self.rank).set(0)
            if self.cfg.textfile_dir and self._job:
                self.write_textfile()
        except Exception as exc:  # noqa: BLE001 - on the way out: a metrics failure must not mask the stop
            _log.warning("SCOUT metrics: the final textfile was not written: %s", exc)

    def _at_exit(self) -> None:  # the process ends without close(): a stop, an exception, sys.exit
        self.stopped()

    def write_textfile(self) -> None:
        """Rewrite this rank's textfile atomically (node exporter reads whole files only)."""
        from prometheus_client import write_to_textfile

        shared_dir(self.cfg.textfile_dir, "report.prometheus.textfile_dir")
        write_to_textfile(self.textfile_path, self.registry)

    def serve(self, port: int) -> None:
        from prometheus_client import start_http_server

        self.server, self._thread = start_http_server(port, addr=self.cfg.address, registry=self.registry)

    @property
    def port(self) -> int | None:
        return None if self.server is None else int(self.server.server_address[1])

    def close(self, *, keep_textfile: bool = False) -> None:
        """Stop the endpoint and remove the textfile: a finished job's series must not linger in the node
        exporter (its frozen boundary time would read as a stalled job). ``keep_textfile``: the rank stopped
        for a verdict or failed: its last textfile stays, saying so (:meth:`stopped`)."""
        if self.cfg.textfile_dir:
            atexit.unregister(self._at_exit)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.cfg.textfile_dir:
            if keep_textfile:
                self.stopped()
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.textfile_path)


JOB_ID_ENV = {"SLURM_JOB_ID": "slurm", "TORCHELASTIC_RUN_ID": "torchrun", "PBS_JOBID": "pbs", "LSB_JOBID": "lsf"}
"""Where a job's id is found when ``report.run_id`` is not set (the same in every launch of the job: Slurm's
job, torchrun's rendezvous id, PBS, LSF), and the prefix its files get; SCOUT's own run id is new at every
launch. Slurm's job id is shared by the steps of one allocation (several srun in a sweep), so its step is part
of the name (a requeued job numbers its steps from 0 again: its restart still rewrites its own files)."""


def job_name(run_id: str, *, configured: bool = False) -> str:
    """The name a job's textfiles carry (and the job its in-memory snapshots belong to): ``report.run_id`` where
    the user set it, else the scheduler's or torchrun's job id, else the run id (then each launch is its own)."""
    if not configured:
        for env, prefix in JOB_ID_ENV.items():
            value = os.environ.get(env, "")
            if value and value != "none":  # "none": torchrun's --rdzv-id default, the same for every job
                if env == "SLURM_JOB_ID" and os.environ.get("SLURM_STEP_ID"):
                    value = f"{value}.{os.environ['SLURM_STEP_ID']}"
                return "".join(c if c.isalnum() or c in "-." else "-" for c in f"{prefix}-{value}")
    return run_id


def start_metrics(cfg: PrometheusConfig, *, rank: int) -> ScoutMetrics | None:
    """The rank's metrics when ``report.prometheus`` asks for an endpoint or a textfile, else None. The endpoint
    binds ``port + LOCAL_RANK``; a port already taken fails here, at ``enable()``, naming it."""
    port, address, textfile_dir, _interval = cfg.port, cfg.address, cfg.textfile_dir, cfg.textfile_interval_s
    if not port and not textfile_dir:
        return None
    metrics = ScoutMetrics(cfg, rank=rank)
    if textfile_dir:
        try:  # an unwritable directory fails here, at enable(), not silently at every boundary
            shared_dir(textfile_dir, "report.prometheus.textfile_dir")
            with tempfile.NamedTemporaryFile(dir=textfile_dir, prefix=".scout-probe-"):
                pass
        except OSError as exc:
            raise RuntimeError(f"report.prometheus.textfile_dir: rank {rank} cannot write {textfile_dir}: {exc}"
                               ) from exc
    if port:
        port += local_rank()
        try:
            metrics.serve(port)
        except OSError as exc:
            raise RuntimeError(f"report.prometheus: rank {rank} cannot serve metrics on "
                               f"{address}:{port} (port + the rank's index on its machine): {exc}") from exc
    return metrics
