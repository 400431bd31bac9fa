"""``scout_core.enable()``: the one composition root. Attach SCOUT to a running job without editing its loop.

Call it on every rank after the process group, the model wrapper (DDP, FSDP2)
and the optimizer exist, then resume::

    handle = scout_core.enable(model, optimizer, config=scout_core.config.load("scout.yaml"),
                               state={"scheduler": scheduler})
    start = handle.resume().next_step           # 0 on a fresh start
    for step in range(start, total_steps):
        ...forward, backward, optimizer.step()...  # replay and snapshots ride on the step hooks

From the config alone it builds what is switched on: the out-of-band hang
observer (``observer.*``), the replay engine for SDC and stragglers
(``replay.*``, ``consensus.*``, peers from ``topology.*`` or the mesh), and
certified recovery (``checkpoint.*``: snapshots, peer replicas, durable store,
certifier, coordinator), plus the verdict actions (``actions.*``). Every replay
boundary becomes certification evidence. Frameworks enter through
:func:`enable_with` and a :class:`~scout_core.adapter.FrameworkAdapter`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from scout_core.adapter import FrameworkAdapter, torch_adapter
from scout_core.assembly import (
    build_checkpoint,
    build_experts,
    build_labels,
    build_replay,
    build_snapshots,
    install_step_hooks,
    new_handle,
    register_live_keys,
    start_observer,
)
from scout_core.config import ScoutConfig, TopologyConfig, validate
from scout_core.control import RunControl
from scout_core.groups import ScoutGroups, build_groups
from scout_core.handle import ScoutHandle
from scout_core.metrics import start_metrics
from scout_core.moe.replay import MoEBinding
from scout_core.parts import ScoutParts
from scout_core.progress.control import ControlPlane, choose_control_plane, clientless_exit_s, observer_timing
from scout_core.progress.spawn import named_callback
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.layer import device_of
from scout_core.replay.rng import RngProvider
from scout_core.report import Incident, JsonlSink, LoggingSink, Reporter
from scout_core.run_log import RunLog
from scout_core.topology import peer_groups as peer_groups_of_shape
from scout_core.topology import peer_groups_from_mesh
from scout_core.wire import all_gather_data

__all__ = ["ScoutHandle", "enable", "enable_with", "HOSTNAME_ENV"]

_log = logging.getLogger("scout")

HOSTNAME_ENV = "SCOUT_HOSTNAME"
"""Overrides this rank's machine name (e.g. set it from ``$SLURMD_NODENAME``); default: the hostname."""


def _resolve_peer_groups(adapter: FrameworkAdapter, topology: TopologyConfig, world: int) -> list[list[int]]:
    if adapter.peer_groups is not None and adapter.mesh is not None:
        raise ValueError("give peer_groups or mesh, not both")
    order = list(topology.order)
    if adapter.mesh is not None:
        groups = [list(g) for g in peer_groups_from_mesh(adapter.mesh)]
    elif adapter.peer_groups is not None:
        groups = [list(map(int, g)) for g in adapter.peer_groups]
    elif topology.shape:
        total = 1
        for n in topology.shape.values():
            total *= n
        if total != world:
            raise ValueError(f"topology.shape {dict(topology.shape)} covers {total} ranks, the job has {world}")
        groups = [list(g) for g in peer_groups_of_shape(dict(topology.shape), order)]
    else:
        groups = [list(range(world))]  # pure data parallel: every rank is a replica
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world)):
        raise ValueError(f"peer groups must partition ranks 0..{world - 1} exactly once, got {groups}")
    return groups


def _check_replica_groups(replicas: Sequence[Sequence[int]] | None, peers: list[list[int]],
                          world: int) -> list[list[int]] | None:
    """The adapter's replica groups, checked: a partition of the ranks, each a union of whole peer groups
    (None, or a partition that is the peer groups themselves, adds nothing: None)."""
    if not replicas:
        return None
    groups = [sorted(int(r) for r in g) for g in replicas]
    if sorted(r for g in groups for r in g) != list(range(world)):
        raise ValueError(f"replica groups must partition ranks 0..{world - 1} exactly once, got {groups}")
    for g in groups:
        inside = [p for p in peers if set(p) <= set(g)]
        if sum(len(p) for p in inside) != len(g):
            raise ValueError(f"replica group {g} is not a union of peer groups {peers}")
    if sorted(map(tuple, groups)) == sorted(tuple(sorted(p)) for p in peers):
        return None
    return groups


