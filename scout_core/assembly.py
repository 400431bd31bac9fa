"""Builds each part of one rank's SCOUT that the configuration turns on; :func:`scout_core.enable_with` calls it.

Each ``build_*`` returns one part for :class:`~scout_core.parts.ScoutParts` (:func:`start_observer` sets its part
there before the fork, so that close() reaps an observer that failed to start); :func:`register_live_keys` tells the
live-control table, on each part's behalf, which keys it reads; :func:`install_step_hooks` ties the step boundary
to the caller's optimizer.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from scout_core.actions import LAUNCHER_ERROR_FILE_ENV, exclude_hosts_path
from scout_core.boundary import StepBoundary
from scout_core.checkpoint.certify import Certifier
from scout_core.checkpoint.coordinator import CheckpointCoordinator
from scout_core.checkpoint.coverage import Coverage
from scout_core.checkpoint.labels import FrameworkLabels
from scout_core.checkpoint.memory import MemorySlots, default_memory_root, job_token, share_nonce
from scout_core.checkpoint.restart import Restart
from scout_core.checkpoint.snapshot import SnapshotEngine
from scout_core.checkpoint.store import DurableStore
from scout_core.config import ConfigError
from scout_core.consensus import Persistence, StatisticalRule
from scout_core.handle import ScoutHandle
from scout_core.live_control import LiveControl
from scout_core.metrics import job_name
from scout_core.moe.binding import expert_width
from scout_core.moe.catalog import Catalog
from scout_core.moe.replay import ExpertReplay
from scout_core.observer_link import ObserverLink
from scout_core.parts import ScoutParts
from scout_core.plugin_support import InstanceAttribute
from scout_core.progress.control import ControlPlane, observer_timing
from scout_core.progress.hooks import install_collective_hooks
from scout_core.progress.observer import ObserverSpec, steady_threshold
from scout_core.progress.stacks import arm_trainer_stacks
from scout_core.replay.engine import ReplayEngine
from scout_core.replay.layer import device_of
from scout_core.replay.scratch import fsdp_owners
from scout_core.report import Incident, LoggingSink
from scout_core.wire import all_gather_data

__all__ = ["build_checkpoint", "build_experts", "build_labels", "build_replay", "build_snapshots",
           "install_step_hooks", "new_certifier", "new_handle", "register_live_keys", "start_observer"]

_log = logging.getLogger("scout")


def new_handle(parts: ScoutParts) -> ScoutHandle:
    """The handle over ``parts`` (filled in next), with what runs them: the step boundary, the restart path and
    the live-control table. Made before any part, so that a part that fails to build closes those before it."""
    live = LiveControl(parts.config, pinned=parts.adapter.pinned, rank=parts.rank)
    return ScoutHandle(parts, boundary=StepBoundary(parts, live), restart=Restart(parts), live=live)


# -- the hang observer -----------------------------------------------------------------------------------------

def start_observer(parts: ScoutParts, plane: ControlPlane, on_incident: Callable[[Incident], None] | None) -> None:
    """Start this rank's observer (``parts.observer`` is set first: close() reaps one that failed to start), then
    mark the training loop for it: layers, optimizers, DDP buckets, collectives."""
    cfg, obs = parts.config, parts.config.observer
    link = parts.observer = ObserverLink(run_id=parts.run_id, rank=parts.rank, reporter=parts.reporter,
                                         host=parts.hosts[parts.rank], device=parts.devices[parts.rank])
    tracker = link.tracker
    # The trainer learns only gaps below the threshold the observer would apply: longer ones were stalls.
    steady = functools.partial(steady_threshold, obs.silence_threshold_s, obs.adaptive_multiple,
                               obs.first_step_silence_s)
    warmup = max(obs.silence_threshold_s, obs.first_step_silence_s)
    tracker.record.learn_below = lambda published: steady(published) if published > 0 else warmup
    heartbeat_s, gather_timeout_s = observer_timing(obs.heartbeat_s, obs.gather_timeout_s, parts.world_size)
    arm = link.stacks = arm_trainer_stacks()
    link.start(ObserverSpec(
        run_id=parts.run_id, launch=parts.launch_id, rank=parts.rank, world_size=parts.world_size,
        record_path=tracker.record.path, control=plane, peer_groups=[list(g) for g in parts.groups.all_peers],
        hosts=parts.hosts, devices=parts.devices, silence_threshold_s=obs.silence_threshold_s,
        first_step_silence_s=obs.first_step_silence_s, io_silence_s=obs.io_silence_s,
        adaptive_multiple=obs.adaptive_multiple, heartbeat_s=heartbeat_s,
        gather_timeout_s=gather_timeout_s, startup_timeout_s=obs.startup_timeout_s,
        jsonl_path=cfg.report.jsonl_path, fsync=cfg.report.fsync, log_level=cfg.report.log_level,
        on_incident=on_incident, exclusions_path=exclude_hosts_path(cfg), start_method=obs.start_method,
        stop_on_verdict=cfg.actions.on_verdict == "stop",
        launcher_error_file=os.environ.get(LAUNCHER_ERROR_FILE_ENV) or None,
        trainer_stacks=[arm.fd, arm.sig, arm.main_thread] if arm is not None else None,
    ), world_control=parts.groups.world_control)
    a = parts.adapter
    tracker.install_module_hooks(a.marked_layers or a.repeated_layers(), backward=obs.layer_backward_marks)
    tracker.install_optimizer_hooks(a.optimizers)
    ddp = [c for c in a.chunks if isinstance(c, torch.nn.parallel.DistributedDataParallel)]
    if ddp:
        # DDP's C++ bucket path untouched, one collective per backward; or each bucket through SCOUT's comm hook,
        # where the model has no hook of its own (one that has keeps the backward marks).
        hooked = [m for m in ddp if obs.ddp_bucket_hook and tracker.install_ddp_comm_hook(m)]
        tracker.install_ddp_backward_marks([m for m in ddp if m not in hooked])
        link.ddp_buckets_visible = len(hooked) == len(ddp)
    install_collective_hooks(tracker)


# -- replay -------------------------------------------------------------------------------------------------

def build_replay(parts: ScoutParts) -> ReplayEngine:
    """The dense replay engine over the adapter's repeated layers (``replay.*``, ``consensus.*``)."""
    cfg, a = parts.config, parts.adapter
    layers = a.repeated_layers()
    names = a.layer_names if a.layers is not None and a.layer_names else None
    if a.moe is not None:
        _refuse_dense_moe(layers, names, a.moe)
    return ReplayEngine(
        layers, a.optimizers[0] if a.optimizers else None, config=cfg.replay, groups=parts.groups,
        rule=StatisticalRule.from_config(cfg.consensus), comm_rule=StatisticalRule.for_communication(cfg.consensus),
        confirm_rounds=cfg.consensus.confirm_rounds, noise_window=cfg.consensus.noise_window_rounds,
        persistence=Persistence.from_config(cfg.consensus), reporter=parts.reporter, hosts=parts.hosts,
        rng_providers=a.rng_providers, layer_names=names,
        embedding=a.embedding, output=a.output, boundary_owner=a.boundary_owner, hook_optimizer=False,
        layer_owners=fsdp_owners(layers, a.chunks),
        # Experts differ between EP positions: their optimizer slices are self-checked on each rank only.
        local_only_params=a.moe.expert_parameters() if a.moe is not None else (),
        replicated_parameters=a.replicated_parameters, compare_optimizer_slices=a.compare_optimizer_slices,
        compare_param_grads=a.compare_param_grads, compare_extra_state=a.compare_extra_state,
        replay_context=a.replay_context,
        replay_pairs_across_groups=a.replay_pairs_across_groups, gather_layer=a.gather_layer,
        gather_bytes=a.gather_bytes)


