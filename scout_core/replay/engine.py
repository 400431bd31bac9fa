"""In-situ replay at the optimizer boundary (paper section 6.1 and Algorithm 2).

On a due step the engine, right after the real optimizer step:

1. picks this check's source peer (rotating, so one faulty source cannot
   poison every check) and broadcasts the source's captured layer call (any
   structure of arguments), the gradients that reached its outputs and its
   RNG states to the peer group;
2. checks with exact C3 that every peer received identical inputs and RNG;
3. replays the sampled layer's forward and backward (``torch.autograd.grad``
   on cloned inputs, never touching ``.grad``) under the source's RNG and
   deterministic kernels, once per input variant ({0.1x, x, 10x});
4. replays the optimizer on a cloned rotating slice (see
   :mod:`scout_core.replay.optimizer`);
5. signs every surface (outputs, input gradients, parameter gradients,
   parameter state, optimizer update) and compares all of them in ONE
   exchange, each with its own bitmap; compute time is compared with
   statistical C3 and a straggler is confirmed over consecutive rounds.

Every verdict becomes an incident record. Training numerics are untouched:
replay restores the RNG streams and computes gradients functionally. Local
work runs in stages guarded by :class:`~scout_core.replay.guard.DiagnosisGuard`:
a failure on any peer makes every peer skip the check together.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scout_core.config import ReplayConfig
from scout_core.consensus import (
    C3Result,
    C3Status,
    Confirmation,
    NoiseFloor,
    StatisticalRule,
    c3_exchange,
    group_disagreements,
)
from scout_core.groups import ScoutGroups, local_groups
from scout_core.replay.capture import LayerCapture
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.health import RecipeHealth
from scout_core.replay.layer import (
    LayerReplay,
    ShippedCall,
    broadcast_call,
    call_meta,
    device_of,
    gather_ranks,
    materialize,
    receive_buffers,
    release_of,
    replay_layer,
)
from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.rng import RngProvider
from scout_core.replay.saved import call_from_dict, call_to_dict, to_device
from scout_core.replay.scratch import Scratch, fsdp_module, module_compute_device, reserve, unshard_bytes
from scout_core.replay.timing import CommTiming, mesh_groups, time_hsdp_collectives
from scout_core.replay.vetting import (
    ENVIRONMENT_SURFACE,
    REPRODUCIBLE_SURFACE,
    SELF_CHECK_SURFACE,
    environment_fingerprint,
    optimizer_misconfigured,
    rotation,
    set_aside,
    split_vetting,
    vet_due,
)
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter
from scout_core.signature import sign_many

__all__ = ["BoundaryResult", "ReplayEngine"]



REPLICATED_STATE = ".replicated_state"
"""The replica exchange's surface of the sampled layer's copied (not sharded) parameters."""
REPLICA_UNTRUSTED = "replica.untrusted"
"""The replica exchange's list of each member's ranks that are not evidence (nondeterministic, foreign)."""


def _strict_majority(values: Sequence[Any]) -> Any:
    """The value more than half of ``values`` hold, or None."""
    for v in values:
        if sum(1 for w in values if w == v) * 2 > len(values):
            return v
    return None


@dataclass
class BoundaryResult:
    step: int
    surfaces: list[C3Result] = field(default_factory=list)
    timing: C3Result | None = None
    comm_timing: C3Result | None = None
    timing_world: bool = False
    """``timing`` compares every rank of the job (HSDP, where all peer groups replayed the same work), not
    only this peer group: its straggler verdicts are job-wide and recorded once."""
    stragglers: tuple[int, ...] = ()
    noise_floor: float | None = None
    """The compute noise floor in force in a flagged round (``consensus.NoiseFloor``; inf in its warm-up)."""
    group_slowdown: bool = False
    """The whole group's communication is slow against its own clean history (no outlier rank)."""
    localization: Any = None
    """HSDP: cross-group intersection of slow shard and replica groups (``topology.Localization``)."""
    incidents_global: list[Incident] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    replica_surfaces: list[C3Result] = field(default_factory=list)
    """The hidden layer's outputs compared across the replica group (tensor-parallel partners), when the
    adapter declares one: they name a rank where its own peer group has no strict majority."""
    source: int | None = None
    recipes: tuple[str, ...] = ()
    """Recipes that were due at this boundary (``embedding``, ``hidden``, ``output``, ``optimizer``)."""
    skipped: str = ""
    """Why due work was skipped on every peer (a diagnosis error, a sampled layer that did not run)."""
    untrusted: dict[int, str] = field(default_factory=dict)
    """Ranks this check found not to be evidence, with the reason (``nondeterministic``: its two runs
    differed; ``environment``: not its peers' majority software and hardware)."""
    unreliable: list[C3Result] = field(default_factory=list)
    """Results set aside because a non-reproducible rank took part in the disagreement."""
    misconfigured: C3Result | None = None
    """The optimizer self-check, when a strict majority of peers failed it (set aside, reported once)."""

    @property
    def checked(self) -> bool:
        """Something was due at this boundary (a certification boundary)."""
        return bool(self.recipes)

    @property
    def sdc(self) -> bool:
        return any(r.status is C3Status.ATTRIBUTED for r in self.surfaces)

    @property
    def inconclusive(self) -> bool:
        return bool(self.unreliable) or any(r.status is C3Status.INCONCLUSIVE for r in self.surfaces)

    @property
    def missing(self) -> bool:
        """Due work produced no evidence (skipped), so nothing can be certified at this boundary."""
        return self.checked and (bool(self.skipped) or not self.surfaces)


