"""In-situ replay at the optimizer boundary (paper section 6.1 and Algorithm 2): the engine, in the paper's order.

Right after the real optimizer step, :meth:`ReplayEngine.boundary` picks what is due and a rotating source peer
(``replay.schedule``), agrees and broadcasts the source's inputs and RNG states (``replay.protocol``), replays each
due recipe on cloned state (``replay.recipe``), exchanges every surface's signature and compares it by strict
majority (exact C3), sets aside ranks that are not evidence (``replay.trust``), judges timing (``replay.judge``)
and writes the verdicts (``replay.verdicts``). Training numerics are untouched, and a local failure on any rank
makes every rank skip the check together (``replay.guard``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from scout_core.config import ReplayConfig
from scout_core.consensus import Persistence, StatisticalRule
from scout_core.groups import ScoutGroups, local_groups
from scout_core.replay.capture import LayerCapture
from scout_core.replay.health import RecipeHealth
from scout_core.replay.judge import TimingJudge
from scout_core.replay.layer import device_of
from scout_core.replay.protocol import DIAGNOSIS_ERROR, CheckProtocol
from scout_core.replay.recipe import OptimizerRecipe, RecipeRunner, peers_hold_equal_shards, place_layers
from scout_core.replay.result import REPLICA_UNTRUSTED, REPLICATED_STATE, BoundaryResult
from scout_core.replay.rng import RngProvider
from scout_core.replay.schedule import DueCheck, Schedule
from scout_core.replay.spec_codec import allow_call_packages
from scout_core.replay.sweep import EmergencySweep
from scout_core.replay.timing import CommTiming
from scout_core.replay.trust import Trust
from scout_core.replay.verdicts import VerdictContext, check_verdicts
from scout_core.replay.vetting import SOURCE_SURFACE
from scout_core.report import Incident, Reporter

# BoundaryResult and the replica surfaces' names are re-exported: they lived here before replay.result.
__all__ = ["REPLICATED_STATE", "REPLICA_UNTRUSTED", "BoundaryResult", "ReplayEngine"]


class ReplayEngine:
    """Replays one sampled layer (rotating) and an optimizer slice on due steps."""

    def __init__(
        self, layers: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer | None, *, config: ReplayConfig,
        group: Any = None, groups: ScoutGroups | None = None, rule: StatisticalRule | None = None,
        comm_rule: StatisticalRule | None = None, confirm_rounds: int = 2, noise_window: int = 64,
        persistence: Persistence | None = None,
        reporter: Reporter | None = None, hosts: Mapping[int, str] | None = None, compare_param_state: bool = True,
        compare_optimizer_slices: bool | None = None, rng_providers: Mapping[str, RngProvider] | None = None,
        layer_names: Sequence[str] | None = None, embedding: torch.nn.Module | None = None,
        output: torch.nn.Module | None = None, boundary_owner: torch.nn.Module | None = None,
        layer_owners: Sequence[torch.nn.Module | None] | None = None, hook_optimizer: bool = True,
        local_only_params: Sequence[torch.Tensor] = (),
        replicated_parameters: Callable[[torch.nn.Module], list[torch.Tensor]] | None = None,
        compare_param_grads: bool = True, compare_extra_state: bool = True,
        replay_context: Callable[[], AbstractContextManager[Any]] | None = None,
        replay_pairs_across_groups: bool = False,
        gather_layer: Callable[[torch.nn.Module], tuple[Any, Callable[[], None]]] | None = None,
        gather_bytes: Callable[[torch.nn.Module], int] | None = None,
    ) -> None:
        self.layers, self.names, self.extra = place_layers(layers, layer_names, embedding=embedding, output=output)
        self.n_hidden = n_hidden = len(layers)
        owners = list(layer_owners) if layer_owners is not None else [None] * n_hidden
        if len(owners) != n_hidden:
            raise ValueError(f"layer_owners has {len(owners)} entries for {n_hidden} layers")
        self.cfg, self.groups = config, groups if groups is not None else local_groups(group)
        self.peers, self.rank = self.groups.peer_ranks, dist.get_rank()
        self.rule = rule or StatisticalRule()
        self.reporter, self.hosts = reporter, dict(hosts or {})
        self.captures = [LayerCapture(layer) for layer in self.layers]
        self.optimizer = optimizer
        self.opt = None if optimizer is None else OptimizerRecipe(
            optimizer, slice_elems=config.optimizer_slice_elems, local_only=local_only_params,
            compare_slices=(peers_hold_equal_shards(optimizer, self.peers, self.rank)
                            if compare_optimizer_slices is None else compare_optimizer_slices))
        self.opt_slice = self.opt.slice if self.opt is not None else None
        self.history: deque[BoundaryResult] = deque(maxlen=1024)  # boundaries that did work, newest last
        # Communication is judged with its own ratio floor (a shared fabric is noisier than a device's compute).
        self.timing = CommTiming(comm_rule or self.rule, confirm_rounds, world_control=self.groups.world_control,
                                 hosts=self.hosts, compute_rule=self.rule, window=noise_window)
        self.judge = TimingJudge(self.timing, confirm_rounds=confirm_rounds, noise_window=noise_window,
                                 persistence=persistence)
        recipe_of_layer = {name: ("hidden" if i < n_hidden else next(r for r, j in self.extra.items() if j == i))
                           for i, name in enumerate(self.names)}
        self.health = RecipeHealth(rank=self.rank, world_control=self.groups.world_control,
                                   recipe_of_layer=recipe_of_layer, emit=self._emit)
        self.schedule = Schedule(config, self.captures, n_hidden=n_hidden, extra=self.extra,
                                 n_peers=len(self.peers), health=self.health)
        self.trust = Trust()
        # The packages of the checked layers' classes are the model's code: a replayed call may name their
        # types and functions (a dataclass of arguments, a mask function), and nothing outside them.
        allow_call_packages(*{c.__module__.split(".")[0] for layer in (*self.layers, boundary_owner, *owners)
                              if layer is not None for m in layer.modules() for c in type(m).__mro__
                              if c.__module__ not in ("builtins", "abc")}, *config.call_packages)
        self.recipes = RecipeRunner(
            self.layers, self.names, self.captures, config, n_hidden, boundary_owner, owners, dict(rng_providers or {}),
            compare_param_state=compare_param_state, compare_param_grads=compare_param_grads,
            compare_extra_state=compare_extra_state, gather_layer=gather_layer, gather_bytes=gather_bytes,
            peer_ranks=tuple(self.peers))
        self.protocol = CheckProtocol(
            self.groups, self.recipes, self.rank, self.health, reporter, self.hosts, replay_context=replay_context,
            replay_pairs_across_groups=replay_pairs_across_groups, replicated_parameters=replicated_parameters)
        self.emergency = EmergencySweep(self.recipes, self.protocol.guard, self.groups, extra=self.extra)
        self._handles: list[Any] = []
        if optimizer is not None and hook_optimizer:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(optimizer.register_step_post_hook(self._post_step))
        self.schedule.arm(1)

    # -- the schedule, as the job and `scout ctl` see it -----------------------------------------------

    @property
    def step(self) -> int:
        """The last boundary's step."""
        return self.schedule.step

    @property
    def paused(self) -> bool:
        """``scout ctl pause``: nothing is due until resume (then :meth:`reschedule`)."""
        return self.schedule.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self.schedule.paused = value

    @property
    def replaying(self) -> bool:
        """True while replay runs the sampled layer (model hooks may use it to stay out of the way)."""
        return self.recipes.replaying

    def reschedule(self) -> None:
        """After a live change of cadence or a pause or resume (``scout ctl``): the next step's captures as now
        due, armed or dropped (a capture left armed through a pause would hold a layer's inputs all along)."""
        self.schedule.rearm()

    def due_next(self) -> tuple[str, ...]:
        """Recipes due at the next boundary (the same on every peer)."""
        return self.schedule.due_next()

    def _pre_step(self, *_: Any) -> None:
        if self.opt is not None:
            self.schedule.opt_due = self.schedule.due(self.step + 1, "optimizer")
            self.opt.before_step(self.schedule.opt_due)

    def _post_step(self, *_: Any) -> None:
        self.boundary()

    # -- the boundary ----------------------------------------------------------------------------

    def boundary(self) -> BoundaryResult:
        """Run whatever is due for the step that just finished (called by the step post-hook).

        What is due follows from the configuration alone, so every rank of the job (every peer
        group, every pipeline stage) agrees on it; a rank without the module of a due recipe (the
        embedding off the first stage) simply has nothing to replay for it.
        """
        self.schedule.step += 1
        step = self.step
        if self.opt_slice is not None:
            self.opt_slice.end_step()  # the step's inner optimizer steps are all done
        result = BoundaryResult(step)
        due = self.schedule.take(step)
        result.recipes = due.recipes
        if result.recipes:
            try:
                with self.protocol.framework_paused(step):
                    self._check(result, due)
            finally:
                if self.opt_slice is not None:
                    self.opt_slice.pending = self.opt_slice.chosen = None
                where = self.protocol.finish()
            if result.skipped == DIAGNOSIS_ERROR:
                self.health.failed(step, where, result.recipes)
            elif not result.skipped:
                self.health.checked()
            self.history.append(result)  # steps with nothing due keep no record: a long run must not grow
        self.schedule.arm(step + 1)
        return result

    def _check(self, result: BoundaryResult, due: DueCheck) -> None:
        """One check, step by step as paper section 6.1 runs it; a skip agreed by every rank ends it early."""
        protocol, trust = self.protocol, self.trust
        # What is due: this check's source and whether it vets determinism (replays twice).
        result.source = src = self.peers[self.schedule.source(due.check)]
        vet = trust.vet_due(due.check, self.cfg.determinism_every, self.n_hidden)
        # Agree to go on: the source's call metadata, every collective's memory reserved, and whether this check
        # times the scratch all-reduce (replay.comm_timing_every).
        failed_before = self.opt.take_error() if self.opt is not None else None
        ask = self.timing.all_reduce_due(due.check, self.cfg.comm_timing_every, self.n_hidden)
        inputs = protocol.agree_inputs(result, due.layers, src, failed_before, time_all_reduce=ask)
        if inputs is None:
            return
        calls, scratch = inputs
        # Broadcast the source's inputs, output gradients and RNG states.
        protocol.broadcast(calls, due.layers, src)
        # Replay each due recipe and sign its surfaces.
        replayed = self.recipes.replay_due(due.layers, calls, scratch, protocol.guard, vet=vet, timing=self.timing,
                                           group=self.groups.peer, peers=self.peers, saved=self.emergency.calls)
        if due.layers:
            replayed.evidence += trust.vetting_surfaces(vet=vet, reproducible=replayed.reproducible,
                                                        device=device_of(self.layers[0]))
        if due.optimizer and self.opt is not None:
            replayed.evidence += self.opt.replay(protocol.guard, rank=self.rank, src=src,
                                                 host_group=self.groups.peer_control)
        # Exchange signatures and times; compare by strict majority (exact C3) and statistically.
        exchanged = protocol.exchange(result, replayed, timed=due.timed, rule=self.rule,
                                      expects_evidence=bool(due.layers) or (due.optimizer and self.opt is not None))
        if exchanged is None:
            return
        surfaces, timing = exchanged
        # Set aside what is no evidence: nondeterministic or foreign ranks, a misconfigured self-check.
        if protocol.share_nondeterminism(trust.sort_out(result, surfaces)):
            trust.vet_always = True  # from now on every check replays twice
        if due.timed and not protocol.replica_exchange(result, due.layers, replayed.evidence, trust.untrusted):
            return
        trust.self_check(result)
        # Judge timing, then emit the verdicts.
        if timing is not None:
            self.judge.judge(result, *timing, replayed, self.peers)
        result.incidents = self._verdicts(result)
        # Certification's units: what this check replayed to the end. The optimizer slice counts only where a
        # surface of this rank's own slice was compared (not a slice skipped with its step, not a self-check set
        # aside; the peers' replay of the source's slice is the source's evidence, not this rank's).
        chosen = self.opt_slice.chosen if due.optimizer and self.opt_slice is not None else None
        compared = any(r.surface.startswith("optimizer.") and r.surface != SOURCE_SURFACE for r in result.surfaces)
        result.units = tuple((r, 0 if r != "hidden" else i) for r, i in due.layers) + (
            (("optimizer", chosen),) if chosen is not None and compared else ())

    # -- verdicts -----------------------------------------------------------------------------------

    def _context(self) -> VerdictContext:
        return VerdictContext(rank=self.rank, step=self.step, peers=tuple(self.peers),
                              world_size=dist.get_world_size(), hosts=self.hosts, all_peers=self.groups.all_peers,
                              replica_ranks=self.groups.replica_ranks)

    def _verdicts(self, result: BoundaryResult) -> list[Incident]:
        """Write the check's records (each by the one rank the verdicts name); this peer group's are returned."""
        new_untrusted, misconfigured = self.trust.unreported(result)
        records = check_verdicts(self._context(), result, untrusted=self.trust.untrusted,
                                 new_untrusted=new_untrusted, misconfigured=misconfigured,
                                 timing=self.judge.findings(result))
        for rec in records:
            if rec.job_wide:
                result.incidents_global.extend(rec.incidents)
            if self.rank == rec.writer:
                self._emit(rec.incidents)
        return records[-1].incidents

    def _emit(self, incidents: Sequence[Incident]) -> None:
        if self.reporter is not None:
            for inc in incidents:
                self.reporter.emit(inc)

    # -- restart: saved calls and the emergency sweep ----------------------------------------------

    def sweep_state(self) -> dict[str, Any]:
        """Counters and the newest replayed call per recipe, stored in every snapshot (weights-only safe)."""
        return {"step": self.step, "checks": self.schedule.checks, **self.trust.state(),
                "calls": self.emergency.saved_calls()}

    def continue_at(self, step: int) -> None:
        """The framework restored its own checkpoint of ``step``: the next boundary is ``step + 1`` (the same
        on every rank), and nothing captured for another step is replayed."""
        self.schedule.continue_at(step)

    def load_sweep_state(self, saved: Mapping[str, Any]) -> None:
        """Continue from a restored snapshot: same schedule, same rotation, its calls for a sweep."""
        self.schedule.continue_at(int(saved["step"]), int(saved["checks"]))
        self.trust.load(saved)
        self.emergency.load_calls(saved.get("calls", {}))

    def sweep(self) -> str:
        """Emergency sweep (paper section 8) of every layer on the newest saved calls: ``"clean"``, ``"dirty"``
        or ``"failed"`` (see :meth:`~scout_core.replay.sweep.EmergencySweep.run`). Every rank must call it."""
        return self.emergency.run(self._context(), self.trust, self._emit)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for c in self.captures:
            c.remove()

