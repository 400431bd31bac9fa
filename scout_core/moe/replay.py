"""Expert replay (paper section 6.2): corresponding EP positions in independent replicas replay one expert on
identical inputs and compare outputs, input gradients and weight gradients by exact C3.

An expert's weights are equal only among the ranks that hold the same EP position in different replicas
(its *expert peers*, Megatron's expert-data-parallel group), so experts are compared there, never across
EP positions. Each check, on the ``replay.cadence.expert`` interval:

1. rotation: the next (MoE layer, local expert) pair, and for it the next representative row count of the
   shape catalog (:mod:`scout_core.moe.catalog`; without one, the rows the source's expert received in the
   last step), and the next source among the expert peers; layer, expert, shape and source rotate on
   independent counters, so every combination comes round;
2. the source builds the input: the rows its expert received in training (captured by a forward pre-hook),
   repeated or cut to the representative's row count (seeded random rows where it received none), and
   broadcasts it to its expert peers; the output gradient is drawn from a generator seeded by the check, so
   it is identical everywhere without a transfer;
3. every peer runs its own copy of the expert forward and backward (functional gradients, never ``.grad``)
   and signs the output, input gradient and weight gradients; one exact C3 exchange among the expert peers
   names a minority rank (``sdc``, scope ``rank``).

All expert-peer groups check at the same boundary, each among itself. Local failures are isolated by a
:class:`~scout_core.replay.guard.DiagnosisGuard` over the whole job: if any rank fails, every rank skips the
rest of the check and the failing rank records a ``diagnosis_error``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scout_core.consensus import C3Result, C3Status, StatisticalRule, c3_exchange, group_disagreements
from scout_core.moe.alltoall import AllToAllReplay
from scout_core.moe.catalog import Catalog
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.layer import device_of
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter
from scout_core.signature import sign_many

__all__ = ["ExpertCheck", "ExpertReplay", "MoEBinding"]


@dataclass(kw_only=True)
class MoEBinding:
    """What SCOUT needs to know of a model's MoE layers (``enable(..., moe=...)``)."""

    layers: list[nn.Module]
    """The MoE modules; each has an ``experts`` ``ModuleList`` of this rank's local experts."""
    expert_peer_groups: list[list[int]]
    """A partition of the ranks into groups holding the same experts (same EP position, other replicas)."""
    names: list[str] | None = None
    """Names of ``layers`` for records (default ``moe.<i>``)."""
    ep_groups: list[list[int]] | None = None
    """A partition of the ranks into EP groups (the ranks one AllToAll spans), in EP-position order; with it,
    each expert check also replays the AllToAll with one communication plan (:mod:`scout_core.moe.alltoall`)."""
    splits: Callable[[nn.Module], Sequence[int]] | None = None
    """This rank's split sizes of a MoE layer's last dispatch (rows sent to each EP peer); default: the
    layer's ``last_plan.in_splits``."""
    ep_position: int | None = None
    """This rank's EP position (catalog entries are per position); default: its index in its peer group's
    ordering of EP groups is unknown, so position 0's entry is used for every rank (equal dimensions)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("MoEBinding needs at least one MoE layer")
        for m in self.layers:
            if not isinstance(getattr(m, "experts", None), nn.ModuleList) or not len(m.experts):
                raise TypeError(f"MoE layer {type(m).__name__} has no non-empty `experts` ModuleList")
        if len({len(m.experts) for m in self.layers}) != 1:
            raise ValueError("every MoE layer must hold the same number of local experts")
        flat = sorted(r for g in self.expert_peer_groups for r in g)
        if dist.is_initialized() and flat != list(range(dist.get_world_size())):
            raise ValueError(f"expert_peer_groups must partition the ranks exactly once, "
                             f"got {self.expert_peer_groups}")
        if self.names is not None and len(self.names) != len(self.layers):
            raise ValueError(f"{len(self.names)} names for {len(self.layers)} MoE layers")


@dataclass
class ExpertCheck:
    """One expert check on this rank."""

    step: int
    layer: str
    expert: int
    rows: int
    source: int
    surfaces: list[C3Result] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    skipped: str = ""
    localization: Any = None
    """A confirmed slow machine or group from the AllToAll replay's timings (``topology.Localization``)."""

    @property
    def sdc(self) -> bool:
        return any(r.status is C3Status.ATTRIBUTED for r in self.surfaces)

    @property
    def inconclusive(self) -> bool:
        return any(r.status is C3Status.INCONCLUSIVE for r in self.surfaces)