class ReplayEngine:
    """Replays one sampled layer (rotating) and an optimizer slice on due steps."""

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None,
        *,
        config: ReplayConfig,
        group: Any = None,
        groups: ScoutGroups | None = None,
        rule: StatisticalRule | None = None,
        comm_rule: StatisticalRule | None = None,
        confirm_rounds: int = 2,
        noise_window: int = 64,
        reporter: Reporter | None = None,
        hosts: Mapping[int, str] | None = None,
        compare_param_state: bool = True,
        compare_optimizer_slices: bool | None = None,
        rng_providers: Mapping[str, RngProvider] | None = None,
        layer_names: Sequence[str] | None = None,
        embedding: torch.nn.Module | None = None,
        output: torch.nn.Module | None = None,
        boundary_owner: torch.nn.Module | None = None,
        layer_owners: Sequence[torch.nn.Module | None] | None = None,
        hook_optimizer: bool = True,
        local_only_params: Sequence[torch.Tensor] = (),
        replicated_parameters: Callable[[torch.nn.Module], list[torch.Tensor]] | None = None,
        compare_param_grads: bool = True,
        compare_extra_state: bool = True,
        replay_context: Callable[[], AbstractContextManager[Any]] | None = None,
        replay_pairs_across_groups: bool = False,
        gather_layer: Callable[[torch.nn.Module], tuple[Any, Callable[[], None]]] | None = None,
        gather_bytes: Callable[[torch.nn.Module], int] | None = None,
    ) -> None:
        if not layers:
            raise ValueError("replay needs at least one repeated layer")
        self.layers = list(layers)
        self.names = list(layer_names) if layer_names else [f"layers.{i}" for i in range(len(self.layers))]
        self.cfg = config
        self.groups = groups if groups is not None else local_groups(group)
        self.group = self.groups.peer
        self.ctrl = self.groups.peer_control
        self.peers = self.groups.peer_ranks
        self.rank = dist.get_rank()
        self.rule = rule or StatisticalRule()
        self.paused = False  # scout ctl pause: nothing is due until resume
        self.confirm = Confirmation(rounds=confirm_rounds)
        # A compute straggler must also stray further than healthy ranks lately did (a host clock's heavy
        # tail would otherwise confirm healthy ranks now and then): one noise floor per kind of work.
        self.noise_window = noise_window
        self.noise: dict[Any, NoiseFloor] = {}
        self.reporter = reporter
        self.hosts = dict(hosts or {})
        # Skips are agreed job-wide: replay has cross-group collectives (HSDP timing, the machine intersection).
        self.guard = DiagnosisGuard(self.groups.world_control, rank=self.rank, reporter=reporter, hosts=self.hosts)
        self.compare_param_state = compare_param_state
        # Pure FSDP owns each update uniquely: only the self-check is comparable across peers.
        self.compare_optimizer_slices = (_peers_hold_equal_shards(optimizer, self.peers, self.rank)
                                         if compare_optimizer_slices is None else compare_optimizer_slices)
        self.rng_providers = dict(rng_providers or {})
        # Embedding and output (LM head) recipes ride behind the repeated layers, each on its own
        # cadence; under FSDP2 their parameters belong to an outer FSDP module (boundary_owner).
        self.n_hidden = len(self.layers)
        self.extra: dict[str, int] = {}
        for recipe, module in (("embedding", embedding), ("output", output)):
            if module is not None:
                self.extra[recipe] = len(self.layers)
                self.layers.append(module)
                self.names.append(recipe)
        self.owner = boundary_owner
        # A repeated layer inside an FSDP2 block it is not itself (a block's attention) unshards through it.
        self.layer_owners = list(layer_owners) if layer_owners is not None else [None] * self.n_hidden
        # The parameters of a layer that replica-group members hold as copies, not shards (see _replica_verdicts).
        self.replicated_parameters = replicated_parameters
        self.compare_param_grads = compare_param_grads
        self.compare_extra_state = compare_extra_state
        # Entered around each check: what the framework must switch off while SCOUT calls its layers outside
        # training (Megatron's parameter all-gather pre-hooks).
        self.replay_context = replay_context
        self.replay_pairs_across_groups = replay_pairs_across_groups
        # A framework's own gather of a layer sharded at rest outside FSDP2 (DeepSpeed ZeRO-3), or None.
        self.gather_layer = gather_layer
        self.gather_bytes = gather_bytes
        if len(self.layer_owners) != self.n_hidden:
            raise ValueError(f"layer_owners has {len(self.layer_owners)} entries for {self.n_hidden} layers")
        self.captures = [LayerCapture(layer) for layer in self.layers]
        self.optimizer = optimizer
        self.opt_slice = (OptimizerSlice(optimizer, config.optimizer_slice_elems, local_only=local_only_params)
                          if optimizer is not None else None)
        self.step = 0
        self.checks = 0
        self.replaying = False
        """True while replay runs the sampled layer (model hooks may use it to stay out of the way)."""
        self.last_calls: dict[str, tuple[ShippedCall, int]] = {}
        """The newest replayed call per recipe (identical on every peer): the emergency sweep's inputs."""
        self.history: deque[BoundaryResult] = deque(maxlen=1024)  # boundaries that did work, newest last
        # Communication is judged with its own ratio floor (a shared fabric is noisier than a device's compute).
        self.timing = CommTiming(comm_rule or self.rule, confirm_rounds, world_control=self.groups.world_control,
                                 hosts=self.hosts, compute_rule=self.rule, window=noise_window)
        self._hsdp_comm: tuple[float, float, Any, Any] | None = None
        recipe_of_layer = {name: ("hidden" if i < self.n_hidden else next(r for r, j in self.extra.items() if j == i))
                           for i, name in enumerate(self.names)}
        self.health = RecipeHealth(rank=self.rank, world_control=self.groups.world_control,
                                   recipe_of_layer=recipe_of_layer, emit=self._emit)
        self._opt_due = False
        self._vet_always = False
        self._misconfigured_reported = False
        self._self_check_off = False
        self._untrusted: dict[int, str] = {}
        """Ranks found not to be evidence (nondeterministic, or another environment), for the whole run."""
        self._untrusted_reported: set[tuple[int, str]] = set()
        self._env: str | None = None
        self._opt_error: BaseException | None = None
        self._handles: list[Any] = []
        if optimizer is not None and hook_optimizer:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(optimizer.register_step_post_hook(self._post_step))
        self._arm(1)

    # -- scheduling ------------------------------------------------------------------------------

    def _cadence(self, recipe: str) -> int:
        """The recipe's configured cadence, 0 once it was switched off after repeated failures."""
        return 0 if recipe in self.health.disabled else getattr(self.cfg.cadence, recipe)

    def _due(self, step: int, cadence: int) -> bool:
        return self.cfg.enabled and not self.paused and cadence > 0 and step % cadence == 0

    def reschedule(self) -> None:
        """After a live change of cadence or a pause or resume (``scout ctl``): the next step's captures as now
        due, armed or dropped (a capture left armed through a pause would hold a layer's inputs all along)."""
        for capture in self.captures:
            capture.take()
        self._arm(self.step + 1)

    def _layer_index(self) -> int:
        return rotation(self.checks, self.n_hidden, len(self.peers))[0]

    def _arm(self, step: int) -> None:
        if self._due(step, self._cadence("hidden")):
            self.captures[self._layer_index()].arm()
        for recipe, idx in self.extra.items():
            if self._due(step, self._cadence(recipe)):
                self.captures[idx].arm()

    def due_next(self) -> tuple[str, ...]:
        """Recipes due at the next boundary (the same on every peer)."""
        step = self.step + 1
        due = tuple(r for r in self.extra if self._due(step, self._cadence(r)))
        due += ("hidden",) if self._due(step, self._cadence("hidden")) else ()
        return due + (("optimizer",) if self._opt_due else ())

    def _pre_step(self, *_: Any) -> None:
        if self.opt_slice is None:
            return
        self._opt_due = self._due(self.step + 1, self._cadence("optimizer"))
        if not self.opt_slice.inner_step() or not self._opt_due:
            return
        try:
            self.opt_slice.before_step()
        except Exception as exc:  # noqa: BLE001 - reported at the boundary, where every peer agrees to skip
            self.opt_slice.pending, self._opt_error = None, exc

    def _post_step(self, *_: Any) -> None:
        self.boundary()

    # -- the boundary ----------------------------------------------------------------------------

    def boundary(self) -> BoundaryResult:
        """Run whatever is due for the step that just finished (called by the step post-hook).

        What is due follows from the configuration alone, so every rank of the job (every peer
        group, every pipeline stage) agrees on it; a rank without the module of a due recipe (the
        embedding off the first stage) simply has nothing to replay for it.
        """
        self.step += 1
        step = self.step
        if self.opt_slice is not None:
            self.opt_slice.end_step()  # the step's inner optimizer steps are all done
        result = BoundaryResult(step)
        recipes = [r for r in ("embedding", "output") if self._due(step, self._cadence(r))]
        due = [(r, self.extra[r]) for r in recipes if r in self.extra]
        if self._due(step, self._cadence("hidden")):
            recipes.append("hidden")
            due.append(("hidden", self._layer_index()))
            self.checks += 1  # every peer rotates together, whatever happens to this check
        opt_due = self._due(step, self._cadence("optimizer"))
        self._opt_due = False
        result.recipes = tuple(recipes) + (("optimizer",) if opt_due else ())
        if result.recipes:
            try:
                with self._framework_paused():
                    self._check(result, due, opt_due)
            finally:
                if self.opt_slice is not None:
                    self.opt_slice.pending = None
                where = self.guard.failure.where if self.guard.failure is not None else None
                self.guard.reset()
            if result.skipped == "diagnosis error":
                self.health.failed(step, where, result.recipes)
            elif not result.skipped:
                self.health.checked()
            self.history.append(result)  # steps with nothing due keep no record: a long run must not grow
        self._arm(step + 1)
        return result

    @contextlib.contextmanager
    def _framework_paused(self) -> Iterator[None]:
        """The adapter's replay context around a check; a failure to enter it skips the check on every rank
        (the guard's next agreement), a failure to leave it is reported, never raised into training."""
        if self.replay_context is None:
            yield
            return
        ctx = None
        try:
            ctx = self.replay_context()
            ctx.__enter__()
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            self.guard.fail(exc, "entering the framework's replay context")
            ctx = None
        try:
            yield
        finally:
            if ctx is not None:
                try:
                    ctx.__exit__(None, None, None)
                except Exception as exc:  # noqa: BLE001
                    self.guard.report(self.step, "replay", exc, "leaving the framework's replay context")

    def _check(self, result: BoundaryResult, due: list[tuple[str, int]], opt_due: bool) -> None:
        guard, step = self.guard, result.step
        self._hsdp_comm = None  # measured afresh by this check's hidden recipe, never carried over
        check = self.checks - (1 if any(r == "hidden" for r, _ in due) else 0)  # this check's number
        src = self.peers[rotation(check, self.n_hidden, len(self.peers))[1]]
        vet = vet_due(check, self.cfg.determinism_every, self._vet_always, self.n_hidden)
        result.source = src
        if self._opt_error is not None:
            guard.fail(self._opt_error, "optimizer slice capture")
            self._opt_error = None
        captured = guard.run("capture", lambda: {idx: self.captures[idx].take() for _, idx in due}) or {}
        payload = None
        if self.rank == src:  # pickled here, so an unpicklable argument is a local failure, not a hang
            payload = guard.run("call metadata", lambda: pickle.dumps(
                {idx: None if captured.get(idx) is None else call_meta(captured[idx], self.rng_providers)
                 for _, idx in due}))
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return
        box = [payload]
        dist.broadcast_object_list(box, src=src, group=self.ctrl)
        metas = guard.run("call metadata", lambda: pickle.loads(box[0])) or {}
        not_run = [self.names[idx] for _, idx in due if metas.get(idx) is None] if guard.ok else []
        calls: dict[int, ShippedCall] = {}

        def buffers() -> None:
            for _, idx in due:
                if metas.get(idx) is not None:
                    calls[idx] = receive_buffers(metas[idx], captured.get(idx), device_of(self.layers[idx]),
                                                 self.rank == src)

        guard.run("receive buffers", buffers)
        # Everything the collectives below allocate, allocated now: an out-of-memory error inside a
        # collective would hang the peers; here it is a failure every rank agrees on next.
        scratch: dict[int, Scratch] = {}
        # One unshard probe for the check, the largest recipe's (they unshard one after another), held by
        # the first recipe to unshard; each recipe's reservation is its own stage, so a recipe that never
        # fits is the one switched off (replay.health).
        needs = {idx: self._unshard_bytes(idx) for _, idx in due if idx in calls}
        probe_at = next((idx for idx, n in needs.items() if n), None)  # the first recipe to unshard
        for recipe, idx in due:
            if idx in calls:
                headroom = max(needs.values()) if idx == probe_at else 0
                guard.run(f"scratch memory of {self.names[idx]}", lambda recipe=recipe, idx=idx, h=headroom:
                          scratch.__setitem__(idx, self._reserve(idx, timed=recipe == "hidden", headroom=h)))
        status = guard.agree_status(step, skip=bool(not_run))
        if status != "ok":
            # A sampled layer that did not run on a source (conditional layers, MoE) skips the check
            # everywhere: other peer groups' replays would otherwise meet this group in cross-group timing.
            result.skipped = "diagnosis error" if status == "error" else (
                f"sampled layer(s) {', '.join(not_run) or 'of another peer group'} did not run on the source")
            if status == "skip":
                self.health.skipped(step, result.skipped)
            return
        for _, idx in due:
            broadcast_call(calls[idx], src, self.group, self.ctrl)
        evidence: list[tuple[str, Any]] = []
        # None: not measured on this rank this round (the replay failed, or nothing was timed): "no
        # measurement" for every peer, which neither confirms a straggler nor clears one, nor moves a baseline.
        compute_s: float | None = None
        comm_s: float | None = None
        work: Any = None
        comm_ranks: tuple[int, ...] = ()  # the ranks of the collective that comm_s timed
        reproducible: bool | None = True
        for recipe, idx in due:
            timed = recipe == "hidden"  # the hidden layer's timings are the ones compared
            surfaces, t_compute, gather_s, same = self._replay_recipe(idx, calls[idx], scratch[idx], timed=timed,
                                                                       vet=vet)
            evidence += surfaces
            reproducible = None if reproducible is None or same is None else reproducible and same
            if timed:
                compute_s = t_compute
                # What makes compute times comparable beyond the peer group: the same layer (its place, class
                # and parameters) on the same input shapes.
                layer = self.layers[idx]
                work = (self.names[idx], type(layer).__qualname__,
                        tuple((tuple(p.shape), str(p.dtype)) for p in layer.parameters()),
                        tuple(tuple(t.shape) for t in calls[idx].tensors))
                all_reduce = scratch[idx].all_reduce
                if gather_s is None and all_reduce is not None:
                    gather_s = self.timing.scratch_all_reduce(self.layers[idx], self.group, all_reduce)
                    comm_ranks = tuple(self.peers)
                elif gather_s is not None:  # the unshard's all-gather, over the FSDP shard group
                    comm_ranks = gather_ranks(self.layers[idx], self._owner(idx))
                comm_s = gather_s
            # One saved call per layer class: the sweep replays each class's layers on an input of their own.
            # (The vetting surfaces follow the loop: every peer sends them, None where a replay failed.)
            key = f"hidden:{type(self.layers[idx]).__qualname__}" if recipe == "hidden" else recipe
            self.last_calls[key] = (calls[idx], idx)
        if due:
            if vet:
                evidence.append((REPRODUCIBLE_SURFACE, reproducible))
            evidence.append((ENVIRONMENT_SURFACE, self._environment()))
        if opt_due and self.opt_slice is not None:
            replayed = guard.run("optimizer replay", self.opt_slice.after_step) or []
            evidence += [(n, v) for n, v in replayed if self.compare_optimizer_slices or n == "optimizer.self_check"]
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return
        timed = any(r == "hidden" for r, _ in due)  # timing evidence comes from the hidden-layer recipe only

        def exchange() -> tuple[list[C3Result], list[C3Result] | None]:
            # A peer that sent other surfaces makes the exchange raise on every peer alike.
            surfaces = c3_exchange([v for _, v in evidence], group=self.ctrl, surfaces=[n for n, _ in evidence])
            times = c3_exchange([compute_s, comm_s], group=self.ctrl, surfaces=["replay.compute_s", "replay.comm_s"],
                                rule=self.rule) if timed else None
            return surfaces, times

        # A pipeline stage without the due module has no evidence, but still agrees with the others.
        exchanged = guard.run("evidence exchange", exchange) if evidence else ([], None)
        if not guard.agree(step) or exchanged is None:
            result.skipped = "diagnosis error"
            return
        surfaces, timing = exchanged
        result.surfaces, found = split_vetting(surfaces)
        nondeterministic = any(reason == "nondeterministic" for reason in found.values())
        if self.replay_pairs_across_groups and len(self.groups.all_peers) > 1:
            # Every peer group replays as often as every other: tensor- or context-parallel partners sit in other
            # groups and pair their collectives with this one's in replay (a second run on one side only would
            # leave the other waiting). All ranks are here: the agreement above passed. (Elsewhere a group's
            # second run is local compute, and only the group that needs it pays for it.)
            flag = torch.tensor([int(nondeterministic)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.world_control)
            nondeterministic = bool(flag.item())
        if nondeterministic:
            self._vet_always = True  # from now on every check replays twice
        result.untrusted = found
        self._set_aside(result)
        if timed and self.groups.replica_control is not None:
            # After the job-wide agreement above (a peer group that failed its own exchange must not leave its
            # replica partners waiting in this one) and after this check's vetting (a rank its own group just
            # found nondeterministic is no evidence for the replica group either).
            hidden_idx = next(idx for r, idx in due if r == "hidden")
            hidden = self.names[hidden_idx]
            replicated = [(n, v) for n, v in evidence if n.startswith(f"{hidden}.x") and n.endswith(".output")]
            copy_error: list[BaseException] = []
            if replicated and self.replicated_parameters is not None:
                try:
                    params = [p.detach() for p in self.replicated_parameters(self.layers[hidden_idx])]
                    copies: Any = tuple((s.signature, s.nonfinite) for s in sign_many(params))
                except Exception as exc:  # noqa: BLE001 - still exchanged (every member joins), as "unavailable"
                    copy_error.append(exc)
                    copies = ("unavailable", self.rank)  # differs from every other member's: no replica verdict
                replicated.append((f"{hidden}{REPLICATED_STATE}", copies))
            if replicated:  # every member's ranks that are not evidence: the verdict must be the same on all
                replicated.append((REPLICA_UNTRUSTED, tuple(sorted(self._untrusted))))
            result.replica_surfaces = guard.run("replica exchange", lambda: c3_exchange(
                [v for _, v in replicated], group=self.groups.replica_control,
                surfaces=[n for n, _ in replicated])) or []
            if copy_error:
                guard.fail(copy_error[0], "replicated parameters")
            if not guard.agree(step):
                result.skipped = "diagnosis error"
                return
        misconfigured = optimizer_misconfigured(result.surfaces)
        if misconfigured is not None:  # not agreement, and not SDC on the minority that passed
            self._self_check_off = True
            result.misconfigured = misconfigured
        if self._self_check_off:  # once most peers failed it, it is no evidence for anyone, ever after
            result.surfaces = [r for r in result.surfaces if r.surface != SELF_CHECK_SURFACE]
        if timing is not None:
            times, comm = timing
            # Communication time is a property of a synchronizing group, not of one member (paper
            # Figure 2c): it is never attributed to a rank. It feeds the group's temporal check and,
            # where a rank sits in groups of two dimensions (HSDP), the cross-group intersection.
            if self._hsdp_comm is not None:
                # HSDP: compute is judged job-wide in every round (a round whose ranks replayed different
                # work is "no measurement" for all), so every rank keeps the same confirmation counts.
                result.localization, times = self.timing.cross_group(*self._hsdp_comm, work=(work, compute_s))
                result.timing_world = True
            # One floor per layer class and parameter shapes: the rotation's layers of one class are one
            # work, and input shapes may change every step (ratios to the median cancel their size).
            floor = self.noise.setdefault(work[1:3] if work else None, NoiseFloor(self.noise_window))
            times, result.noise_floor = floor.apply(times)
            result.timing, result.comm_timing = times, comm
            # Counted per kind of work too: checks that alternate kinds (an MoE block's attention and router)
            # must not reset the streak of a rank slow in only one of them.
            result.stragglers = self.confirm.update(times, kind=work[1:3] if work else None)
            # The temporal check judges a collective that spans exactly the peer group. Under HSDP the
            # timed unshard spans the shard group, not the peers (a replica group): its slowness is the
            # cross-group intersection's to place, never this group's.
            if comm_ranks == tuple(self.peers):
                result.group_slowdown = self.timing.group_slowdown(comm)
        # Every check's SDC evidence becomes records, also one without the hidden recipe (an embedding
        # or LM-head check on its own cadence).
        result.incidents = self._verdicts(result)

    def _owner(self, idx: int) -> torch.nn.Module | None:
        """The FSDP module that unshards layer ``idx`` when it is not one itself: the outer module of a
        boundary module (embedding, head), the enclosing block of a repeated layer's part."""
        return self.owner if idx >= self.n_hidden else self.layer_owners[idx]

    def _unshard_bytes(self, idx: int) -> int:
        layer, owner = self.layers[idx], self._owner(idx)
        if self.gather_bytes is not None and not fsdp_module(layer) and not fsdp_module(owner):
            # The framework's own gather (DeepSpeed ZeRO-3); a failure to size it skips the check everywhere.
            return self.guard.run(f"gather size of {self.names[idx]}", lambda: self.gather_bytes(layer)) or 0
        return unshard_bytes(layer, owner)

    def _reserve(self, idx: int, *, timed: bool, headroom: int) -> Scratch:
        """The memory replaying layer ``idx`` needs in its collectives (timed: the hidden recipe's)."""
        layer = self.layers[idx]
        owner = self._owner(idx)  # an unshard, of the layer or its owner, is the timed collective then
        return reserve(layer, owner, time_all_reduce=timed and not fsdp_module(layer) and not fsdp_module(owner),
                       hsdp_groups=mesh_groups(layer) if timed else None, headroom_bytes=headroom)

    def _replay_recipe(self, idx: int, call: ShippedCall, scratch: Scratch, *, timed: bool, vet: bool = False
                       ) -> tuple[list[tuple[str, Any]], float | None, float | None, bool | None]:
        """Materialize the layer (its collectives use memory reserved in ``scratch``), replay it, reshard."""
        layer, name = self.layers[idx], self.names[idx]
        surfaces: list[tuple[str, Any]] = []
        if mesh_groups(layer) is not None:
            # HSDP: replicas hold the same shard, so compare the local shards BEFORE unsharding (a
            # corrupted shard would otherwise reach its whole shard group through the all-gather).
            # Pure FSDP has no owner copy to compare a shard against.
            def local_shard() -> None:
                signed = sign_many([torch.cat([p.to_local().reshape(-1) for p in layer.parameters()])])[0]
                surfaces.append((f"{name}.local_shard", (signed.signature, signed.nonfinite)))

            self.guard.run(f"local shard signature of {name}", local_shard)
            if timed and scratch.hsdp is not None:  # the hidden recipe's timings are compared across groups
                self._hsdp_comm = time_hsdp_collectives(layer, scratch.hsdp)
        owner = self._owner(idx)
        # Always run (its all-gather is a collective every peer joins), but a local failure (out of memory
        # copying the parameters out after the gather) is kept for the agreement, not raised into training.
        materialized = self.guard.attempt(f"unshard of {name}",
                                          lambda: materialize(layer, owner, scratch, self.gather_layer))
        forward, gather_s, release = materialized or (None, None, release_of(layer, owner))
        done: list[LayerReplay] = []

        def replay() -> None:
            self.captures[idx].suspended, self.replaying = True, True
            try:
                done.append(replay_layer(
                    forward, layer, name, call, variants=self.cfg.input_variants, providers=self.rng_providers,
                    deterministic=self.cfg.deterministic, compare_param_state=self.compare_param_state, vet=vet,
                    param_grads=self.compare_param_grads, compare_extra_state=self.compare_extra_state))
            finally:
                self.captures[idx].suspended, self.replaying = False, False
            surfaces.extend(done[0].surfaces)

        try:
            self.guard.run(f"replay of {name}", replay)
        finally:
            if release is not None:
                self.guard.attempt(f"reshard of {name}", release)
        if not done:
            return surfaces, None, gather_s, None
        return surfaces, done[0].compute_s, gather_s, done[0].reproducible

    # -- restart: saved calls and the emergency sweep ----------------------------------------------

    def sweep_state(self) -> dict[str, Any]:
        """Counters and the newest replayed call per recipe, stored in every snapshot (weights-only safe)."""
        return {"step": self.step, "checks": self.checks, "vet_always": self._vet_always,
                "self_check_off": self._self_check_off,
                "untrusted": {str(r): why for r, why in self._untrusted.items()},
                "calls": {recipe: call_to_dict(call, idx) for recipe, (call, idx) in self.last_calls.items()}}

    def continue_at(self, step: int) -> None:
        """The framework restored its own checkpoint of ``step``: the next boundary is ``step + 1`` (the same
        on every rank), and nothing captured for another step is replayed."""
        for c in self.captures:
            c.take()
        self.step = int(step)
        self._arm(self.step + 1)

    def load_sweep_state(self, saved: Mapping[str, Any]) -> None:
        """Continue from a restored snapshot: same schedule, same rotation, its calls for a sweep."""
        for c in self.captures:
            c.take()
        self.step, self.checks = int(saved["step"]), int(saved["checks"])
        self._vet_always = bool(saved.get("vet_always", False))
        self._self_check_off = bool(saved.get("self_check_off", False))
        self._untrusted = {int(r): str(why) for r, why in saved.get("untrusted", {}).items()}
        self._untrusted_reported = {(r, why) for r, why in self._untrusted.items()}
        self.last_calls = {r: call_from_dict(d) for r, d in saved.get("calls", {}).items()}
        self._arm(self.step + 1)

    def sweep(self) -> str:
        """Emergency sweep (paper section 8): replay EVERY layer on the newest saved calls and compare with
        exact C3 across peers. Every rank of the job must call it. Returns ``"clean"``, ``"dirty"`` (SDC
        found and recorded) or ``"failed"`` (nothing saved to replay, or a local failure on some rank: the
        latest state is not proven clean, and no SDC is claimed)."""
        work: list[tuple[int, ShippedCall]] = []
        for recipe, (call, idx) in sorted(self.last_calls.items()):
            if recipe.startswith("hidden"):
                kind = type(self.layers[idx])
                work += [(i, call) for i in range(self.n_hidden) if type(self.layers[i]) is kind]
            elif recipe in self.extra:
                work.append((self.extra[recipe], call))
        # Every rank takes part in the same number of agreements: pipeline stages hold different numbers
        # of layers (the embedding on the first stage only).
        rounds = torch.tensor([len(work)], dtype=torch.int64)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=self.groups.world_control)
        evidence: list[tuple[str, Any]] = []
        for i in range(int(rounds)):
            item = work[i] if i < len(work) else None
            prepared = None
            if item is not None:
                idx, call = item
                device = module_compute_device(self.layers[idx])
                prepared = self.guard.run(f"sweep inputs of {self.names[idx]}", lambda c=call, d=device, i=idx: (
                    to_device(c, d), self._reserve(i, timed=False, headroom=self._unshard_bytes(i))))
            # One agreement per layer, before its collectives: a local failure (out of memory moving the
            # inputs or reserving the unshard) ends the sweep on every rank together.
            if not self.guard.agree(self.step, "sweep"):
                break
            if item is not None and prepared is not None:
                evidence += self._replay_recipe(item[0], *prepared, timed=False)[0]
        ok = self.guard.agree(self.step, "sweep")
        self.guard.reset()
        if not ok or not work:
            return "failed"
        results = c3_exchange([v for _, v in evidence], group=self.ctrl, surfaces=[n for n, _ in evidence])
        swept = BoundaryResult(self.step, surfaces=results)
        self._set_aside(swept)  # a rank known not to be evidence makes no SDC in a sweep either
        bad = [r for r in swept.surfaces if r.status is not C3Status.AGREE]
        if swept.unreliable and not bad:
            return "failed"  # disagreements set aside prove nothing either way: the latest state is not shown clean
        if bad:
            sweep = BoundaryResult(self.step, surfaces=bad)
            incidents = self._sdc_verdicts(sweep)
            for inc in incidents:
                inc.reason = "emergency sweep of the latest state: " + inc.reason
            self._report(incidents)
        return "dirty" if bad else "clean"

    # -- verdicts -----------------------------------------------------------------------------------

    def _verdicts(self, result: BoundaryResult) -> list[Incident]:
        """SDC records (see :meth:`_sdc_verdicts`) and one record per newly confirmed straggler."""
        incidents = self._sdc_verdicts(result) + self._vetting_verdicts(result)
        timing = result.timing
        if timing is None:  # no timing round in this check
            self._report(incidents)
            return incidents
        for inc in incidents:  # the round's replay time of every peer, for the report's per-rank heatmap
            if inc.kind is IncidentKind.SDC:
                inc.evidence["timing"] = {timing.surface: timing.to_dict()}
        new = tuple(r for r in timing.outlier_ranks if r in self.confirm.newly)
        if new:
            straggler = self._incident(
                IncidentKind.STRAGGLER, IncidentScope.RANK, new, [timing],
                f"replay compute slower than peers in {self.confirm.rounds} consecutive rounds"
                + (f" (beyond this work's noise floor, {result.noise_floor:.2f}x the median)"
                   if result.noise_floor is not None else ""))
            if result.timing_world:  # every peer group saw the same job-wide verdict: one record for the job
                if self.rank == min(r for r in range(dist.get_world_size()) if r not in new):
                    self._emit([straggler])
                result.incidents_global.append(straggler)
            else:
                incidents.append(straggler)
        loc = result.localization
        if loc is not None and self.timing.loc_rounds == self.confirm.rounds:
            machine = self._incident(IncidentKind.STRAGGLER, IncidentScope(loc.scope), loc.ranks, [result.comm_timing],
                                     f"communication: {loc.reason}")
            machine.hosts = list(loc.hosts)
            machine.evidence["slow_groups"] = [[d, list(g)] for d, g in loc.slow_groups]
            if self.rank == self._world_reporter(loc):  # one record for the whole job
                self._emit([machine])
            result.incidents_global.append(machine)
        if result.group_slowdown and self.timing.slow_group_rounds == self.timing.temporal_rounds:
            incidents.append(self._incident(
                IncidentKind.STRAGGLER, IncidentScope.PEER_GROUP, self.peers, [result.comm_timing],
                "the whole group's communication is slow against its own clean history; no member is an "
                "outlier (one group spans every peer): inspect the group's fabric"))
        self._report(incidents)
        return incidents

    def _report(self, incidents: list[Incident]) -> None:
        """The lowest peer not named by a rank-scoped verdict writes the records (group-scoped verdicts
        name everyone, and any member may report those)."""
        named = {r for i in incidents if i.scope is IncidentScope.RANK for r in i.ranks}
        reporter_rank = min((r for r in self.peers if r not in named), default=min(self.peers)) if incidents else None
        if self.rank == reporter_rank:
            self._emit(incidents)

    def _emit(self, incidents: Sequence[Incident]) -> None:
        if self.reporter is not None:
            for inc in incidents:
                self.reporter.emit(inc)

    def _world_reporter(self, loc: Any) -> int:
        return min((r for r in range(dist.get_world_size()) if r not in loc.ranks), default=0)

    def _sdc_verdicts(self, result: BoundaryResult) -> list[Incident]:
        """One SDC record per set of culprit ranks (all its surfaces in the evidence), one group-scoped
        record for surfaces without a majority (unless the replica group named the rank: see
        :meth:`_replica_verdicts`)."""
        incidents = []
        by_ranks, inconclusive = group_disagreements(result.surfaces)
        for ranks, rs in by_ranks.items():
            incidents.append(self._incident(IncidentKind.SDC, IncidentScope.RANK, ranks, rs,
                                            f"{len(rs)} replayed surface(s) differ from the strict majority"))
        resolved = self._replica_verdicts(result)
        inconclusive = [r for r in inconclusive if r.surface not in resolved]
        if inconclusive:
            incidents.append(self._incident(IncidentKind.SDC, IncidentScope.PEER_GROUP, self.peers, inconclusive,
                                            "replayed surfaces disagree without a strict majority"))
        return incidents

    def _replica_verdicts(self, result: BoundaryResult) -> set[str]:
        """Name the ranks the replica group's strict majority sets apart on a hidden layer's output where their
        own peer group has none (two data-parallel replicas under tensor parallelism). Every member of the
        replica group decides alike from the same exchange; its lowest member not named writes the record.
        Returns the surfaces resolved for this rank's own peer group (its no-majority record drops them)."""
        untrusted = set(self._untrusted)
        for res in result.replica_surfaces:
            if res.surface == REPLICA_UNTRUSTED:
                untrusted.update(r for ranks in res.evidence for r in ranks)
        # The replicas' outputs are comparable only while the parameters they hold as copies are the same on
        # all of them: a corrupted step trains those copies apart for good (Megatron keeps tensor-parallel
        # copies equal only by computing the same), and then the replicas disagree without anyone faulty now.
        if any(r.surface.endswith(REPLICATED_STATE) and r.status is not C3Status.AGREE
               for r in result.replica_surfaces):
            return set()
        peer_of = {r: g for g in self.groups.all_peers for r in g}
        named: dict[tuple[int, ...], list[C3Result]] = {}
        resolved: set[str] = set()
        for res in result.replica_surfaces:
            if (res.status is not C3Status.ATTRIBUTED or untrusted & set(res.peer_ranks)
                    or res.surface.endswith(REPLICATED_STATE) or res.surface == REPLICA_UNTRUSTED):
                continue
            value = dict(zip(res.peer_ranks, res.evidence))
            # Only where the culprit's own peer group could not say: otherwise its own verdict stands.
            # (A peer group of one rank compares that rank with nobody: it has no majority.)
            culprits = tuple(r for r in res.outlier_ranks if len(peer_of.get(r, (r,))) < 2
                             or _strict_majority([value[p] for p in peer_of[r]]) is None)
            if culprits:
                named.setdefault(culprits, []).append(res)
                if set(culprits) & set(self.peers):
                    resolved.add(res.surface)
        records = [self._incident(IncidentKind.SDC, IncidentScope.RANK, ranks, rs,
                                  f"{len(rs)} replayed output(s) differ from the strict majority of the replica "
                                  f"group {list(self.groups.replica_ranks)} (its peer group has no majority)")
                   for ranks, rs in named.items()]
        if records:
            culprits = {r for ranks in named for r in ranks}
            reporter = min((r for r in self.groups.replica_ranks if r not in culprits), default=None)
            if self.rank == reporter:
                self._emit(records)
            result.incidents_global.extend(records)
        return resolved

    def _set_aside(self, result: BoundaryResult) -> None:
        """Every disagreement a rank that is not evidence takes part in (found now or at any earlier check:
        intermittent nondeterminism may happen to agree with itself today) is set aside, never SDC."""
        self._untrusted.update({r: why for r, why in result.untrusted.items() if r not in self._untrusted})
        if self._untrusted:
            result.surfaces, result.unreliable = set_aside(result.surfaces, self._untrusted)

    _UNTRUSTED_REASON = {
        "nondeterministic": "nondeterministic: the layer replayed twice on this rank signed differently, so its "
                            "replay cannot be compared bitwise (see docs/replay.md: deterministic replay)",
        "environment": "environment: this rank replays with other software, hardware or precision settings than "
                       "its peers' majority (evidence.environment), so equal inputs need not give equal bits",
    }

    def _vetting_verdicts(self, result: BoundaryResult) -> list[Incident]:
        """A rank that is not evidence (once per rank and reason, never SDC), and an optimizer self-check
        most peers fail (once)."""
        out = []
        for reason in ("nondeterministic", "environment"):
            new = tuple(sorted(r for r, why in result.untrusted.items()
                               if why == reason and (r, reason) not in self._untrusted_reported))
            if not new:
                continue
            self._untrusted_reported.update((r, reason) for r in new)
            inc = self._incident(IncidentKind.INCONCLUSIVE, IncidentScope.RANK, new, result.unreliable,
                                 self._UNTRUSTED_REASON[reason])
            inc.evidence["reason"] = reason
            out.append(inc)
        mis = result.misconfigured
        if mis is not None and not self._misconfigured_reported:
            self._misconfigured_reported = True
            failed = [r for r, ok in zip(mis.peer_ranks, mis.evidence, strict=True) if ok is False]
            inc = self._incident(
                IncidentKind.DIAGNOSIS_ERROR, IncidentScope.PEER_GROUP, self.peers, [mis],
                f"misconfiguration: the optimizer self-check fails on {len(failed)} of {len(self.peers)} peers "
                "(the replayed update does not reproduce the live one: an unsupported optimizer, fused kernel "
                "or schedule); optimizer evidence is not used")
            inc.evidence["reason"] = "misconfiguration"
            out.append(inc)
        return out

    def _environment(self) -> str:
        if self._env is None:
            self._env = environment_fingerprint(device_of(self.layers[0]))
        return self._env

    def _incident(self, kind: IncidentKind, scope: IncidentScope, ranks: Sequence[int],
                  results: Sequence[C3Result], reason: str) -> Incident:
        return Incident(kind=kind, scope=scope, ranks=list(ranks), hosts=[self.hosts.get(r, "?") for r in ranks],
                        devices=[], step=self.step, surface=";".join(r.surface for r in results),
                        evidence={"surfaces": {r.surface: r.to_dict() for r in results}}, reason=reason)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for c in self.captures:
            c.remove()


def _peers_hold_equal_shards(optimizer: torch.optim.Optimizer | None, peers: Sequence[int], rank: int) -> bool:
    """False when some peer holds a different shard of a parameter (its sharding dim spans peers)."""
    if optimizer is None:
        return True
    others = set(peers) - {rank}
    for group in optimizer.param_groups:
        for p in group["params"]:
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                continue
            for dim, placement in enumerate(p.placements):
                if placement.is_shard():
                    members = set(dist.get_process_group_ranks(mesh.get_group(dim)))
                    if members & others:
                        return False
    return True