def enable(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: Any = None,
    *,
    config: ScoutConfig | None = None,
    peer_groups: Sequence[Sequence[int]] | None = None,
    mesh: Any = None,
    layers: Iterable[torch.nn.Module] | None = None,
    embedding: torch.nn.Module | None = None,
    output: torch.nn.Module | None = None,
    state: Mapping[str, Any] | None = None,
    rng_providers: Mapping[str, RngProvider] | None = None,
    on_incident: Callable[[Incident], None] | str | None = None,
    moe: MoEBinding | None = None,
) -> ScoutHandle:
    """Install SCOUT on this rank (plain PyTorch); every rank of the default process group must call it.

    ``model`` is a module or a list of model chunks (pipeline stages), wrapped
    (DDP, FSDP2) or not; ``optimizer`` one optimizer, a list, or a wrapper with
    inner torch optimizers. Peer groups come from ``peer_groups``, a named
    ``mesh``, ``topology.shape``, or default to all ranks (pure data parallel).
    ``layers`` / ``embedding`` / ``output`` override discovery; ``state`` names
    caller objects with ``state_dict``/``load_state_dict`` (LR scheduler, data
    loader, gradient scaler) that snapshots keep. ``on_incident`` runs in the
    observer process for each hang verdict, so it fires even while the trainer
    is blocked: a module-level function or its path, ``"module:function"`` (a
    lambda or closure works too, but then the observer is forked from the
    trainer instead of started fresh: ``observer.start_method``). ``moe``
    (:class:`~scout_core.moe.replay.MoEBinding`) names the MoE layers and the groups of ranks holding the same
    experts: it switches on the expert recipe (``replay.cadence.expert``).
    """
    adapter = torch_adapter(model, optimizer, mesh=mesh, peer_groups=peer_groups, layers=layers,
                            embedding=embedding, output=output, rng_providers=rng_providers, state=state,
                            moe=moe)
    return enable_with(adapter, config=config, on_incident=on_incident)


def enable_with(adapter: FrameworkAdapter, *, config: ScoutConfig | None = None,
                on_incident: Callable[[Incident], None] | str | None = None) -> ScoutHandle:
    """Install SCOUT from a framework adapter (what plugins call): resolve the groups, build each part the
    configuration turns on, hand them to the handle."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("scout_core.enable() needs an initialized default process group")
    if isinstance(on_incident, str):  # the same path on every rank: a wrong one raises on every rank here
        on_incident = named_callback(on_incident)
    ScoutHandle.claim()
    parts: ScoutParts | None = None
    try:
        cfg = validate(config or ScoutConfig())
        world = dist.get_world_size()
        peers = _resolve_peer_groups(adapter, cfg.topology, world)
        groups = build_groups(peers, _check_replica_groups(adapter.replica_groups, peers, world))
        parts, plane = _join_job(adapter, cfg, groups)
        handle = new_handle(parts)
    except BaseException:
        if parts is not None:  # built but not yet held by a handle: what _join_job started closes here
            _close_quietly(parts.metrics, parts.control)
        ScoutHandle.release_claim()
        raise
    try:
        if cfg.observer.enabled:
            assert plane is not None
            start_observer(parts, plane, on_incident)
        if cfg.replay.enabled:
            parts.replay = build_replay(parts)
            parts.experts = build_experts(parts)
        if cfg.checkpoint.enabled:
            parts.snapshots = build_snapshots(parts)
            parts.checkpoint = build_checkpoint(parts)
        parts.labels = build_labels(parts)
        register_live_keys(handle.live, parts, handle.boundary)
        install_step_hooks(parts, handle)
        try:
            _start_record(parts)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be made never stops SCOUT from starting
            _log.warning("rank %d: SCOUT's start record was not written: %s: %s", parts.rank, type(exc).__name__, exc)
    except BaseException:
        handle.close()
        raise
    return handle


def _start_record(parts: ScoutParts) -> None:
    """Rank 0's start record beside the incident file: what this launch checks (see :mod:`scout_core.run_log`)."""
    cfg = parts.config
    parts.run_log = RunLog(cfg.report.jsonl_path, rank=parts.rank, run_id=parts.run_id, fsync=cfg.report.fsync)
    cadence = cfg.replay.cadence
    recipes = [f"{name} every {every}" for name in ("embedding", "hidden", "output", "optimizer", "expert")
               if (every := getattr(cadence, name)) > 0 and parts.replay is not None
               and (name != "expert" or parts.experts is not None)]
    peers = [list(g) for g in parts.groups.all_peers]
    on = {"observer": parts.observer is not None, "replay": parts.replay is not None,
          "experts": parts.experts is not None, "snapshots": parts.checkpoint is not None,
          "framework_checkpoint_labels": parts.labels is not None,
          "metrics": parts.metrics is not None, "control": parts.control is not None}
    parts.run_log.start(config=cfg, world_size=parts.world_size, peer_groups=peers, parts_on=on, recipes=recipes,
                        framework=parts.adapter.name)
    if parts.rank == 0 and logging.getLevelName(cfg.report.log_level.upper()) <= logging.WARNING:
        # One line of the same shape under every plugin, on stderr whatever the framework did to logging (DeepSpeed
        # shows no INFO line): a user sees that SCOUT is on and what it watches.
        print(attach_line(parts.run_id, parts.world_size, peers, on, recipes, cfg.report.jsonl_path),
              file=sys.stderr, flush=True)