class ExpertReplay:
    """Expert checks among expert peers; one instance per rank, driven by the handle's boundary."""

    def __init__(self, binding: MoEBinding, *, every: int, world_control: Any, rank: int,
                 reporter: Reporter | None, hosts: dict[int, str], catalog: Catalog | None = None,
                 comm_rule: StatisticalRule | None = None, confirm_rounds: int = 2) -> None:
        self.binding, self.every, self.rank = binding, every, rank
        self.hosts, self.reporter, self.catalog = hosts, reporter, catalog
        self.names = binding.names or [f"moe.{i}" for i in range(len(binding.layers))]
        self.local = len(binding.layers[0].experts)
        enum = [sorted(g) for g in binding.expert_peer_groups]
        self.peers = next(g for g in enum if rank in g)
        # Device data among the peers on the job's backend; objects (the exchange, the shape) on gloo.
        self.group, _ = dist.new_subgroups_by_enumeration(enum)
        self.ctrl, _ = dist.new_subgroups_by_enumeration(enum, backend="gloo")
        self.guard = DiagnosisGuard(world_control, rank=rank, reporter=reporter, hosts=hosts)
        self.checks = 0
        self.history: list[ExpertCheck] = []
        self._seen: dict[tuple[int, int], torch.Tensor] = {}  # (layer, expert) -> rows received last
        self._handles = [expert.register_forward_pre_hook(self._capture(li, ei))
                         for li, layer in enumerate(binding.layers) for ei, expert in enumerate(layer.experts)]
        self._replaying = False
        self.alltoall: AllToAllReplay | None = None
        if binding.ep_groups is not None:
            expert = binding.layers[0].experts[0]
            self.alltoall = AllToAllReplay(
                ep_groups=binding.ep_groups, expert_peers=self.peers, expert_group=self.group, expert_ctrl=self.ctrl,
                world_control=world_control, rank=rank, hosts=hosts, width=next(expert.parameters()).shape[0],
                rule=comm_rule or StatisticalRule(), confirm_rounds=confirm_rounds, device=device_of(expert))

    def _capture(self, li: int, ei: int) -> Any:
        def hook(_m: nn.Module, args: tuple) -> None:
            if not self._replaying and args and isinstance(args[0], torch.Tensor):
                self._seen[(li, ei)] = args[0].detach()  # the last call's rows (a reference, no copy)
        return hook

    # -- rotation -------------------------------------------------------------------------------------

    def representatives(self, li: int) -> list[int] | None:
        """The catalog's row counts for layer ``li`` (None: no catalog, replay the training shape)."""
        if self.catalog is None:
            return None
        position = self.binding.ep_position or 0
        return self.catalog.representatives(self.names[li], position) or None

    def rotation(self, check: int) -> tuple[int, int, int, int]:
        """(layer, local expert, representative index, source index) of ``check``, in mixed radix: every
        combination comes round within ``cycle x len(peers)`` checks, and one cycle covers every layer, local
        expert and representative once."""
        n_layers = len(self.binding.layers)
        li = check % n_layers
        ei = (check // n_layers) % self.local
        k = len(self.representatives(li) or [None])
        ri = (check // (n_layers * self.local)) % k
        si = (check // (n_layers * self.local * k)) % len(self.peers)
        return li, ei, ri, si

    @property
    def cycle(self) -> int:
        """Checks in one recipe cycle: every layer, local expert and representative once."""
        reps = self.representatives(0)
        return len(self.binding.layers) * self.local * (len(reps) if reps else 1)

    # -- one check -----------------------------------------------------------------------------------

    def boundary(self, step: int) -> ExpertCheck | None:
        """Run the check if one is due at ``step`` (every rank calls this at every boundary)."""
        if self.every <= 0 or step % self.every:
            return None
        check = self.checks
        self.checks += 1
        li, ei, ri, si = self.rotation(check)
        source = self.peers[si]
        reps = self.representatives(li)
        expert = self.binding.layers[li].experts[ei]
        device = device_of(expert)
        result = ExpertCheck(step, self.names[li], ei, -1, source)
        guard = self.guard
        guard.reset()
        box: list[Any] = [None]
        if self.rank == source:
            box[0] = guard.run("expert input", lambda: self._source_input(li, ei, reps[ri] if reps else None))
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return self._done(result)
        shape_box = [None if box[0] is None else (tuple(box[0].shape), str(box[0].dtype))]
        dist.broadcast_object_list(shape_box, src=source, group=self.ctrl)
        shape, dtype = shape_box[0]
        x = guard.run("expert input buffer", lambda: box[0].to(device) if box[0] is not None else torch.empty(
            shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device))
        if not guard.agree(step) or x is None:
            result.skipped = "diagnosis error"
            return self._done(result)
        dist.broadcast(x, src=source, group=self.group)
        result.rows = shape[0]
        evidence = guard.run("expert replay", lambda: self._replay(expert, x, check)) or []
        if not guard.agree(step):
            result.skipped = "diagnosis error"
            return self._done(result)
        tag = f"{self.names[li]}.experts.{ei}.rows{shape[0]}"
        result.surfaces = c3_exchange([v for _, v in evidence], group=self.ctrl,
                                      surfaces=[f"{tag}.{n}" for n, _ in evidence])
        if self.alltoall is not None:
            splits = guard.run("dispatch split sizes", lambda: self._splits(li))
            a2a, result.localization = self.alltoall.check(check, splits, guard, step)
            result.surfaces += a2a
        result.incidents = self._verdicts(result)
        return self._done(result)

    def _splits(self, li: int) -> list[int]:
        layer = self.binding.layers[li]
        splits = self.binding.splits(layer) if self.binding.splits is not None else layer.last_plan.in_splits
        return [int(x) for x in splits]

    def _source_input(self, li: int, ei: int, rows: int | None) -> torch.Tensor:
        seen = self._seen.get((li, ei))
        expert = self.binding.layers[li].experts[ei]
        width = next(p for p in expert.parameters()).shape[0]
        if rows is None:
            rows = 0 if seen is None else seen.shape[0]
        if seen is None or seen.shape[0] == 0:
            gen = torch.Generator().manual_seed(1_000_003 * li + ei)
            return torch.randn(rows, width, generator=gen)
        seen = seen.detach().to("cpu", copy=True)
        reps = -(-rows // seen.shape[0]) if rows else 0
        return seen.repeat(reps, 1)[:rows] if rows else seen[:0]

    def _replay(self, expert: nn.Module, x: torch.Tensor, check: int) -> list[tuple[str, Any]]:
        params = [p for p in expert.parameters() if p.requires_grad]
        self._replaying = True
        try:
            xi = x.detach().clone().requires_grad_(x.is_floating_point())
            out = expert(xi)
            gen = torch.Generator().manual_seed(7_919 * check + 17)
            grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
            grads = torch.autograd.grad([out], [xi, *params], grad_outputs=[grad_out], allow_unused=True) \
                if out.requires_grad else (None,) * (1 + len(params))
        finally:
            self._replaying = False
        groups = [("output", [out.detach()]), ("grad_input", [g for g in grads[:1] if g is not None]),
                  ("grad_param", [g for g in grads[1:] if g is not None])]
        out_sig = []
        for name, tensors in groups:
            if tensors:
                signed = sign_many([torch.cat([t.reshape(-1) for t in tensors])])[0]
                out_sig.append((name, (signed.signature, signed.nonfinite)))
        return out_sig

    def _verdicts(self, result: ExpertCheck) -> list[Incident]:
        by_ranks, groupwide = group_disagreements(result.surfaces)
        out = [self._incident(IncidentScope.RANK, ranks, rs, f"expert replay: {len(rs)} surface(s) differ from "
                              f"the strict majority of the expert's replicas ({result.rows} rows)")
               for ranks, rs in by_ranks.items()]
        if groupwide:
            out.append(self._incident(IncidentScope.PEER_GROUP, self.peers, groupwide,
                                      "expert replay: the expert's replicas disagree without a strict majority"))
        named = {r for i in out if i.scope is IncidentScope.RANK for r in i.ranks}
        reporter = min((r for r in self.peers if r not in named), default=min(self.peers))
        if out and self.rank == reporter and self.reporter is not None:
            for inc in out:
                inc.step = result.step
                self.reporter.emit(inc)
        loc = result.localization
        if loc is not None:  # the same on every rank: one record for the job
            machine = Incident(kind=IncidentKind.STRAGGLER, scope=IncidentScope(loc.scope), ranks=list(loc.ranks),
                               hosts=list(loc.hosts), step=result.step, surface="alltoall.comm_s",
                               evidence={"slow_groups": [[d, list(g)] for d, g in loc.slow_groups]},
                               reason=f"AllToAll replay with one plan: {loc.reason}")
            writer = min((r for r in range(dist.get_world_size()) if r not in loc.ranks), default=0)
            if self.rank == writer and self.reporter is not None:
                self.reporter.emit(machine)
            out.append(machine)
        return out

    def _incident(self, scope: IncidentScope, ranks: Sequence[int], results: Sequence[C3Result],
                  reason: str) -> Incident:
        return Incident(kind=IncidentKind.SDC, scope=scope, ranks=list(ranks), step=None,
                        hosts=[self.hosts.get(r, "?") for r in ranks],
                        surface=";".join(r.surface for r in results),
                        evidence={"surfaces": {r.surface: r.to_dict() for r in results}}, reason=reason)

    def _done(self, result: ExpertCheck) -> ExpertCheck:
        for inc in result.incidents:
            inc.step = result.step
        self.history.append(result)
        del self.history[:-1024]
        return result

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
