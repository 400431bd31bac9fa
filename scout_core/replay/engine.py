"""In-situ replay at the optimizer boundary (paper section 6.1 and Algorithm 2).

On a due step the engine, right after the real optimizer step:

1. picks this check's source peer (rotating, so one faulty source cannot
   poison every check) and broadcasts the source's captured layer inputs, the
   incoming output gradient and its RNG states to the peer group;
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
replay restores the RNG streams and computes gradients functionally.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_unflatten

from scout_core.config import ReplayConfig
from scout_core.consensus import C3Result, C3Status, Confirmation, StatisticalRule, c3_exchange
from scout_core.replay.capture import LayerCapture, first_tensor
from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.rng import RngProvider, capture_rng, replay_rng_scope, rng_fingerprint
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter
from scout_core.signature import sign_many
from scout_core.topology import GroupTiming, localize_slow_groups

__all__ = ["BoundaryResult", "ReplayEngine"]


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

    @property
    def sdc(self) -> bool:
        return any(r.status is C3Status.ATTRIBUTED for r in self.surfaces)

    @property
    def inconclusive(self) -> bool:
        return any(r.status is C3Status.INCONCLUSIVE for r in self.surfaces)

    @property
    def missing(self) -> bool:
        return not self.surfaces


class ReplayEngine:
    """Replays one sampled layer (rotating) and an optimizer slice on due steps."""

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None,
        *,
        config: ReplayConfig,
        group: Any = None,
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
    ) -> None:
        if not layers:
            raise ValueError("replay needs at least one repeated layer")
        self.layers = list(layers)
        self.names = list(layer_names) if layer_names else [f"layers.{i}" for i in range(len(self.layers))]
        self.cfg = config
        self.group = group
        self.peers = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
            range(dist.get_world_size()))
        self.rank = dist.get_rank()
        self.rule = rule or StatisticalRule()
        self.confirm = Confirmation(rounds=confirm_rounds)
        self.reporter = reporter
        self.hosts = dict(hosts or {})
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
        self.history: deque[BoundaryResult] = deque(maxlen=1024)  # boundaries that did work, newest last
        self.comm_baseline: deque[float] = deque(maxlen=10)  # group medians of recent clean rounds
        self._gather_s: float | None = None
        self._hsdp_comm: tuple[float, float, Any, Any] | None = None
        self._last_loc: Any = None
        self._loc_rounds = 0
        self._slow_group_rounds = 0
        self._handles: list[Any] = []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(optimizer.register_step_post_hook(self._post_step))
        self._arm(1)

    # -- scheduling ------------------------------------------------------------------------------

    def _due(self, step: int, cadence: int) -> bool:
        return cadence > 0 and step % cadence == 0

    def _layer_index(self) -> int:
        return self.checks % self.n_hidden

    def _arm(self, step: int) -> None:
        if not self.cfg.enabled:
            return
        if self._due(step, self.cfg.cadence.hidden):
            self.captures[self._layer_index()].arm()
        for recipe, idx in self.extra.items():
            if self._due(step, getattr(self.cfg.cadence, recipe)):
                self.captures[idx].arm()

    def _pre_step(self, *_: Any) -> None:
        if self.cfg.enabled and self.opt_slice is not None and self._due(self.step + 1, self.cfg.cadence.optimizer):
            self.opt_slice.before_step()

    def _post_step(self, *_: Any) -> None:
        self.boundary()

    # -- the boundary ----------------------------------------------------------------------------

    def boundary(self) -> BoundaryResult:
        """Run whatever is due for the step that just finished (called by the step post-hook)."""
        self.step += 1
        result = BoundaryResult(self.step)
        evidence: list[Any] = []
        names: list[str] = []
        compute_s = comm_s = 0.0
        for recipe, idx in self.extra.items():  # before the hidden layer: its timings are the ones kept
            if self.cfg.enabled and self._due(self.step, getattr(self.cfg.cadence, recipe)):
                extra_surfaces, _, result.source = self._replay_layer(idx)
                for name, value in extra_surfaces:
                    names.append(name)
                    evidence.append(value)
        if self.cfg.enabled and self._due(self.step, self.cfg.cadence.hidden):
            idx = self._layer_index()
            layer_surfaces, compute_s, result.source = self._replay_layer(idx)
            # FSDP2: the timed parameter all-gather; otherwise a training-shaped scratch all-reduce.
            comm_s = self._gather_s if self._gather_s is not None else self._replay_comm(idx)
            for name, value in layer_surfaces:
                names.append(name)
                evidence.append(value)
            self.checks += 1
        if self.opt_slice is not None and self.opt_slice.pending:
            for name, value in self.opt_slice.after_step():
                if not self.compare_optimizer_slices and name != "optimizer.self_check":
                    continue
                names.append(name)
                evidence.append(value)
        if names:
            results = c3_exchange(evidence, group=self.group, surfaces=names)
            times, comm = c3_exchange([compute_s, comm_s], group=self.group,
                                      surfaces=["replay.compute_s", "replay.comm_s"], rule=self.rule)
            result.surfaces, result.timing, result.comm_timing = results, times, comm
            # Communication time is a property of a synchronizing group, not of one member (paper
            # Figure 2c): it is never attributed to a rank. It feeds the group's temporal check and,
            # where a rank sits in groups of two dimensions (HSDP), the cross-group intersection.
            result.stragglers = self.confirm.update(times)
            result.group_slowdown = self._group_slowdown(comm)
            if self._hsdp_comm is not None:
                result.localization = self._cross_group(*self._hsdp_comm)
            result.incidents = self._verdicts(result)
        self._arm(self.step + 1)
        if names:  # steps with nothing due keep no record: a long run must not grow memory
            self.history.append(result)
        return result

    # -- layer replay ----------------------------------------------------------------------------

    def _broadcast_call(self, idx: int, src: int) -> tuple[list[Any], Any, list[bool], torch.Tensor | None,
                                                          dict[str, torch.Tensor]]:
        captured = self.captures[idx].take()
        if self.rank == src and captured is None:
            raise RuntimeError(f"step {self.step}: layer {self.names[idx]} was not called on the source rank; "
                               "replay needs the sampled layer to run every due step")
        meta: list[Any] = [None]
        if self.rank == src:
            tensors = [v for v in captured.leaves if isinstance(v, torch.Tensor)]
            rng = capture_rng(self.rng_providers)
            meta[0] = {
                "spec": captured.spec,
                "plain": [None if isinstance(v, torch.Tensor) else v for v in captured.leaves],
                "tensors": [(tuple(t.shape), t.dtype) for t in tensors],
                "mask": captured.requires_grad,
                "grad": None if captured.grad_output is None else (tuple(captured.grad_output.shape),
                                                                  captured.grad_output.dtype),
                "rng": {k: v for k, v in rng.items()},
            }
        dist.broadcast_object_list(meta, src=src, group=self.group)
        m = meta[0]
        device = next(iter(self.layers[idx].parameters())).device
        if self.rank == src:
            tensors = [v.contiguous() for v in captured.leaves if isinstance(v, torch.Tensor)]
            grad = captured.grad_output.contiguous() if captured.grad_output is not None else None
        else:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in m["tensors"]]
            grad = torch.empty(m["grad"][0], dtype=m["grad"][1], device=device) if m["grad"] else None
        for t in tensors + ([grad] if grad is not None else []):
            dist.broadcast(t, src=src, group=self.group)
        it = iter(tensors)
        leaves = [next(it) if v is None else v for v in m["plain"]]
        return leaves, m["spec"], m["mask"], grad, m["rng"]

    def _replay_layer(self, idx: int) -> tuple[list[tuple[str, Any]], float, int]:
        """Broadcast the source's call, materialize the layer, replay it; reshard even on error."""
        src = self.peers[self.checks % len(self.peers)]
        leaves, spec, mask, grad_out, rng = self._broadcast_call(idx, src)
        layer, name, capture = self.layers[idx], self.names[idx], self.captures[idx]
        local_shard: list[tuple[str, Any]] = []
        if _mesh_groups(layer) is not None:
            # HSDP: replicas hold the same shard, so compare the local shards BEFORE unsharding (a
            # corrupted shard would otherwise reach its whole shard group through the all-gather).
            # Pure FSDP has no owner copy to compare a shard against.
            signed = sign_many([torch.cat([p.to_local().reshape(-1) for p in layer.parameters()])])[0]
            local_shard = [(f"{name}.local_shard", (signed.signature, signed.nonfinite))]
        self._hsdp_comm = _time_hsdp_collectives(layer)
        owner = self.owner if idx >= self.n_hidden else None
        forward, self._gather_s, release = _materialize(layer, owner)
        try:
            surfaces, compute_s, src = self._replay_materialized(forward, layer, name, capture, leaves, spec, mask,
                                                                 grad_out, rng, src)
            return local_shard + surfaces, compute_s, src
        finally:
            if release is not None:
                release()

    def _replay_materialized(self, forward: Any, layer: torch.nn.Module, name: str, capture: LayerCapture,
                             leaves: list[Any], spec: Any, mask: list[bool], grad_out: torch.Tensor | None,
                             rng: dict[str, torch.Tensor], src: int) -> tuple[list[tuple[str, Any]], float, int]:
        received = [v for v in leaves if isinstance(v, torch.Tensor)] + ([grad_out] if grad_out is not None else [])
        surfaces: list[tuple[str, Any]] = [
            ("replay.inputs", (tuple(s.signature for s in sign_many(received)), rng_fingerprint(rng)))]
        params = [p for p in layer.parameters() if p.requires_grad]
        to_sign: list[tuple[str, torch.Tensor]] = []
        compute_s = 0.0
        capture.suspended = True
        try:
            for v in self.cfg.input_variants:
                with replay_rng_scope(rng, self.rng_providers, deterministic=self.cfg.deterministic):
                    inputs = []
                    for leaf, needs_grad in zip(leaves, mask, strict=True):
                        if isinstance(leaf, torch.Tensor):
                            x = leaf.detach().clone()
                            if v != 1.0 and x.is_floating_point():
                                x.mul_(v)
                            inputs.append(x.requires_grad_(needs_grad and x.is_floating_point()))
                        else:
                            inputs.append(leaf)
                    args, kwargs = tree_unflatten(inputs, spec)
                    _sync(params)
                    start = time.perf_counter()
                    out = first_tensor(forward(*args, **kwargs))
                    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + params
                    grads: Sequence[torch.Tensor | None] = ()
                    if out is not None and out.requires_grad and wrt:
                        g = grad_out if grad_out is not None and grad_out.shape == out.shape else torch.ones_like(out)
                        grads = torch.autograd.grad(out, wrt, grad_outputs=g, allow_unused=True)
                    _sync(params)
                    compute_s += time.perf_counter() - start
                tag = f"{name}.x{v:g}"
                n_in = len(wrt) - len(params)
                if out is not None:
                    to_sign.append((f"{tag}.output", out.detach()))
                in_grads = [g.reshape(-1) for g in grads[:n_in] if g is not None]
                if in_grads:
                    to_sign.append((f"{tag}.grad_input", torch.cat(in_grads)))
                p_grads = [g.reshape(-1) for g in grads[n_in:] if g is not None]
                if p_grads:
                    to_sign.append((f"{tag}.grad_param", torch.cat(p_grads)))
        finally:
            capture.suspended = False
        if self.compare_param_state:
            to_sign.append((f"{name}.param_state", torch.cat([p.detach().reshape(-1) for p in params])))
        signed = sign_many([t for _, t in to_sign])
        surfaces += [(n, (s.signature, s.nonfinite)) for (n, _), s in zip(to_sign, signed, strict=True)]
        return surfaces, compute_s, src

    def _replay_comm(self, idx: int) -> float:
        """Time a training-shaped all-reduce (the sampled layer's gradient size) on a scratch tensor."""
        params = [p for p in self.layers[idx].parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params) or 1
        scratch = torch.zeros(numel, dtype=params[0].dtype if params else torch.float32,
                              device=params[0].device if params else "cpu")
        dist.barrier(group=self.group)  # start together: the time is the collective's, not arrival skew
        _sync(params)
        start = time.perf_counter()
        dist.all_reduce(scratch, group=self.group)
        _sync(params)
        return time.perf_counter() - start

    def _cross_group(self, t_rs: float, t_ar: float, shard_pg: Any, repl_pg: Any) -> Any:
        """Intersect slow shard groups and slow replica groups to name a machine (paper section 6.1.2).

        One world all-gather of every rank's two timings; a group's time is its slowest
        member's (a synchronizing collective ends with it); statistical C3 across the groups
        of one dimension marks slow groups. The same verdict in consecutive rounds confirms it.
        """
        world = dist.get_world_size()
        timings: list[Any] = [None] * world
        dist.all_gather_object(timings, (t_rs, t_ar))
        shard_groups = _all_groups(shard_pg)
        repl_groups = _all_groups(repl_pg)
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
        no peer is an outlier. The group's median is compared with the median of its
        own clean rounds (same ratio and absolute floors as the spatial rule) and a
        slowdown is confirmed over the same number of consecutive rounds.
        """
        median = float(comm.reference)
        history = list(self.comm_baseline)
        slow = False
        if len(history) >= 3:
            base = sorted(history)[len(history) // 2]
            slow = median > max(base * self.rule.min_ratio, base + self.rule.min_delta)
        if slow:
            self._slow_group_rounds += 1
        else:
            self._slow_group_rounds = 0
            if comm.status is C3Status.AGREE:
                self.comm_baseline.append(median)
        return self._slow_group_rounds >= self.confirm.rounds

    # -- verdicts -----------------------------------------------------------------------------------

    def _verdicts(self, result: BoundaryResult) -> list[Incident]:
        """One SDC record per set of culprit ranks per boundary (all its surfaces in the evidence),
        one group-scoped record for surfaces without a majority, one record per newly confirmed straggler."""
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
        # The lowest peer not named by a rank-scoped verdict writes the records (group-scoped verdicts
        # name everyone, and any member may report those).
        named = {r for i in incidents if i.scope is IncidentScope.RANK for r in i.ranks}
        reporter_rank = min((r for r in self.peers if r not in named), default=min(self.peers)) if incidents else None
        if self.rank == reporter_rank:
            self._emit(incidents)
        return incidents

    def _emit(self, incidents: Sequence[Incident]) -> None:
        if self.reporter is not None:
            for inc in incidents:
                self.reporter.emit(inc)

    def _world_reporter(self, loc: Any) -> int:
        return min((r for r in range(dist.get_world_size()) if r not in loc.ranks), default=0)

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


def _all_groups(pg: Any) -> list[list[int]]:
    """Every group of the same dimension as ``pg`` (one world all-gather of memberships, then cached)."""
    if pg not in _GROUPS_OF:
        mine = sorted(dist.get_process_group_ranks(pg))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
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
    _sync([local])
    t_rs = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(shard, group=repl_pg)
    _sync([local])
    return t_rs, time.perf_counter() - start, shard_pg, repl_pg


def _materialize(layer: torch.nn.Module, owner: torch.nn.Module | None = None) -> tuple[Any, float | None, Any]:
    """``(forward, gather_s, release)`` for replaying ``layer``.

    An FSDP2 layer is unsharded through its public ``unshard()`` (timed: the
    parameter all-gather is the layer's communication) and its ORIGINAL class's
    ``forward`` is called directly, so FSDP's own hooks, and with them its
    reduce-scatter into the live sharded gradients, never run for the replay.
    ``release`` reshards. Other layers are called as they are.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()  # type: ignore[assignment]  # noqa: N806
    if FSDPModule and owner is not None and isinstance(owner, FSDPModule):
        # A boundary module (embedding, LM head) whose parameters the outer FSDP module manages.
        dist.barrier()
        start = time.perf_counter()
        owner.unshard()
        _sync(list(layer.parameters()))
        return layer, time.perf_counter() - start, owner.reshard
    if FSDPModule and isinstance(layer, FSDPModule):
        params = list(layer.parameters())
        _sync(params)
        dist.barrier()  # start together, or one late rank's earlier delay shows up as this gather's time
        start = time.perf_counter()
        layer.unshard()
        _sync(list(layer.parameters()))
        gather_s = time.perf_counter() - start
        cls = next(c for c in type(layer).__mro__[1:] if not issubclass(c, FSDPModule))
        return cls.forward.__get__(layer), gather_s, layer.reshard
    return layer, None, None


def _sync(params: Sequence[torch.Tensor]) -> None:
    if params and params[0].is_cuda:
        torch.cuda.synchronize(params[0].device)