def attach_line(run_id: str, world: int, peers: list[list[int]], on: dict[str, bool], recipes: list[str],
                records: str | None) -> str:
    """``SCOUT on: ...``: the run, the peer groups, what is watched, where the records go."""
    size = max(map(len, peers), default=0)
    watched = ["hang observer" if on["observer"] else "no hang observer",
               f"replay ({', '.join(recipes)})" if recipes else "no replay",
               "snapshots" if on["snapshots"] else "no snapshots"]
    if on["framework_checkpoint_labels"]:
        watched.append("framework checkpoint labels")
    where = f"records in {records}" if records else "records in the log only (report.jsonl_path unset)"
    return (f"SCOUT on: run {run_id}, {world} ranks in {len(peers)} peer group(s) of {size}; "
            f"{', '.join(watched)}; {where}")


def _join_job(adapter: FrameworkAdapter, cfg: ScoutConfig,
              groups: ScoutGroups) -> tuple[ScoutParts, ControlPlane | None]:
    """One start-up exchange while the job is healthy: hosts, devices, run id, the control store's port, and each
    rank's start-up errors, raised on every rank alike. Who the rank is, and the observers' control plane."""
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = control = None
    try:
        # Rank 0 picks the observers' control plane (starting a store daemon where no launcher serves one).
        plane, plane_error = None, ""
        if cfg.observer.enabled and rank == 0:
            try:
                timing = observer_timing(cfg.observer.heartbeat_s, cfg.observer.gather_timeout_s, world)
                plane = choose_control_plane(cfg.observer.control_store, rank=rank, world_size=world,
                                             bind_port=cfg.observer.store_port, advertise=cfg.observer.store_addr,
                                             clientless_s=clientless_exit_s(*timing))
            except Exception as exc:  # every rank raises it after the exchange: none is left waiting
                plane_error = f"{type(exc).__name__}: {exc}"
        # The metrics endpoint binds its port before the exchange, so a port taken on one rank fails every rank.
        start_error = ""
        run_id_mine = cfg.report.run_id or uuid.uuid4().hex[:12]  # rank 0's is the job's
        try:
            metrics = start_metrics(cfg.report.prometheus, rank=rank)
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange
            start_error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
        control_error = ""
        if cfg.control.enabled:  # rank 0 makes the control folder; where it cannot, no rank takes commands
            try:
                control = RunControl(cfg, run_id=run_id_mine, rank=rank, world_control=groups.world_control)
            except Exception as exc:  # noqa: BLE001 - diagnosis goes on without runtime control
                control_error = f"{type(exc).__name__}: {exc}"
        mine = {"host": os.environ.get(HOSTNAME_ENV) or socket.gethostname(),
                "device": str(device_of(adapter.chunks[0])), "run_id": run_id_mine,
                "control": plane.to_dict() if plane else None, "control_error": plane_error,
                "launch": secrets.token_hex(16), "start_error": start_error, "control_folder_error": control_error}
        everyone = all_gather_data(mine, groups.world_control, what="start-up exchange")
        if everyone[0]["control_error"]:
            raise RuntimeError(f"the observers' control plane could not start: {everyone[0]['control_error']}")
        if everyone[0]["control_folder_error"]:
            if rank == 0:
                _log.warning("SCOUT runtime control is off for this run: %s (control.directory)",
                             everyone[0]["control_folder_error"])
            control = None
        failed = [e["start_error"] for e in everyone if e["start_error"]]
        if failed:
            raise RuntimeError(f"{failed[0]}" + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""))
        return _rank_parts(cfg, adapter, groups, everyone, metrics, control)
    except BaseException:
        _close_quietly(metrics, control)
        raise


def _rank_parts(cfg: ScoutConfig, adapter: FrameworkAdapter, groups: ScoutGroups, everyone: list[Any],
                metrics: Any, control: RunControl | None) -> tuple[ScoutParts, ControlPlane | None]:
    """Who this rank is, from the exchange (rank 0's run id and launch are the job's), with its reporter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = {r: e["host"] for r, e in enumerate(everyone)}
    devices = {r: e["device"] for r, e in enumerate(everyone)}
    run_id = everyone[0]["run_id"]
    sinks: list[Any] = [LoggingSink(cfg.report.log_level)]
    if cfg.report.jsonl_path:
        sinks.append(JsonlSink(cfg.report.jsonl_path, fsync=cfg.report.fsync))
    if metrics is not None:
        metrics.describe(run_id=run_id, host=hosts[rank], configured_run_id=bool(cfg.report.run_id))
        sinks.append(metrics)
    reporter = Reporter(sinks, run_id=run_id, rank=rank)
    parts = ScoutParts(config=cfg, adapter=adapter, rank=rank, world_size=world, run_id=run_id, groups=groups,
                       hosts=hosts, devices=devices, reporter=reporter, launch_id=everyone[0]["launch"],
                       guard=DiagnosisGuard(groups.world_control, rank=rank, reporter=reporter, hosts=hosts),
                       metrics=metrics, control=control)
    plane = ControlPlane(**everyone[0]["control"]) if cfg.observer.enabled else None
    return parts, plane


def _close_quietly(*started: Any) -> None:
    """Close what start-up opened before an error (the error that got us here is the one to raise)."""
    for part in started:
        if part is not None:
            with contextlib.suppress(Exception):
                part.close()