def build_experts(parts: ScoutParts) -> ExpertReplay | None:
    """The MoE expert recipe (``enable(..., moe=...)`` and ``replay.cadence.expert``), or None."""
    cfg, a = parts.config, parts.adapter
    every, catalog_path = cfg.replay.cadence.expert, cfg.replay.moe_catalog
    if a.moe is None and catalog_path:
        raise ValueError(f"replay.moe_catalog is set ({catalog_path}) but enable() was given no moe= binding: "
                         "the expert recipe needs the MoE layers and the groups holding the same experts")
    if a.moe is None or every <= 0:
        return None
    catalog = _load_catalog(parts, catalog_path, a.moe) if catalog_path else None
    return ExpertReplay(a.moe, every=every, world_control=parts.groups.world_control, rank=parts.rank,
                        reporter=parts.reporter, hosts=parts.hosts, catalog=catalog,
                        comm_rule=StatisticalRule.for_communication(cfg.consensus),
                        confirm_rounds=cfg.consensus.confirm_rounds, determinism_every=cfg.replay.determinism_every,
                        deterministic=cfg.replay.deterministic, rng_providers=a.rng_providers,
                        replay_context=a.replay_context)


def _load_catalog(parts: ScoutParts, path: str, moe: Any) -> Catalog:
    """The shape catalog, checked on every rank before any group is built: a rank that cannot use it (no
    file on that node, another GPU) makes every rank raise the same error, instead of leaving the others
    waiting in the next collective."""
    catalog, error = None, ""
    try:
        catalog = Catalog.load(path)
        names = moe.names or [f"moe.{i}" for i in range(len(moe.layers))]
        expert = moe.local_experts(moe.layers[0])[0]
        ep = next((len(g) for g in moe.ep_groups if parts.rank in g), None) if moe.ep_groups else None
        catalog.check_runtime(names, device_of(expert), position=moe.position(parts.rank),
                              hidden=expert_width(expert, moe.hidden_size),
                              local_experts=len(moe.local_experts(moe.layers[0])), ep_size=ep)
    except Exception as exc:  # noqa: BLE001 - any rank's failure, malformed files included, is everyone's
        error = f"{type(exc).__name__}: {exc}"
    errors = all_gather_data(error, parts.groups.world_control, what="MoE catalog check")
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        raise ValueError(f"replay.moe_catalog {path} cannot be used on rank(s) {[r for r, _ in bad]}: {bad[0][1]}")
    assert catalog is not None
    return catalog


