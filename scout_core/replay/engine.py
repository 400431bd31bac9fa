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

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scout_core.config import ReplayConfig
from scout_core.consensus import C3Result, C3Status, Confirmation, StatisticalRule, c3_exchange
from scout_core.groups import ScoutGroups, local_groups
from scout_core.replay.calls import spec_from_tensor, spec_to_tensor
from scout_core.replay.capture import LayerCapture
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.layer import (
    ShippedCall,
    broadcast_call,
    call_meta,
    materialize,
    receive_buffers,
    replay_layer,
    sync,
)
from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.rng import RngProvider
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter
from scout_core.signature import sign_many
from scout_core.topology import GroupTiming, localize_slow_groups

__all__ = ["BoundaryResult", "ReplayEngine"]

BASELINE_ROUNDS = 5
"""Clean communication rounds a group needs before its own history can call it slow."""


@dataclass
class BoundaryResult:
    step: int
    surfaces: list[C3Result] = field(default_factory=list)
    timing: C3Result | None = None
    comm_timing: C3Result | None = None
    stragglers: tuple[int, ...] = ()
    group_slowdown: bool = False
    """The whole group's communication is slow against its own clean history (no outlier rank)."""
    localization: Any = None
    """HSDP: cross-group intersection of slow shard and replica groups (``topology.Localization``)."""
    incidents_global: list[Incident] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    source: int | None = None
    recipes: tuple[str, ...] = ()
    """Recipes that were due at this boundary (``embedding``, ``hidden``, ``output``, ``optimizer``)."""
    skipped: str = ""
    """Why due work was skipped on every peer (a diagnosis error, a sampled layer that did not run)."""

    @property
    def checked(self) -> bool:
        """Something was due at this boundary (a certification boundary)."""
        return bool(self.recipes)

    @property
    def sdc(self) -> bool:
        return any(r.status is C3Status.ATTRIBUTED for r in self.surfaces)

    @property
    def inconclusive(self) -> bool:
        return any(r.status is C3Status.INCONCLUSIVE for r in self.surfaces)

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
        confirm_rounds: int = 2,
        reporter: Reporter | None = None,
        hosts: Mapping[int, str] | None = None,
        compare_param_state: bool = True,
        compare_optimizer_slices: bool | None = None,
        rng_providers: Mapping[str, RngProvider] | None = None,
        layer_names: Sequence[str] | None = None,
        embedding: torch.nn.Module | None = None,
        output: torch.nn.Module | None = None,
        boundary_owner: torch.nn.Module | None = None,
        hook_optimizer: bool = True,
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
        self.confirm = Confirmation(rounds=confirm_rounds)
        self.reporter = reporter
        self.hosts = dict(hosts or {})
        self.guard = DiagnosisGuard(self.ctrl, rank=self.rank, reporter=reporter, hosts=self.hosts)
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
        self.captures = [LayerCapture(layer) for layer in self.layers]
        self.optimizer = optimizer
        self.opt_slice = OptimizerSlice(optimizer, config.optimizer_slice_elems) if optimizer is not None else None
        self.step = 0
        self.checks = 0
        self.replaying = False
        """True while replay runs the sampled layer (model hooks may use it to stay out of the way)."""
        self.last_calls: dict[str, tuple[ShippedCall, int]] = {}
        """The newest replayed call per recipe (identical on every peer): the emergency sweep's inputs."""
        self.history: deque[BoundaryResult] = deque(maxlen=1024)  # boundaries that did work, newest last
        self.comm_baseline: deque[float] = deque(maxlen=10)  # group medians of recent clean rounds
        self._gather_s: float | None = None
        self._hsdp_comm: tuple[float, float, Any, Any] | None = None
        self._last_loc: Any = None
        self._loc_rounds = 0
        self._slow_group_rounds = 0
        self._opt_due = False
        self._opt_error: BaseException | None = None
        self._handles: list[Any] = []
        if optimizer is not None and hook_optimizer:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(optimizer.register_step_post_hook(self._post_step))
        self._arm(1)

    # -- scheduling ------------------------------------------------------------------------------

    def _due(self, step: int, cadence: int) -> bool:
        return self.cfg.enabled and cadence > 0 and step % cadence == 0

    def _layer_index(self) -> int:
        return self.checks % self.n_hidden

    def _arm(self, step: int) -> None:
        if self._due(step, self.cfg.cadence.hidden):
            self.captures[self._layer_index()].arm()
        for recipe, idx in self.extra.items():
            if self._due(step, getattr(self.cfg.cadence, recipe)):
                self.captures[idx].arm()

    def due_next(self) -> tuple[str, ...]:
        """Recipes due at the next boundary (the same on every peer)."""
        step = self.step + 1
        due = tuple(r for r in self.extra if self._due(step, getattr(self.cfg.cadence, r)))
        due += ("hidden",) if self._due(step, self.cfg.cadence.hidden) else ()
        return due + (("optimizer",) if self._opt_due else ())

    def _pre_step(self, *_: Any) -> None:
        self._opt_due = self.opt_slice is not None and self._due(self.step + 1, self.cfg.cadence.optimizer)
        if not self._opt_due:
            return
        try:
            self.opt_slice.before_step()
        except Exception as exc:  # noqa: BLE001 - reported at the boundary, where every peer agrees to skip
            self.opt_slice.pending, self._opt_error = None, exc

    def _post_step(self, *_: Any) -> None:
        self.boundary()

    # -- the boundary ----------------------------------------------------------------------------

    def boundary(self) -> BoundaryResult:
        """Run whatever is due for the step that just finished (called by the step post-hook)."""
        self.step += 1
        step = self.step
        result = BoundaryResult(step)
        due = [(r, i) for r, i in self.extra.items() if self._due(step, getattr(self.cfg.cadence, r))]
        if self._due(step, self.cfg.cadence.hidden):
            due.append(("hidden", self._layer_index()))
            self.checks += 1  # every peer rotates together, whatever happens to this check
        opt_due, self._opt_due = self._opt_due, False
        result.recipes = tuple(r for r, _ in due) + (("optimizer",) if opt_due else ())
        if result.recipes:
            try:
                self._check(result, due, opt_due)
            finally:
                if self.opt_slice is not None:
                    self.opt_slice.pending = None
                self.guard.reset()
            self.history.append(result)  # steps with nothing due keep no record: a long run must not grow
        self._arm(step + 1)
        return result

    def _check(self, result: BoundaryResult, due: list[tuple[str, int]], opt_due: bool) -> None:
        guard, step = self.guard, result.step
        src = self.peers[(self.checks - (1 if any(r == "hidden" for r, _ in due) else 0)) % len(self.peers)]
        result.source = src
        if self._opt_error is not None:
            guard.failed, guard.failed_where, self._opt_error = self._opt_error, "optimizer slice capture", None
        captured: dict[int, Any] = {}
        metas: dict[int, Any] = {}
        with guard.stage("capture"):
            for _, idx in due:
                captured[idx] = self.captures[idx].take()
                if self.rank == src:
                    metas[idx] = None if captured[idx] is None else call_meta(captured[idx], self.rng_providers)
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return
        box = [metas]
        dist.broadcast_object_list(box, src=src, group=self.ctrl)
        metas = box[0]
        not_run = [self.names[idx] for _, idx in due if metas.get(idx) is None]
        if not_run:  # conditional layers: a sampled layer that did not run on the source skips on every peer
            result.skipped = f"sampled layer(s) {', '.join(not_run)} did not run on source rank {src}"
            due = [(r, idx) for r, idx in due if metas.get(idx) is not None]
        calls: dict[int, ShippedCall] = {}
        with guard.stage("receive buffers"):
            for _, idx in due:
                calls[idx] = receive_buffers(metas[idx], captured.get(idx), _device_of(self.layers[idx]),
                                             self.rank == src)
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return
        for _, idx in due:
            broadcast_call(calls[idx], src, self.group)
        evidence: list[tuple[str, Any]] = []
        compute_s = comm_s = 0.0
        for recipe, idx in due:
            surfaces, t_compute, gather_s = self._replay_recipe(idx, calls[idx])
            evidence += surfaces
            if recipe == "hidden":  # the hidden layer's timings are the ones compared
                compute_s = t_compute
                comm_s = gather_s if gather_s is not None else self._replay_comm(idx)
            self.last_calls[recipe] = (calls[idx], idx)
        if opt_due and self.opt_slice is not None:
            with guard.stage("optimizer replay"):
                for name, value in self.opt_slice.after_step():
                    if self.compare_optimizer_slices or name == "optimizer.self_check":
                        evidence.append((name, value))
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return
        if not evidence:
            return
        result.surfaces = c3_exchange([v for _, v in evidence], group=self.ctrl, surfaces=[n for n, _ in evidence])
        if not any(r == "hidden" for r, _ in due):
            return  # timing evidence comes from the hidden-layer recipe only; no round without it
        times, comm = c3_exchange([compute_s, comm_s], group=self.ctrl,
                                  surfaces=["replay.compute_s", "replay.comm_s"], rule=self.rule)
        result.timing, result.comm_timing = times, comm
        # Communication time is a property of a synchronizing group, not of one member (paper
        # Figure 2c): it is never attributed to a rank. It feeds the group's temporal check and,
        # where a rank sits in groups of two dimensions (HSDP), the cross-group intersection.
        result.stragglers = self.confirm.update(times)
        result.group_slowdown = self._group_slowdown(comm)
        if self._hsdp_comm is not None:
            result.localization = self._cross_group(*self._hsdp_comm)
        result.incidents = self._verdicts(result)

    def _replay_recipe(self, idx: int, call: ShippedCall) -> tuple[list[tuple[str, Any]], float, float | None]:
        """Materialize the layer (collectives run on every peer, whatever failed locally), replay it, reshard."""
        layer, name = self.layers[idx], self.names[idx]
        surfaces: list[tuple[str, Any]] = []
        groups = _mesh_groups(layer)
        if groups is not None:
            # HSDP: replicas hold the same shard, so compare the local shards BEFORE unsharding (a
            # corrupted shard would otherwise reach its whole shard group through the all-gather).
            # Pure FSDP has no owner copy to compare a shard against.
            with self.guard.stage("local shard signature"):
                signed = sign_many([torch.cat([p.to_local().reshape(-1) for p in layer.parameters()])])[0]
                surfaces.append((f"{name}.local_shard", (signed.signature, signed.nonfinite)))
            self._hsdp_comm = _time_hsdp_collectives(layer)
        owner = self.owner if idx >= self.n_hidden else None
        forward, gather_s, release = materialize(layer, owner)
        compute_s = 0.0
        try:
            with self.guard.stage(f"replay of {name}"):
                self.captures[idx].suspended, self.replaying = True, True
                try:
                    replayed, compute_s = replay_layer(
                        forward, layer, name, call, variants=self.cfg.input_variants, providers=self.rng_providers,
                        deterministic=self.cfg.deterministic, compare_param_state=self.compare_param_state)
                finally:
                    self.captures[idx].suspended, self.replaying = False, False
                surfaces += replayed
        finally:
            if release is not None:
                release()
        return surfaces, compute_s, gather_s

    # -- restart: saved calls and the emergency sweep ----------------------------------------------

    def sweep_state(self) -> dict[str, Any]:
        """Counters and the newest replayed call per recipe, stored in every snapshot (weights-only safe)."""
        return {"step": self.step, "checks": self.checks,
                "calls": {recipe: _call_to_dict(call, idx) for recipe, (call, idx) in self.last_calls.items()}}

    def load_sweep_state(self, saved: Mapping[str, Any]) -> None:
        """Continue from a restored snapshot: same schedule, same rotation, its calls for a sweep."""
        for c in self.captures:
            c.take()
        self.step, self.checks = int(saved["step"]), int(saved["checks"])
        self.last_calls = {r: _call_from_dict(d) for r, d in saved.get("calls", {}).items()}
        self._arm(self.step + 1)

    def sweep(self) -> bool:
        """Emergency sweep (paper section 8): replay EVERY layer on the newest saved calls and compare with
        exact C3 across peers. True when nothing disagrees; SDC found is recorded. Every peer must call it."""
        work: list[tuple[int, ShippedCall]] = []
        for recipe, (call, idx) in sorted(self.last_calls.items()):
            if recipe == "hidden":
                kind = type(self.layers[idx])
                work += [(i, call) for i in range(self.n_hidden) if type(self.layers[i]) is kind]
            elif recipe in self.extra:
                work.append((self.extra[recipe], call))
        evidence: list[tuple[str, Any]] = []
        for idx, call in work:
            evidence += self._replay_recipe(idx, call)[0]
        ok = self.guard.agree(self.step, "sweep")
        self.guard.reset()
        if not ok:
            return False
        results = c3_exchange([v for _, v in evidence], group=self.ctrl, surfaces=[n for n, _ in evidence])
        bad = [r for r in results if r.status is not C3Status.AGREE]
        if bad:
            sweep = BoundaryResult(self.step, surfaces=bad)
            incidents = self._sdc_verdicts(sweep)
            for inc in incidents:
                inc.reason = "emergency sweep of the latest state: " + inc.reason
            self._report(incidents)
        return not bad

    def _replay_comm(self, idx: int, repeats: int = 3) -> float:
        """Time a training-shaped all-reduce (the sampled layer's gradient size) on a scratch tensor.

        The fastest of ``repeats`` runs: a slow link or endpoint is slow every time, while a
        scheduler hiccup on a loaded host delays one run, so the minimum keeps the first and
        drops the second.
        """
        params = [p for p in self.layers[idx].parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params) or 1
        scratch = torch.zeros(numel, dtype=params[0].dtype if params else torch.float32,
                              device=params[0].device if params else "cpu")
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=self.group)  # start together: the time is the collective's, not arrival skew
            sync(params)
            start = time.perf_counter()
            dist.all_reduce(scratch, group=self.group)
            sync(params)
            best = min(best, time.perf_counter() - start)
        return best

    def _cross_group(self, t_rs: float, t_ar: float, shard_pg: Any, repl_pg: Any) -> Any:
        """Intersect slow shard groups and slow replica groups to name a machine (paper section 6.1.2).

        One world all-gather of every rank's two timings; a group's time is its slowest
        member's (a synchronizing collective ends with it); statistical C3 across the groups
        of one dimension marks slow groups. The same verdict in consecutive rounds confirms it.
        """
        world = dist.get_world_size()
        timings: list[Any] = [None] * world
        dist.all_gather_object(timings, (t_rs, t_ar), group=self.groups.world_control)
        shard_groups = _all_groups(shard_pg, self.groups.world_control)
        repl_groups = _all_groups(repl_pg, self.groups.world_control)
        observations = []
        for dim, groups, col in (("shard", shard_groups, 0), ("replica", repl_groups, 1)):
            group_times = [max(timings[r][col] for r in g) for g in groups]
            res = self.rule(group_times, peer_ranks=list(range(len(groups))), surface=f"replay.{dim}_comm_s")
            observations += [GroupTiming(dim, tuple(g), bool(b)) for g, b in zip(groups, res.bitmap, strict=True)]
        hosts = {r: self.hosts.get(r, "?") for r in range(world)}
        loc = localize_slow_groups(observations, hosts)
        key = (loc.scope, loc.ranks, loc.hosts)
        if loc.scope == "none":
            self._loc_rounds, self._last_loc = 0, None
            return None
        self._loc_rounds = self._loc_rounds + 1 if key == self._last_loc else 1
        self._last_loc = key
        return loc

    def _group_slowdown(self, comm: C3Result) -> bool:
        """Temporal reference for what spatial consensus cannot see: the whole group slower.

        A collective spanning every peer makes every peer wait for a slow member, so
        no peer is an outlier. The group's median is compared with the distribution of
        its own clean rounds by the same robust rule as the spatial one (median plus
        kappa robust sigmas of the history, with the ratio and absolute floors): a
        noisy history widens the threshold instead of producing verdicts. It needs
        ``BASELINE_ROUNDS`` clean rounds first and is confirmed over the same number
        of consecutive rounds as stragglers.
        """
        median = float(comm.reference)
        history = sorted(self.comm_baseline)
        slow = False
        if len(history) >= BASELINE_ROUNDS:
            base = history[len(history) // 2]
            deviations = sorted(abs(h - base) for h in history)
            scale = max(deviations[len(deviations) // 2] * 1.4826, self.rule.mad_floor_fraction * base)
            threshold = max(base + self.rule.kappa * scale, base * self.rule.min_ratio, base + self.rule.min_delta)
            slow = median > threshold
        if slow:
            self._slow_group_rounds += 1
        else:
            self._slow_group_rounds = 0
            if comm.status is C3Status.AGREE:
                self.comm_baseline.append(median)
        return self._slow_group_rounds >= self.confirm.rounds

    # -- verdicts -----------------------------------------------------------------------------------

    def _verdicts(self, result: BoundaryResult) -> list[Incident]:
        """SDC records (see :meth:`_sdc_verdicts`) and one record per newly confirmed straggler."""
        incidents = self._sdc_verdicts(result)
        timing = result.timing
        new = tuple(r for r in timing.outlier_ranks if self.confirm.count(timing.surface, r) == self.confirm.rounds)
        if new:
            incidents.append(self._incident(
                IncidentKind.STRAGGLER, IncidentScope.RANK, new, [timing],
                f"replay compute slower than peers in {self.confirm.rounds} consecutive rounds"))
        loc = result.localization
        if loc is not None and self._loc_rounds == self.confirm.rounds:
            machine = self._incident(IncidentKind.STRAGGLER, IncidentScope(loc.scope), loc.ranks, [result.comm_timing],
                                     f"communication: {loc.reason}")
            machine.hosts = list(loc.hosts)
            machine.evidence["slow_groups"] = [[d, list(g)] for d, g in loc.slow_groups]
            if self.rank == self._world_reporter(loc):  # one record for the whole job
                self._emit([machine])
            result.incidents_global = [machine]
        if result.group_slowdown and self._slow_group_rounds == self.confirm.rounds:
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
        record for surfaces without a majority."""
        incidents = []
        by_ranks: dict[tuple[int, ...], list[C3Result]] = {}
        inconclusive = []
        for r in result.surfaces:
            if r.status is C3Status.ATTRIBUTED:
                by_ranks.setdefault(r.outlier_ranks, []).append(r)
            elif r.status is C3Status.INCONCLUSIVE:
                inconclusive.append(r)
        for ranks, rs in by_ranks.items():
            incidents.append(self._incident(IncidentKind.SDC, IncidentScope.RANK, ranks, rs,
                                            f"{len(rs)} replayed surface(s) differ from the strict majority"))
        if inconclusive:
            incidents.append(self._incident(IncidentKind.SDC, IncidentScope.PEER_GROUP, self.peers, inconclusive,
                                            "replayed surfaces disagree without a strict majority"))
        return incidents

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


def _call_to_dict(call: ShippedCall, idx: int) -> dict[str, Any]:
    return {"layer": idx, "tensors": [t.detach().cpu() for t in call.tensors], "spec": spec_to_tensor(call.spec),
            "mask": list(call.requires_grad), "grads": {str(i): g.detach().cpu() for i, g in call.grad_outputs.items()},
            "rng": dict(call.rng)}


def _call_from_dict(d: Mapping[str, Any]) -> tuple[ShippedCall, int]:
    call = ShippedCall(list(d["tensors"]), spec_from_tensor(d["spec"]), list(d["mask"]),
                       {int(i): g for i, g in d["grads"].items()}, dict(d["rng"]))
    return call, int(d["layer"])


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


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


def _mesh_groups(layer: torch.nn.Module) -> tuple[Any, Any] | None:
    """(shard group, replica group) of an HSDP-managed layer's parameters, else None."""
    for p in layer.parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or mesh.ndim != 2:
            return None
        shard = [d for d, pl in enumerate(placements) if pl.is_shard()]
        repl = [d for d, pl in enumerate(placements) if pl.is_replicate()]
        if len(shard) == 1 and len(repl) == 1:
            return mesh.get_group(shard[0]), mesh.get_group(repl[0])
    return None


_GROUPS_OF: dict[Any, list[list[int]]] = {}


def _all_groups(pg: Any, control: Any) -> list[list[int]]:
    """Every group of the same dimension as ``pg`` (one world all-gather of memberships, then cached)."""
    if pg not in _GROUPS_OF:
        mine = sorted(dist.get_process_group_ranks(pg))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=control)
        _GROUPS_OF[pg] = [list(g) for g in dict.fromkeys(tuple(g) for g in everyone)]
    return _GROUPS_OF[pg]


def _time_hsdp_collectives(layer: torch.nn.Module) -> tuple[float, float, Any, Any] | None:
    """HSDP: a training-shaped reduce-scatter (shard group) then replica all-reduce, on scratch tensors."""
    groups = _mesh_groups(layer)
    if groups is None:
        return None
    shard_pg, repl_pg = groups
    params = list(layer.parameters())
    n_shards = dist.get_world_size(shard_pg)
    per_shard = -(-sum(p.numel() for p in params) // n_shards)
    local = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
    full = torch.zeros(per_shard * n_shards, dtype=local.dtype, device=local.device)
    shard = torch.zeros(per_shard, dtype=local.dtype, device=local.device)
    dist.barrier()  # every rank starts together: times belong to the collectives
    start = time.perf_counter()
    dist.reduce_scatter_tensor(shard, full, group=shard_pg)
    sync([local])
    t_rs = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(shard, group=repl_pg)
    sync([local])
    return t_rs, time.perf_counter() - start, shard_pg, repl_pg
