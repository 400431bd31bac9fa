"""The handle ``enable()`` returns: every part SCOUT installed on this rank, and how to undo it.

One readable orchestration class. At each optimizer step (the LAST inner
optimizer's post-hook) :meth:`ScoutHandle.on_step` runs the replay boundary,
turns its result into certification evidence, combines the evidence job-wide,
lets the coordinator capture and persist what the certifier asks for, and acts
on verdicts (``actions.*``). :meth:`ScoutHandle.resume` is the restart path;
:meth:`ScoutHandle.close` removes every hook, thread, process, shared-memory
record and process group it created.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from scout_core.actions import (
    ScoutStop,
    actionable,
    exclude_hosts_path,
    hang_action,
    record_exclusions,
    verdict_summary,
)
from scout_core.adapter import FrameworkAdapter
from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier, FailureKind
from scout_core.checkpoint.coordinator import CheckpointCoordinator, combine_evidence
from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_core.checkpoint.memory import MemorySlots, default_memory_root
from scout_core.checkpoint.resume import Restarter, ResumeResult, drop_newer
from scout_core.checkpoint.snapshot import SnapshotEngine, restore_state
from scout_core.checkpoint.store import DurableStore
from scout_core.config import ScoutConfig
from scout_core.consensus import StatisticalRule
from scout_core.groups import ScoutGroups
from scout_core.moe.binding import expert_width
from scout_core.moe.catalog import Catalog
from scout_core.moe.replay import ExpertReplay
from scout_core.progress.control import ControlPlane
from scout_core.progress.hooks import ProgressTracker, install_collective_hooks, uninstall_collective_hooks
from scout_core.progress.observer import (
    OBSERVER_REPORTED_EXIT,
    OBSERVER_STACKS_SIGNAL,
    ObserverSpec,
    start_observer,
    steady_threshold,
)
from scout_core.progress.record import Phase, create_record
from scout_core.replay.engine import BoundaryResult, ReplayEngine
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.layer import device_of
from scout_core.replay.scratch import fsdp_owners
from scout_core.report import Incident, IncidentKind, IncidentScope, LoggingSink, Reporter

__all__ = ["ScoutHandle"]

_log = logging.getLogger("scout")

CRASH_FLUSH_S = 30.0
"""How long close() waits for snapshot persistence in flight while training is failing (a partner it
exchanges replicas with may be gone too); the slot written before that point survives the process."""


class _InstanceAttribute:
    """Sets ``obj.name`` on the instance until :meth:`remove` (a hook handle's interface)."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name = obj, name
        self.had = name in vars(obj)
        self.before = vars(obj).get(name)
        setattr(obj, name, value)

    def remove(self) -> None:
        if self.had:
            setattr(self.obj, self.name, self.before)
        else:
            vars(self.obj).pop(self.name, None)


class ScoutHandle:
    """What :func:`scout_core.enable` returns; :meth:`close` undoes everything it installed."""

    _open: ClassVar[ScoutHandle | None] = None
    _claim_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, *, config: ScoutConfig, adapter: FrameworkAdapter, rank: int, world_size: int, run_id: str,
                 groups: ScoutGroups, hosts: dict[int, str], devices: dict[int, str], reporter: Reporter) -> None:
        self.config = config
        self.adapter = adapter
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.groups = groups
        self.peer_groups_ranks = groups.peer_ranks
        self.hosts = hosts
        self.devices = devices
        self.reporter = reporter
        self.guard = DiagnosisGuard(groups.world_control, rank=rank, reporter=reporter, hosts=hosts)
        self.tracker: ProgressTracker | None = None
        self.observer_pid: int | None = None
        self._episode_bound_s = 0.0
        self.observer_startup_s: float | None = None
        self.control_plane: ControlPlane | None = None
        self.launch_id = ""
        """Rank 0's nonce for this launch: the observers' store keys of a restarted job never collide."""
        self.ddp_buckets_visible: bool | None = None
        self.replay: ReplayEngine | None = None
        self.experts: ExpertReplay | None = None
        self._dense_in_cycle = False  # a hidden-layer check ran since the last completed recipe cycle
        """The MoE expert recipe (``enable(..., moe=...)``), or None."""
        self.snapshots: SnapshotEngine | None = None
        self.checkpoint: CheckpointCoordinator | None = None
        self.last_result: BoundaryResult | None = None
        self.metrics: Any = None  # scout_core.metrics.ScoutMetrics, where report.prometheus asks for it
        self.last_expert: Any = None  # the expert check of the last boundary (scout_core.moe.replay.ExpertCheck)
        self.control: Any = None  # scout_core.control.RunControl, unless control.enabled is false
        self.last_decision: Any = None
        self.framework_checkpoints: FrameworkCheckpoints | None = None
        """Labels of the framework's own checkpoints (:meth:`label_framework_checkpoints`), or None."""
        self._labels_certifier: Certifier | None = None  # certifies the framework's checkpoints alone
        # Every recovery verdict of this run, for labels made after it (their folder is known only at the first
        # save, or the run saves to another folder than it loaded from): newer than this step is rejected, and
        # the failure the job stops for.
        self._rejected_above: int | None = None
        self._stopped_for: FailureKind | None = None
        self.stopped = False
        self.stop_on_verdict = config.actions.on_verdict == "stop"
        self.exit_code = config.actions.exit_code
        self._stop_code: int | None = None  # a verdict asked to stop: raised at the next settle point
        self._settle_extra = False  # a capture waits for the caller's end-of-step state
        self._hooks: list[Any] = []
        self._observer_reported = False
        self._closed = False
        ScoutHandle._open = self

    # -- one SCOUT per process -----------------------------------------------------------------------

    @classmethod
    def claim(cls) -> None:
        with cls._claim_lock:
            if cls._open is not None and not cls._open._closed:
                raise RuntimeError("SCOUT is already enabled on this rank; call close() on the existing handle "
                                   "before enable() again")
            cls._open = _CLAIMED

    @classmethod
    def is_open(cls) -> bool:
        """Whether SCOUT is enabled (or being enabled) on this rank."""
        with cls._claim_lock:
            return cls._open is not None and (cls._open is _CLAIMED or not cls._open._closed)

    @classmethod
    def release_claim(cls) -> None:
        with cls._claim_lock:
            if cls._open is _CLAIMED:
                cls._open = None

    # -- building the parts (called by enable_with, in this order) -----------------------------------

    def start_observer(self, plane: ControlPlane, on_incident: Callable[[Incident], None] | None) -> None:
        cfg = self.config
        tracker = self.tracker = ProgressTracker(create_record(self.run_id, self.rank))
        self.control_plane = plane
        start = time.monotonic()
        obs = cfg.observer
        # The trainer learns only gaps below the threshold the observer would apply: longer ones were stalls.
        steady = functools.partial(steady_threshold, obs.silence_threshold_s, obs.adaptive_multiple,
                                   obs.first_step_silence_s)
        warmup = max(obs.silence_threshold_s, obs.first_step_silence_s)
        tracker.record.learn_below = lambda published: steady(published) if published > 0 else warmup
        heartbeat_s = max(obs.heartbeat_s, self.world_size / 20000)
        gather_timeout_s = max(obs.gather_timeout_s, 3 * heartbeat_s)
        # An episode's longest wait (a member's wait for the verdict: EpisodeProtocol.await_verdict), with room
        # for its records and callbacks: how long close() lets a busy observer finish.
        self._episode_bound_s = 2 * (gather_timeout_s + 2 * heartbeat_s + 2.0) + self.OBSERVER_EXIT_S
        pid, ready_fd = start_observer(ObserverSpec(
            run_id=self.run_id, launch=self.launch_id, rank=self.rank, world_size=self.world_size,
            record_path=tracker.record.path, control=plane, peer_groups=[list(g) for g in self.groups.all_peers],
            hosts=self.hosts, devices=self.devices, silence_threshold_s=obs.silence_threshold_s,
            first_step_silence_s=obs.first_step_silence_s, io_silence_s=obs.io_silence_s,
            adaptive_multiple=obs.adaptive_multiple, heartbeat_s=heartbeat_s, gather_timeout_s=gather_timeout_s,
            startup_timeout_s=obs.startup_timeout_s,
            jsonl_path=cfg.report.jsonl_path, fsync=cfg.report.fsync, log_level=cfg.report.log_level,
            on_incident=hang_action(cfg, on_incident), stop_on_verdict=cfg.actions.on_verdict == "stop",
        ))
        self.observer_pid = pid
        try:
            with selectors.DefaultSelector() as sel:  # not select(): a trainer's fds may be numbered past 1023
                sel.register(ready_fd, selectors.EVENT_READ)
                ok = bool(sel.select(cfg.observer.startup_timeout_s)) and os.read(ready_fd, 1) == b"R"
        finally:
            os.close(ready_fd)
        if not ok:  # where it waits, on stderr, for whoever reads the job's log
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, OBSERVER_STACKS_SIGNAL)
                time.sleep(1.0)
        everyone = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.groups.world_control)
        if not everyone.item():  # every rank raises together: no rank is left waiting in a later collective
            self.check_observer()
            raise RuntimeError(f"rank {self.rank}: the SCOUT observer {'of another rank ' if ok else ''}did not "
                               f"start within {cfg.observer.startup_timeout_s}s (control store "
                               f"{plane.host}:{plane.port}, {plane.kind})")
        self.observer_startup_s = time.monotonic() - start
        marked = self.adapter.marked_layers or self.adapter.repeated_layers()
        tracker.install_module_hooks(marked, backward=cfg.observer.layer_backward_marks)
        tracker.install_optimizer_hooks(self.adapter.optimizers)
        ddp = [c for c in self.adapter.chunks if isinstance(c, torch.nn.parallel.DistributedDataParallel)]
        if ddp:
            self.ddp_buckets_visible = all(tracker.install_ddp_comm_hook(m) for m in ddp)
        install_collective_hooks(tracker)

    def start_replay(self) -> None:
        cfg, a = self.config, self.adapter
        if not cfg.replay.enabled:
            return
        layers = a.repeated_layers()
        names = a.layer_names if a.layers is not None and a.layer_names else None
        if a.moe is not None:
            _refuse_dense_moe(layers, names, a.moe)
        self.replay = ReplayEngine(
            layers, a.optimizers[0] if a.optimizers else None, config=cfg.replay, groups=self.groups,
            rule=StatisticalRule.from_config(cfg.consensus), comm_rule=StatisticalRule.for_communication(cfg.consensus),
            confirm_rounds=cfg.consensus.confirm_rounds, noise_window=cfg.consensus.noise_window_rounds,
            reporter=self.reporter, hosts=self.hosts, rng_providers=a.rng_providers, layer_names=names,
            embedding=a.embedding, output=a.output, boundary_owner=a.boundary_owner, hook_optimizer=False,
            layer_owners=fsdp_owners(layers, a.chunks),
            # Experts differ between EP positions: their optimizer slices are self-checked on each rank only.
            local_only_params=a.moe.expert_parameters() if a.moe is not None else (),
            replicated_parameters=a.replicated_parameters, compare_optimizer_slices=a.compare_optimizer_slices,
            compare_param_grads=a.compare_param_grads, compare_extra_state=a.compare_extra_state,
            replay_context=a.replay_context,
            replay_pairs_across_groups=a.replay_pairs_across_groups, gather_layer=a.gather_layer,
            gather_bytes=a.gather_bytes)
        every, catalog_path = cfg.replay.cadence.expert, cfg.replay.moe_catalog
        if a.moe is None and catalog_path:
            raise ValueError(f"replay.moe_catalog is set ({catalog_path}) but enable() was given no moe= binding: "
                             "the expert recipe needs the MoE layers and the groups holding the same experts")
        if a.moe is not None and every > 0:
            catalog = self._load_catalog(catalog_path, a.moe) if catalog_path else None
            self.experts = ExpertReplay(a.moe, every=every,
                                        world_control=self.groups.world_control, rank=self.rank,
                                        reporter=self.reporter, hosts=self.hosts, catalog=catalog,
                                        comm_rule=StatisticalRule.for_communication(cfg.consensus),
                                        confirm_rounds=cfg.consensus.confirm_rounds,
                                        determinism_every=cfg.replay.determinism_every,
                                        deterministic=cfg.replay.deterministic, rng_providers=a.rng_providers,
                                        replay_context=a.replay_context)

    def _load_catalog(self, path: str, moe: Any) -> Catalog:
        """The shape catalog, checked on every rank before any group is built: a rank that cannot use it (no
        file on that node, another GPU) makes every rank raise the same error, instead of leaving the others
        waiting in the next collective."""
        catalog, error = None, ""
        try:
            catalog = Catalog.load(path)
            names = moe.names or [f"moe.{i}" for i in range(len(moe.layers))]
            expert = moe.local_experts(moe.layers[0])[0]
            ep = next((len(g) for g in moe.ep_groups if self.rank in g), None) if moe.ep_groups else None
            catalog.check_runtime(names, device_of(expert), position=moe.position(self.rank),
                                  hidden=expert_width(expert, moe.hidden_size),
                                  local_experts=len(moe.local_experts(moe.layers[0])), ep_size=ep)
        except Exception as exc:  # noqa: BLE001 - any rank's failure, malformed files included, is everyone's
            error = f"{type(exc).__name__}: {exc}"
        errors: list[Any] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.groups.world_control)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise ValueError(f"replay.moe_catalog {path} cannot be used on rank(s) {[r for r, _ in bad]}: {bad[0][1]}")
        assert catalog is not None
        return catalog

    def start_checkpointing(self) -> None:
        cfg, a = self.config, self.adapter
        if not cfg.checkpoint.enabled:
            return
        directory = cfg.checkpoint.directory
        self.snapshots = SnapshotEngine(a.chunks, a.optimizers, get_extra=self._snapshot_extra,
                                        set_extra=self._restore_extra, rng_providers=a.rng_providers)
        memory = MemorySlots(default_memory_root(directory, cfg.checkpoint.memory_dir), rank=self.rank,
                             hosts=self.hosts, fallback=os.path.join(directory, "memory"))
        self.checkpoint = CheckpointCoordinator(
            self.snapshots, DurableStore(directory, self.rank, self.world_size),
            self._new_certifier(), memory=memory, control_group=self.groups.world_control,
            replicate=cfg.checkpoint.replicate_to_peer, decisions_path=os.path.join(directory, "decisions.jsonl"),
            keep_generations=cfg.checkpoint.keep_generations,
            on_error=lambda exc, where: self.guard.report(self._step(), "checkpoint", exc, where),
            extra_later=a.get_state is not None)

    def _new_certifier(self) -> Certifier:
        k = self.config.checkpoint.recipes_per_cycle
        if self.experts is not None:
            # A candidate is vouched for only after every expert (and every catalog shape of each) was replayed
            # clean: one recipe cycle of the expert recipe (paper section 8), counted in expert checks.
            k = max(k, self.experts.cycle)
            _log.info("SCOUT: certification waits for a recipe cycle of %d expert checks", k)
        return Certifier(recipes_per_cycle=k, static=k == 1)

    @property
    def certifier(self) -> Certifier | None:
        """The job's certification state: SCOUT's checkpoint coordinator's, or the one that certifies only the
        framework's own checkpoints (:meth:`label_framework_checkpoints`); None when nothing certifies."""
        return self.checkpoint.certifier if self.checkpoint is not None else self._labels_certifier

    def install_step_hooks(self) -> None:
        opts = self.adapter.optimizers
        if not opts:
            return
        self._hooks.append(opts[0].register_step_pre_hook(lambda *_: self.settle()))
        if self.replay is not None:
            self._hooks.append(opts[0].register_step_pre_hook(self.replay._pre_step))
        owner = self.adapter.step_owner
        if owner is None:
            self._hooks.append(opts[-1].register_step_post_hook(lambda *_: self.on_step()))
            return
        # The framework's own step ends the training step (Megatron's distributed optimizer copies and gathers
        # the updated parameters after its inner optimizers stepped): the boundary follows it.
        framework_step = owner.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = framework_step(*args, **kwargs)
            self.on_step()
            return out

        self._hooks.append(_InstanceAttribute(owner, "step", step))

    # -- snapshot contents ------------------------------------------------------------------------------

    def _snapshot_extra(self) -> dict[str, Any]:
        """SCOUT's own schedule and saved calls, final at the boundary. The caller's state is added at the
        next settle point (:meth:`settle`), once the scheduler, scaler and loop counters have stepped."""
        extra: dict[str, Any] = {"caller": {}}
        if self.replay is not None:
            extra["scout"] = self.replay.sweep_state()
        if self.experts is not None:
            extra["scout_experts"] = self.experts.state()
        return extra

    def flush(self) -> None:
        """The training step is over: complete the snapshot with the caller's state and wait until it is
        written and replicated (a pending stop is carried out here too)."""
        self.settle()
        if self.checkpoint is not None:
            with self._checkpoint_io("write"):
                self.checkpoint.flush()

    def settle(self) -> None:
        """End of the training step, as seen from the next data fetch or the next optimizer step: the
        caller's state joins the snapshot taken at the boundary, then a pending stop is carried out."""
        self._complete_caller_state()
        if self._stop_code is not None and not self.stopped:
            if self.checkpoint is not None:
                with self._checkpoint_io("write"):  # the observer sees a checkpoint write, not a silent rank
                    self.checkpoint.flush()  # the snapshot of this boundary is written and replicated
            dist.barrier(group=self.groups.world_control)  # rank 0's records are durable before anyone exits
            self.stopped = True
            if self.tracker is not None:  # a deliberate end: the observer need not answer for a dead trainer
                self.tracker.mark(Phase.CLOSED)
            if self.metrics is not None:  # the verdict stays readable; no stall alert for a job that stopped
                self.metrics.stopped()
            raise ScoutStop(self._stop_code)

    def _caller_state(self) -> dict[str, Any]:
        """The caller's state objects for a snapshot; a read that fails is reported, never raised (the snapshot
        must still complete, or persistence waits forever)."""
        try:
            return self.adapter.get_state() if self.adapter.get_state else {}
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.guard.report(self._step(), "checkpoint", exc, "caller state for the snapshot")
            return {"unavailable": True}

    def _complete_caller_state(self) -> None:
        if self._settle_extra and self.snapshots is not None:
            self._settle_extra = False
            self.snapshots.complete_extra({"caller": self._caller_state()})

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        if self.adapter.set_state is not None:
            self.adapter.set_state(extra.get("caller", {}))

    def _step(self) -> int:
        if self.replay is not None:
            return self.replay.step
        return self.tracker.step if self.tracker is not None else 0

    # -- every optimizer step ------------------------------------------------------------------------

    def on_step(self) -> BoundaryResult | None:
        """The boundary after each optimizer step (called by the hook; call it yourself if you have no
        optimizer to hook). Replay, certification, actions. Never raises into training except
        :class:`~scout_core.actions.ScoutStop` when ``actions.on_verdict`` is ``stop``."""
        start = time.perf_counter()
        try:
            result = self._boundary()
            if self.control is not None and self.control.tick():
                self._steer(self._step() or self.control.steps)
            return result
        finally:  # also when the boundary stops the job: the last figures are the ones an operator reads
            if self.metrics is not None:
                self.metrics.boundary(self, time.perf_counter() - start)

    # -- runtime control (scout ctl) ------------------------------------------------------------------

    def _steer(self, step: int) -> None:
        """Every rank applies rank 0's pending commands at this same step (``scout_core.control``)."""
        for command in self.control.exchange():
            status, reason = self._apply_command(command)
            self.control.answer(command, step, status, reason)
            if status == "applied":
                _log.warning("rank %d: SCOUT control at step %d: %s %s%s", self.rank, step, command.get("op"),
                             command.get("key", ""), f"={command.get('value')}" if command.get("key") else "")

    def _apply_command(self, command: dict[str, Any]) -> tuple[str, str]:
        """Apply one command alike on every rank: the same command and configuration give the same outcome."""
        from scout_core.control import ControlError, check_live, resolve

        op = command.get("op")
        if command.get("bad"):
            return "refused", str(command["bad"])
        if op in ("pause", "resume"):
            if self.replay is None:
                return "refused", "replay is off in this job: there is nothing to pause"
            self.control.paused = op == "pause"
            self.replay.paused = self.control.paused
            self.replay.reschedule()
            return "applied", ""
        if op != "set":
            return "refused", f"unknown command {op!r}"
        key = str(command.get("key", ""))
        try:
            value = check_live(key, str(command.get("value", "")), self.config)
        except ControlError as exc:
            return "refused", str(exc)
        if key in self.adapter.pinned:
            return "refused", f"{key} was fixed when SCOUT attached to this job: {self.adapter.pinned[key]}"
        if key.startswith(("replay.", "consensus.")) and self.replay is None:
            return "refused", "replay is off in this job: nothing reads that key"
        if key == "replay.cadence.expert" and self.experts is None:
            return "refused", "this job has no expert replay (replay.cadence.expert was 0 at start, or no MoE)"
        section, _, leaf = key.rpartition(".")
        setattr(resolve(self.config, section), leaf, value)
        if section == "replay.cadence":
            if self.replay is not None:
                self.replay.reschedule()
            if leaf == "expert" and self.experts is not None:
                self.experts.every = value
        elif section == "consensus" and self.replay is not None:
            self.replay.rule = StatisticalRule.from_config(self.config.consensus)
            self.replay.timing.rule = StatisticalRule.for_communication(self.config.consensus)
            self.replay.timing.compute_rule = self.replay.rule
            if self.experts is not None and self.experts.alltoall is not None:
                self.experts.alltoall.rule = StatisticalRule.for_communication(self.config.consensus)
        elif key == "actions.on_verdict":
            self.stop_on_verdict = value == "stop"
            if self.tracker is not None:  # the observer stops the trainer on a hang verdict: it reads it there
                self.tracker.record.set_live(on_verdict=str(value))
        elif key == "report.log_level":
            level = logging.getLevelName(str(value).upper())
            for sink in self.reporter.sinks:
                if isinstance(sink, LoggingSink):
                    sink.level = level
            if self.tracker is not None:  # and logs the hang verdicts it reports
                self.tracker.record.set_live(log_level=level)
        return "applied", ""

    def _boundary(self) -> BoundaryResult | None:
        self.settle()  # a previous step's snapshot is complete before this boundary (manual callers too)
        if self.observer_pid is not None:
            self.check_observer()
        if self.replay is None:
            return None
        if self.snapshots is not None:
            self.snapshots.reserve_host_memory()  # once, now that the optimizer state exists
        # SCOUT's local work is guarded stage by stage inside the boundary; what is left are collectives,
        # and a collective that fails means the job's communication failed: that propagates, as the
        # training job's own next collective would.
        result = self.last_result = self.replay.boundary()
        paused = self.control is not None and self.control.paused
        expert = self.last_expert = (self.experts.boundary(result.step) if self.experts is not None and not paused
                                     else None)
        if expert is not None:
            result.incidents_global += expert.incidents  # each expert-peer group's own verdicts
        if not result.checked and expert is None:
            return result
        verdicts = actionable(result.incidents + result.incidents_global)
        local = BoundaryEvidence(sdc=result.sdc or bool(expert and expert.sdc),
                                 inconclusive=result.inconclusive or bool(expert and expert.inconclusive),
                                 missing=result.missing or bool(expert and expert.skipped),
                                 straggler=any(i.kind is IncidentKind.STRAGGLER for i in verdicts))
        cert = self.certifier
        if cert is not None:
            self._dense_in_cycle = self._dense_in_cycle or "hidden" in result.recipes
            certify = self._certifies(result, expert)
            if self.checkpoint is not None:
                action, job = self.checkpoint.on_boundary(result.step, local, certify=certify)
                self._settle_extra = action in (Action.CAPTURE, Action.CAPTURE_AND_PERSIST)
            else:  # certification of the framework's checkpoints alone: nothing to capture
                job = combine_evidence(local, self.groups.world_control, at_cycle_boundary=cert.at_cycle_boundary)
                action = (cert.on_boundary(result.step, job) if certify or job.sdc or job.inconclusive
                          else cert.skip_uncertified(job))
            if action in (Action.CAPTURE_AND_PERSIST, Action.RECOVER):
                self._dense_in_cycle = False
        else:
            job, action = combine_evidence(local, self.groups.world_control), None
        verdict = job.sdc or job.inconclusive or job.straggler
        failure = (FailureKind.SDC if job.sdc or job.inconclusive else FailureKind.STRAGGLER) if verdict else None
        if self.framework_checkpoints is not None and cert is not None:
            try:
                self.framework_checkpoints.on_boundary(result.step, action, cert,
                                                       failure=failure, stopping=self.stop_on_verdict)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                self.guard.report(result.step, "checkpoint", exc, "framework checkpoint labels")
        if cert is not None and action is Action.RECOVER:  # remembered for labels made later
            verified = -1 if cert.verified is None else cert.verified
            before = self._rejected_above
            self._rejected_above = verified if before is None else min(before, verified)
            if failure is not None and self.stop_on_verdict:
                self._stopped_for = failure
        if verdict:
            self._act(result, verdicts, job, action, expert=actionable(expert.incidents) if expert else [])
        return result

    def label_framework_checkpoints(self, folder: str) -> FrameworkCheckpoints | None:
        """Label the framework's own checkpoints in ``folder`` by certification (see
        :mod:`scout_core.checkpoint.durable`). Every rank calls it (it changes what each boundary exchanges); the
        caller reports each save with ``saved(step, path, handle.certifier)``, asks ``choose()`` at restart and
        tells SCOUT where training goes on (:meth:`continue_from`). Without SCOUT's own snapshots
        (``checkpoint.enabled`` false) the same certification runs for these labels alone. None when replay is
        off: nothing could ever verify a checkpoint, and labels would only hold restarts back."""
        if self.replay is None:
            _log.warning("SCOUT: replay is off, so nothing certifies the framework's checkpoints in %s: they are "
                         "not labelled and a restart loads what the framework chooses", folder)
            return None
        self.certify_framework_checkpoints()
        labels = FrameworkCheckpoints(folder, writer=self.rank == 0)
        if self._rejected_above is not None:  # a verdict of this run came before these labels
            labels.reject_above(self._rejected_above, stopped_for=self._stopped_for)
        self.framework_checkpoints = labels
        return labels

    def certify_framework_checkpoints(self) -> None:
        """Start certifying for the framework's checkpoints now, where their folder is known only at the first
        save (DeepSpeed's ``save_checkpoint(save_dir)``): a verdict before that save must still reject what the
        job saves after it, and nothing may be verified on evidence that began after the corruption spread.
        :meth:`label_framework_checkpoints` calls it too. Nothing where SCOUT's own snapshots certify, or replay
        is off."""
        if self.replay is not None and self.checkpoint is None and self._labels_certifier is None:
            self._labels_certifier = self._new_certifier()

    def continue_from(self, step: int, *, verified: int | None, abandon_newer: bool = True) -> None:
        """The framework restored its own checkpoint of ``step`` (not one of SCOUT's snapshots): SCOUT's step
        count, replay schedule and certification go on from there, every rank alike. ``verified``: the newest
        verified step at or before it (the restored state's trust), or None. SCOUT's own snapshots newer than
        ``step`` belong to the abandoned run and are deleted, so a later restart never mixes them in
        (``abandon_newer=False``: a job that only reads the checkpoint keeps them)."""
        if self.checkpoint is not None and abandon_newer:
            self.checkpoint.flush()
            drop_newer(self.checkpoint, int(step), rank=self.rank)
        if self.replay is not None:
            self.replay.continue_at(step)
        if self.tracker is not None:
            self.tracker.resume_at = int(step)
        cert = self.certifier
        if cert is not None:
            cert.latest, cert.verified, cert.candidate, cert.q = int(step), verified, None, 0

    def _certifies(self, result: BoundaryResult, expert: Any) -> bool:
        """Whether this boundary's checks can vouch for the state (the same on every rank).

        With the expert recipe, the recipe cycle K counts expert checks (every layer, local expert and
        catalog representative once), so the boundaries with an expert check certify; a dense check between
        them still reports SDC. The boundary that would complete a cycle certifies only if a hidden-layer
        check also ran in that cycle (the dense parts are vouched for too). Otherwise only a check that
        replayed a layer vouches (an LM-head or optimizer check on its own cadence does not), unless the layer
        recipe is configured off (not switched off by replay's health: then nothing is vouched for)."""
        hidden_off = self.config.replay.cadence.hidden == 0 and "hidden" not in self.replay.health.disabled
        if self.experts is not None:
            closes = self.certifier.at_cycle_boundary
            return expert is not None and (not closes or self._dense_in_cycle or hidden_off)
        return result.checked and ("hidden" in result.recipes or hidden_off)

    def _act(self, result: BoundaryResult, verdicts: list[Incident], job: BoundaryEvidence,
             action: Action | None, expert: list[Incident] | None = None) -> None:
        """A verdict somewhere in the job: decision, hosts to exclude, and maybe stop. Same on every rank.
        Each peer group's lowest rank contributes its group's verdicts, and each expert-peer group's lowest rank
        its expert verdicts (an expert SDC is known only inside the expert's replicas)."""
        everyone: list[Any] = [None] * self.world_size
        expert_ids = {id(i) for i in expert or []}
        dense = [i for i in verdicts if id(i) not in expert_ids]
        mine = [verdict_summary(i) for i in dense] if self.rank == min(self.groups.peer_ranks) else []
        if expert and self.experts is not None and self.rank == min(self.experts.peers):
            mine += [verdict_summary(i) for i in expert]
        dist.all_gather_object(everyone, mine, group=self.groups.world_control)
        summaries = list({(v["kind"], v["scope"], tuple(v["ranks"]), v["step"]): v
                          for vs in everyone for v in vs}.values())
        failure = FailureKind.SDC if (job.sdc or job.inconclusive) else FailureKind.STRAGGLER
        try:
            if self.checkpoint is not None:
                self.last_decision = self.checkpoint.decide(failure, incident=summaries[0] if summaries else None,
                                                            binding=self.stop_on_verdict)
            path = exclude_hosts_path(self.config)
            if self.rank == 0 and path is not None:
                record_exclusions(path, summaries)
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.guard.report(result.step, "actions", exc, "verdict actions")
        if self.stop_on_verdict:
            self._stop_code = self.exit_code  # at the end of this step (see settle)

    # -- restart -------------------------------------------------------------------------------------

    def resume(self, failure: str | None = None) -> ResumeResult:
        """Restore the checkpoint the retrieval policy chooses (see :mod:`scout_core.checkpoint.resume`).

        Call once, on every rank, right after ``enable()``. Returns ``ResumeResult(step=None)`` on a
        fresh start. ``failure`` forces the failure kind when no decision was recorded.
        """
        if self.checkpoint is None:
            return ResumeResult(step=None, reason="checkpoint.enabled is false: nothing to resume")
        a = self.adapter
        restarter = Restarter(
            self.checkpoint, control_group=self.groups.world_control, engine=self.replay,
            restore=lambda snap: restore_state(a.chunks, a.optimizers, snap, set_extra=self._restore_extra,
                                               rng_providers=a.rng_providers),
            after_restore=self._after_restore, current=self._state_now,
            extra_sweeps=[self.experts.sweep] if self.experts is not None else [])
        with self._checkpoint_io("read"):  # loading (and a sweep) can take long: the observer sees why
            return restarter.resume(failure)

    def _checkpoint_io(self, kind: str) -> contextlib.AbstractContextManager[None]:
        """SCOUT's own blocking checkpoint work on the training thread, published as such for the observer."""
        if self.tracker is None or self.tracker.closed:
            return contextlib.nullcontext()
        return self.tracker.checkpoint_io(kind)

    def _state_now(self) -> dict[str, Any]:
        """A copy of the state as it is now (what a dirty emergency sweep puts back)."""
        assert self.snapshots is not None
        self.snapshots.capture(-1, extra_later=True)
        try:
            # The caller's state too: a rolled-back sweep must not leave the scheduler or data position of
            # the rejected state behind.
            self.snapshots.complete_extra({"caller": self._caller_state()})
            return self.snapshots.result()
        finally:
            self.snapshots.release()

    def _after_restore(self, snap: dict[str, Any], trust: dict[str, Any]) -> None:
        if self.replay is not None:
            self.replay.load_sweep_state(snap["extra"].get("scout", {"step": snap["step"], "checks": 0}))
        if self.experts is not None:
            self.experts.load_state(snap["extra"].get("scout_experts", {}))
        cert = self.checkpoint.certifier
        cert.latest, cert.verified, cert.candidate, cert.q = trust["latest"], trust["verified"], None, 0
        if self.tracker is not None:
            self.tracker.resume_at = int(snap["step"])

    # -- training-loop boundaries -------------------------------------------------------------------

    def wrap_dataloader(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """The loader, marked for the hang path; each fetch is also where a step ends (see :meth:`settle`)."""
        handle = self

        class _Settling:
            def __iter__(self) -> Any:
                for item in inner:
                    yield item
                    handle.settle()

            def __len__(self) -> int:
                return len(iterable)  # type: ignore[arg-type]

        inner = self.tracker.wrap_dataloader(iterable) if self.tracker else iterable
        return _Settling()

    def checkpoint_io(self, kind: str = "write") -> contextlib.AbstractContextManager[None]:
        return self.tracker.checkpoint_io(kind) if self.tracker else contextlib.nullcontext()

    OBSERVER_EXIT_S = 5.0
    """close() waits this long for an idle observer (inside a store call, or a user callback) before killing it;
    one inside an episode (it says so in the record) gets until the episode's own bound, plus this."""

    def _reap_observer(self) -> None:
        """Wait for the observer we terminated: ``OBSERVER_EXIT_S`` from close() or from the end of its last
        busy stretch (an episode, its records, its closing messages), at most ``_episode_bound_s`` busy; then
        kill it. Never blocks for good: a process stuck in uninterruptible I/O (an fsync on a hung file
        system) is left behind after one more ``OBSERVER_EXIT_S``."""
        record = self.tracker.record if self.tracker is not None else None
        idle_since = busy_since = time.monotonic()
        killed_at: float | None = None
        try:
            while os.waitpid(self.observer_pid, os.WNOHANG)[0] == 0:
                now = time.monotonic()
                if killed_at is not None:
                    if now - killed_at > self.OBSERVER_EXIT_S:
                        _log.warning("rank %d: the SCOUT observer (pid %d) does not exit even when killed",
                                     self.rank, self.observer_pid)
                        return
                elif record is not None and record.observer_busy:
                    idle_since = now
                    if now - busy_since > self._episode_bound_s:
                        killed_at = now
                        os.kill(self.observer_pid, 9)
                else:
                    busy_since = now
                    if now - idle_since > self.OBSERVER_EXIT_S:
                        killed_at = now
                        os.kill(self.observer_pid, 9)
                time.sleep(0.01)
        except (ChildProcessError, ProcessLookupError):
            pass

    # -- observer health -----------------------------------------------------------------------------

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
                hosts=[self.hosts[self.rank]], devices=[self.devices[self.rank]],
                step=self.tracker.step if self.tracker else None,
                reason=f"observer of rank {self.rank} (pid {self.observer_pid}) exited with {code}; "
                       "hangs on this rank can no longer be localized",
                evidence={"observer_pid": self.observer_pid, "exit": code},
            ))
        return False

    # -- teardown ------------------------------------------------------------------------------------

    def close(self, *, discard_snapshots: bool = False, failed: bool | None = None) -> None:
        """Remove every hook, thread, process, record and group SCOUT created; idempotent.

        In-memory snapshots are kept (they exist to survive the trainer: a restart resumes from them)
        unless ``discard_snapshots`` (e.g. after the last step of a finished job). Safe in an exception
        handler: while training is failing, a pending stop is not carried out (it would wait for peers
        that may be gone), persistence in flight gets at most ``CRASH_FLUSH_S``, and every clean-up step
        runs even if an earlier one fails. ``failed``: whether training ended by a failure (None: judged from
        the exception being handled; an exit handler, which cannot tell, passes True).
        """
        if self._closed:
            return
        failing = sys.exc_info()[1] is not None if failed is None else failed
        pending: ScoutStop | None = None
        if not failing:
            try:
                self.settle()  # the last step's caller state; a stop decided at the last step is still carried out
            except ScoutStop as stop:
                pending = stop
            except Exception as exc:  # noqa: BLE001 - clean-up must still happen
                failed = exc
                self._quietly(lambda: self.guard.report(self._step(), "close", failed, "settle at close"), "report")
        else:
            self._quietly(self._complete_caller_state, "caller state at close")
        if not failing and pending is None and not self.stopped and self.framework_checkpoints is not None:
            # A normal end: a relaunch goes on from the newest checkpoint not rejected (see durable.ended).
            self._quietly(self.framework_checkpoints.ended, "checkpoint labels at close")
        self._closed = True
        try:
            for h in self._hooks:
                self._quietly(h.remove, "hook removal")
            self._hooks.clear()
            if self.checkpoint is not None:
                def final_flush() -> None:
                    with self._checkpoint_io("write"):  # a long last write is I/O for the observer, not a stall
                        self.checkpoint.flush(CRASH_FLUSH_S if failing else None)

                self._quietly(final_flush, "snapshot flush")
                if discard_snapshots:
                    self._quietly(lambda: self.checkpoint.memory.remove_mine(self.checkpoint.sources),
                                  "snapshot removal")
            if self.snapshots is not None:
                self._quietly(self.snapshots.close, "snapshot engine")
            if self.replay is not None:
                self._quietly(self.replay.close, "replay hooks")
            if self.experts is not None:
                self._quietly(self.experts.close, "expert replay hooks")
            if self.tracker is not None:
                self._quietly(self.tracker.remove_hooks, "progress hooks")
                self._quietly(lambda: uninstall_collective_hooks(self.tracker), "collective hooks")
            if self.observer_pid is not None and not self._observer_reported:  # not reaped: its pid is still ours
                if self.tracker is not None:  # the observer ends without answering for us
                    self._quietly(lambda: self.tracker.mark(Phase.CLOSED), "progress record")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.observer_pid, 15)
                self._reap_observer()
            if self.tracker is not None:
                self._quietly(self.tracker.record.unlink, "progress record")
                self._quietly(self.tracker.record.close, "progress record")
            if self.metrics is not None:  # a rank that stopped or failed keeps its last textfile (scout_running 0)
                keep = failing or pending is not None or self.stopped
                self._quietly(lambda: self.metrics.close(keep_textfile=keep), "metrics endpoint")
            if self.control is not None:
                self._quietly(self.control.close, "control folder")
            for g in {self.groups.world_control, self.groups.peer, self.groups.peer_control,
                      self.groups.replica_control, getattr(self.checkpoint, "repl_group", None)} - {None}:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(g)
        finally:
            with ScoutHandle._claim_lock:
                if ScoutHandle._open is self:
                    ScoutHandle._open = None
        if pending is not None:
            raise pending

    def _quietly(self, fn: Callable[[], Any], what: str) -> None:
        """One clean-up step: a failure is logged and the next step still runs."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - close() must release everything it can
            _log.warning("rank %d: SCOUT close: %s failed (%s: %s)", self.rank, what, type(exc).__name__, exc)

    def __enter__(self) -> ScoutHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Claimed:
    _closed = False


_CLAIMED: Any = _Claimed()


def _refuse_dense_moe(layers: list[torch.nn.Module], names: list[str] | None, moe: Any) -> None:
    """A dense layer that contains a bound MoE layer would replay its AllToAll on other replicas' inputs and
    name the wrong ranks (and its experts' capture hooks would see replay rows): refuse it, saying what to do."""
    bound = {id(m) for m in moe.layers}
    for i, layer in enumerate(layers):
        if any(id(m) in bound for m in layer.modules()):
            name = names[i] if names else type(layer).__name__
            raise ValueError(f"the dense recipe would replay {name}, which contains a MoE layer bound by moe=: "
                             "pass layers=[...] naming the dense parts (attention, router) to enable()")