def _refuse_dense_moe(layers: list[torch.nn.Module], names: list[str] | None, moe: Any) -> None:
    """A dense layer that contains a bound MoE layer would replay its AllToAll on other replicas' inputs and
    name the wrong ranks (and its experts' capture hooks would see replay rows): refuse it, saying what to do."""
    bound = {id(m) for m in moe.layers}
    for i, layer in enumerate(layers):
        if any(id(m) in bound for m in layer.modules()):
            name = names[i] if names else type(layer).__name__
            raise ValueError(f"the dense recipe would replay {name}, which contains a MoE layer bound by moe=: "
                             "pass layers=[...] naming the dense parts (attention, router) to enable()")


# -- certified recovery -----------------------------------------------------------------------------------

def build_snapshots(parts: ScoutParts) -> SnapshotEngine:
    """In-memory snapshots of the model, the optimizer, the RNG and SCOUT's and the caller's state."""
    a = parts.adapter
    return SnapshotEngine(a.chunks, a.optimizers, get_extra=parts.scout_state, set_extra=parts.restore_caller_state,
                          rng_providers=a.rng_providers)


def build_checkpoint(parts: ScoutParts) -> CheckpointCoordinator:
    """The coordinator of ``parts.snapshots``: memory slots, peer replicas, the durable store, the certifier."""
    cfg = parts.config
    directory = cfg.checkpoint.directory
    assert parts.snapshots is not None
    cadence = cfg.replay.cadence
    if parts.experts is None and not any(c > 0 for c in (cadence.embedding, cadence.hidden, cadence.output,
                                                         cadence.optimizer)):
        # The same on every rank (one configuration, one model): every rank raises alike.
        raise ConfigError("checkpoint.enabled: snapshots are taken at replay checks, and the only recipe with a "
                          "cadence here is replay.cadence.expert, but this job has no expert replay (no moe= "
                          "binding passed to enable()): set a dense recipe's cadence")
    # The slots are this job's own: its run id, else the launcher's job id, with the checkpoint folder's nonce
    # (rank 0's, the same on every rank; before any capture, so that none is ever named by a wrong one).
    job = job_name(cfg.report.run_id, configured=bool(cfg.report.run_id))
    nonce, fresh = share_nonce(directory, rank=parts.rank, group=parts.groups.world_control,
                               on_error=lambda exc: parts.guard.report(None, "checkpoint", exc, "the job nonce"))
    # Folders are checked on each machine (owner, mode, links): one machine's refusal fails enable() on every
    # rank, at once, rather than leaving the others in the next collective until the launcher's timeout.
    memory, durable = on_every_rank("the checkpoint folders", parts.groups.world_control, lambda: (
        MemorySlots(default_memory_root(directory, cfg.checkpoint.memory_dir), rank=parts.rank, hosts=parts.hosts,
                    fallback=os.path.join(directory, "memory"), token=job_token(job, nonce), fresh=fresh),
        DurableStore(directory, parts.rank, parts.world_size)))
    return CheckpointCoordinator(
        parts.snapshots, durable,
        new_certifier(parts), memory=memory, control_group=parts.groups.world_control,
        replicate=cfg.checkpoint.replicate_to_peer, decisions_path=os.path.join(directory, "decisions.jsonl"),
        keep_generations=cfg.checkpoint.keep_generations,
        on_error=lambda exc, where: parts.guard.report(parts.step(), "checkpoint", exc, where),
        extra_later=parts.adapter.get_state is not None)


def on_every_rank(what: str, group: Any, build: Callable[[], Any]) -> Any:
    """``build()`` on this rank; where it failed on any rank, every rank raises (the failing ones their own
    error, the others one that names the first failing rank and its error)."""
    built, error, mine = None, "", None
    try:
        built = build()
    except Exception as exc:  # noqa: BLE001 - raised below, after every rank knows
        error, mine = f"{type(exc).__name__}: {exc}", exc
    failed = [(r, e) for r, e in enumerate(all_gather_data(error, group, what=what)) if e]
    if mine is not None:
        raise mine
    if failed:
        more = f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise RuntimeError(f"SCOUT could not set up {what} on rank {failed[0][0]}{more}: {failed[0][1]}")
    return built


