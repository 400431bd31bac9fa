"""``scout_core.enable()``: attach SCOUT to a running job without editing its loop.

Call it on every rank after the process group, the model wrapper (DDP, FSDP2)
and the optimizer exist::

    handle = scout_core.enable(model, optimizer, config=scout_core.config.load("scout.yaml"))
    for batch in handle.wrap_dataloader(loader):
        ...
    with handle.checkpoint_io("write"):
        torch.save(...)

Today the handle carries the hang path (progress hooks plus the out-of-band
observer); replay and checkpoint certification attach to the same handle.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from scout_core.config import ScoutConfig
from scout_core.progress.hooks import (
    ProgressTracker,
    install_collective_hooks,
    repeated_layers,
    uninstall_collective_hooks,
)
from scout_core.progress.observer import OBSERVER_REPORTED_EXIT, ObserverSpec, start_observer
from scout_core.progress.record import create_record
from scout_core.report import Incident, IncidentKind, IncidentScope, JsonlSink, LoggingSink, Reporter
from scout_core.topology import peer_groups_from_mesh

__all__ = ["ScoutHandle", "enable"]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _device_of(chunks: Sequence[torch.nn.Module]) -> str:
    for chunk in chunks:
        for p in chunk.parameters():
            return str(p.device)
    return "cpu"


def _resolve_peer_groups(peer_groups: Sequence[Sequence[int]] | None, mesh: Any, world: int) -> list[list[int]]:
    if peer_groups is not None and mesh is not None:
        raise ValueError("give peer_groups or mesh, not both")
    if mesh is not None:
        groups = [list(g) for g in peer_groups_from_mesh(mesh)]
    elif peer_groups is not None:
        groups = [list(map(int, g)) for g in peer_groups]
    else:
        groups = [list(range(world))]  # pure data parallel: every rank is a replica
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world)):
        raise ValueError(f"peer groups must partition ranks 0..{world - 1} exactly once, got {groups}")
    return groups


class ScoutHandle:
    """What :func:`enable` returns; :meth:`close` undoes everything it installed."""

    def __init__(self, *, config: ScoutConfig, rank: int, world_size: int, run_id: str,
                 peer_groups: list[list[int]], hosts: dict[int, str], devices: dict[int, str],
                 tracker: ProgressTracker | None, reporter: Reporter) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.peer_groups = peer_groups
        self.hosts = hosts
        self.devices = devices
        self.tracker = tracker
        self.reporter = reporter
        self.observer_pid: int | None = None
        self.observer_startup_s: float | None = None
        self.ddp_buckets_visible: bool | None = None
        self._observer_reported = False
        self._closed = False

    # -- training-loop boundaries -------------------------------------------------------------

    def wrap_dataloader(self, iterable: Iterable[Any]) -> Iterable[Any]:
        return self.tracker.wrap_dataloader(iterable) if self.tracker else iterable

    def checkpoint_io(self, kind: str = "write") -> contextlib.AbstractContextManager[None]:
        return self.tracker.checkpoint_io(kind) if self.tracker else contextlib.nullcontext()

    # -- observer health -------------------------------------------------------------------------

    def check_observer(self) -> bool:
        """True while the observer runs; reports its death once (observer_failure)."""
        if self.observer_pid is None or self._observer_reported:
            return not self._observer_reported
        try:
            done, status = os.waitpid(self.observer_pid, os.WNOHANG)
        except ChildProcessError:
            done, status = self.observer_pid, 0
        if not done:
            return True
        self._observer_reported = True
        code = os.waitstatus_to_exitcode(status)
        if code != OBSERVER_REPORTED_EXIT:  # that code means the observer reported itself
            self.reporter.emit(Incident(
                kind=IncidentKind.OBSERVER_FAILURE, scope=IncidentScope.RANK, ranks=[self.rank],
                hosts=[self.hosts[self.rank]], devices=[self.devices[self.rank]], step=self.tracker.step,
                reason=f"observer of rank {self.rank} (pid {self.observer_pid}) exited with {code}; "
                       "hangs on this rank can no longer be localized",
                evidence={"observer_pid": self.observer_pid, "exit": code},
            ))
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tracker is not None:
            self.tracker.remove_hooks()
            uninstall_collective_hooks(self.tracker)
        if self.observer_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.observer_pid, 15)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.observer_pid, 0)
        if self.tracker is not None:
            self.tracker.record.unlink()
            self.tracker.record.close()

    def __enter__(self) -> ScoutHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def enable(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    config: ScoutConfig | None = None,
    peer_groups: Sequence[Sequence[int]] | None = None,
    mesh: Any = None,
    layers: Iterable[torch.nn.Module] | None = None,
    on_incident: Callable[[Incident], None] | None = None,
) -> ScoutHandle:
    """Install SCOUT on this rank; every rank of the default process group must call it.

    ``model`` is a module or a list of model chunks (pipeline stages), wrapped
    (DDP, FSDP2) or not; ``optimizer`` one optimizer or a list of inner ones.
    Peer groups come from ``peer_groups``, from a named ``mesh``, or default to
    all ranks (pure data parallel). ``layers`` overrides the repeated-layer
    discovery. ``on_incident`` runs in the observer process for each hang
    verdict, so it fires even while the trainer is blocked.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("scout_core.enable() needs an initialized default process group")
    cfg = config or ScoutConfig()
    chunks = _as_list(model)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("model must be an nn.Module or a list of nn.Module chunks")
    optimizers = _as_list(optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = _resolve_peer_groups(peer_groups, mesh, world)

    # One start-up exchange while the job is healthy: hosts, devices, run id and
    # the control store's port (chosen on rank 0's machine).
    store_port = cfg.observer.store_port or (_free_port() if rank == 0 else 0)
    mine = {"host": socket.gethostname(), "device": _device_of(chunks),
            "run_id": cfg.report.run_id or uuid.uuid4().hex[:12], "port": store_port}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    hosts = {r: e["host"] for r, e in enumerate(everyone)}
    devices = {r: e["device"] for r, e in enumerate(everyone)}
    run_id = everyone[0]["run_id"]
    store_host = cfg.observer.store_addr or os.environ.get("MASTER_ADDR") or everyone[0]["host"]

    sinks: list[Any] = [LoggingSink(cfg.report.log_level)]
    if cfg.report.jsonl_path:
        sinks.append(JsonlSink(cfg.report.jsonl_path, fsync=cfg.report.fsync))
    reporter = Reporter(sinks, run_id=run_id, rank=rank)

    tracker = None
    if cfg.observer.enabled:
        tracker = ProgressTracker(create_record(run_id, rank))
    handle = ScoutHandle(config=cfg, rank=rank, world_size=world, run_id=run_id, peer_groups=groups,
                         hosts=hosts, devices=devices, tracker=tracker, reporter=reporter)
    if tracker is None:
        return handle

    start = time.monotonic()
    pid, ready_fd = start_observer(ObserverSpec(
        run_id=run_id, rank=rank, world_size=world, record_path=tracker.record.path,
        store_host=store_host, store_port=int(everyone[0]["port"]), peer_groups=groups, hosts=hosts,
        devices=devices, silence_threshold_s=cfg.observer.silence_threshold_s,
        gather_timeout_s=cfg.observer.gather_timeout_s, startup_timeout_s=cfg.observer.startup_timeout_s,
        jsonl_path=cfg.report.jsonl_path, fsync=cfg.report.fsync, log_level=cfg.report.log_level,
        on_incident=on_incident,
    ))
    handle.observer_pid = pid
    try:
        ready, _, _ = select.select([ready_fd], [], [], cfg.observer.startup_timeout_s)
        ok = bool(ready) and os.read(ready_fd, 1) == b"R"
    finally:
        os.close(ready_fd)
    if not ok:
        handle.check_observer()
        handle.close()
        raise RuntimeError(f"rank {rank}: the SCOUT observer did not start within "
                           f"{cfg.observer.startup_timeout_s}s (control store {store_host}:{everyone[0]['port']})")
    handle.observer_startup_s = time.monotonic() - start

    tracker.install_module_hooks(list(layers) if layers is not None else repeated_layers(chunks),
                                 backward=cfg.observer.layer_backward_marks)
    tracker.install_optimizer_hooks(optimizers)
    if optimizers:  # a dead observer is noticed, and reported, at the next optimizer step
        tracker._handles.append(optimizers[0].register_step_post_hook(lambda *_: handle.check_observer()))
    ddp = [c for c in chunks if isinstance(c, torch.nn.parallel.DistributedDataParallel)]
    if ddp:
        handle.ddp_buckets_visible = all(tracker.install_ddp_comm_hook(m) for m in ddp)
    install_collective_hooks(tracker)
    return handle


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]