def new_certifier(parts: ScoutParts) -> Certifier:
    """The job's certifier; ``checkpoint.certify`` says when a capture becomes verified (the coverage it waits
    for is kept per rank in ``parts.coverage``)."""
    mode = parts.config.checkpoint.certify
    parts.coverage = Coverage(mode)
    return Certifier(static=mode == "last_check_only")


def build_labels(parts: ScoutParts) -> FrameworkLabels:
    """The run's labels of the framework's own checkpoints; they bring their own certifier (made when labelling
    starts) where SCOUT's snapshots do not certify."""
    own = None if parts.checkpoint is not None else functools.partial(new_certifier, parts)
    return FrameworkLabels(writer=parts.rank == 0, replay_on=parts.replay is not None, new_certifier=own)


# -- live control and the step hooks ------------------------------------------------------------------------

def register_live_keys(live: LiveControl, parts: ScoutParts, boundary: StepBoundary) -> None:
    """Tell the live-control table, on each part's behalf, which keys it reads and how it follows a change (in
    this order); where the part is off, why its keys are refused."""
    config, replay, experts, observer = parts.config, parts.replay, parts.experts, parts.observer
    if replay is None:
        live.pauses(None, refusal="replay is off in this job: there is nothing to pause")
        live.refuses(("replay.", "consensus."), "replay is off in this job: nothing reads that key")
    else:
        live.pauses(functools.partial(_pause_replay, parts))
        live.owns(("replay.cadence.",), lambda _key, _value: replay.reschedule())
        live.owns(("consensus.",), lambda _key, _value: _new_rules(replay, config))
    if experts is None:
        live.refuses(("replay.cadence.expert",),
                     "this job has no expert replay (replay.cadence.expert was 0 at start, or no MoE)")
    else:
        live.owns(("replay.cadence.expert",), lambda _key, value: setattr(experts, "every", value))
        live.owns(("consensus.",), lambda _key, _value: _new_expert_rule(experts, config))
    live.owns(("actions.on_verdict",), boundary.set_stop_on_verdict)
    live.owns(("report.log_level",), lambda _key, value: _log_level(parts, value))
    if observer is not None:  # the observer stops the trainer on a hang verdict, and logs the verdicts it reports
        record = observer.tracker.record
        live.owns(("actions.on_verdict",), lambda _key, value: record.set_live(on_verdict=str(value)))
        live.owns(("report.log_level",),
                  lambda _key, value: record.set_live(log_level=logging.getLevelName(str(value).upper())))


def _pause_replay(parts: ScoutParts, paused: bool) -> None:
    """``scout ctl pause|resume``: the replay checks (and with them certification and snapshots) stop or go on."""
    assert parts.control is not None and parts.replay is not None
    parts.control.paused = paused
    parts.replay.paused = parts.control.paused
    parts.replay.reschedule()


def _new_rules(replay: ReplayEngine, config: Any) -> None:
    replay.rule = StatisticalRule.from_config(config.consensus)
    replay.timing.rule = StatisticalRule.for_communication(config.consensus)
    replay.timing.compute_rule = replay.rule


def _new_expert_rule(experts: ExpertReplay, config: Any) -> None:
    if experts.alltoall is not None:
        experts.alltoall.rule = StatisticalRule.for_communication(config.consensus)


def _log_level(parts: ScoutParts, value: Any) -> None:
    level = logging.getLevelName(str(value).upper())
    for sink in parts.reporter.sinks:
        if isinstance(sink, LoggingSink):
            sink.level = level


def install_step_hooks(parts: ScoutParts, handle: ScoutHandle) -> None:
    """The boundary after each optimizer step (or after the framework's own step), the settle point before it."""
    opts = parts.adapter.optimizers
    if not opts:
        return
    parts.hooks.append(opts[0].register_step_pre_hook(lambda *_: handle.settle()))
    if parts.replay is not None:
        parts.hooks.append(opts[0].register_step_pre_hook(parts.replay._pre_step))
    owner = parts.adapter.step_owner
    if owner is None:
        parts.hooks.append(opts[-1].register_step_post_hook(lambda *_: handle.on_step()))
        return
    # The framework's own step ends the training step (Megatron's distributed optimizer copies and gathers
    # the updated parameters after its inner optimizers stepped): the boundary follows it.
    framework_step = owner.step

    def step(*args: Any, **kwargs: Any) -> Any:
        out = framework_step(*args, **kwargs)
        handle.on_step()
        return out

    parts.hooks.append(InstanceAttribute(owner, "step", step))
