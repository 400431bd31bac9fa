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

Vetting (as the dense recipe's, :mod:`scout_core.replay.vetting`): in the first recipe cycle and every
``determinism_every``-th after it each peer replays twice and compares its own runs, and every check sends
the environment fingerprint; a rank that is not evidence is reported ``inconclusive`` once, never SDC.
:meth:`ExpertReplay.sweep` is the restart's emergency sweep over every expert and catalog shape.
One expert's run and signatures are in :mod:`scout_core.moe.expert_run`, the records a check makes in
:mod:`scout_core.moe.expert_verdicts`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scout_core.consensus import C3Result, C3Status, StatisticalRule, c3_exchange
from scout_core.moe.alltoall import AllToAllReplay
from scout_core.moe.binding import MoEBinding, expert_width
from scout_core.moe.catalog import Catalog
from scout_core.moe.expert_run import SWEEP_ROWS, expert_pass, seeded_rows, signed_surfaces
from scout_core.moe.expert_verdicts import ExpertCheck, ExpertVerdicts
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.health import FAILURES_BEFORE_OFF
from scout_core.replay.layer import device_of
from scout_core.replay.rng import RngProvider
from scout_core.replay.vetting import (
    ENVIRONMENT_SURFACE,
    REPRODUCIBLE_SURFACE,
    environment_fingerprint,
    set_aside,
    split_vetting,
    vet_due,
)
from scout_core.report import Incident, IncidentKind, IncidentScope, Reporter
from scout_core.wire import broadcast_data

__all__ = ["ExpertCheck", "ExpertReplay", "MoEBinding"]


class ExpertReplay:
    """Expert checks among expert peers; one instance per rank, driven by the handle's boundary."""

    def __init__(self, binding: MoEBinding, *, every: int, world_control: Any, rank: int,
                 reporter: Reporter | None, hosts: dict[int, str], catalog: Catalog | None = None,
                 comm_rule: StatisticalRule | None = None, confirm_rounds: int = 2,
                 determinism_every: int = 10, deterministic: bool = True,
                 rng_providers: dict[str, RngProvider] | None = None,
                 replay_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> None:
        self.binding, self.every, self.rank = binding, every, rank
        self.replay_context = replay_context  # the framework's, as around the dense recipe's checks
        self.hosts, self.reporter, self.catalog = hosts, reporter, catalog
        self.determinism_every, self.deterministic = determinism_every, deterministic
        self.rng_providers = dict(rng_providers or {})
        self.names = binding.names or [f"moe.{i}" for i in range(len(binding.layers))]
        self.experts = [binding.local_experts(m) for m in binding.layers]
        self.local = len(self.experts[0])
        self.position = binding.position(rank)
        enum = [sorted(g) for g in binding.expert_peer_groups]
        self.peers = next(g for g in enum if rank in g)
        # Device data among the peers on the job's backend; objects (the exchange, the shape) on gloo.
        self.group, _ = dist.new_subgroups_by_enumeration(enum)
        self.ctrl, _ = dist.new_subgroups_by_enumeration(enum, backend="gloo")
        self.world_control = world_control
        self.guard = DiagnosisGuard(world_control, rank=rank, reporter=reporter, hosts=hosts)
        self.checks = 0
        self.history: list[ExpertCheck] = []
        # One recipe cycle, the same on every rank (EP positions may have different numbers of catalog shapes,
        # and certification's K must agree job-wide).
        n = torch.tensor([len(self.experts) * self.local * self._max_representatives()], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=world_control)
        self._cycle = int(n.item())
        # The rows the next check's source replays: captured only on that rank, for that (layer, expert), as
        # a reference to the last call's input (no copy; one expert's rows held, never every expert's).
        self._seen: dict[tuple[int, int], torch.Tensor] = {}
        self._want: tuple[int, int] | None = None
        self._aim()
        self._handles = [binding.capture_module(expert).register_forward_pre_hook(self._capture(li, ei, expert),
                                                                                  with_kwargs=True)
                         for li, experts in enumerate(self.experts) for ei, expert in enumerate(experts)]
        self._replaying = False
        self._vet_always = False
        self._vet_until = 0  # checks before this one are vetted (a restored job knows nothing of its kernels)
        self._failures = 0  # checks in a row skipped by a diagnosis error
        self.disabled = False
        self._untrusted: dict[int, str] = {}
        self.verdicts = ExpertVerdicts(rank=rank, peers=self.peers, hosts=hosts, reporter=reporter)
        self._env: str | None = None
        self.alltoall: AllToAllReplay | None = None
        if binding.ep_groups is not None:
            self.alltoall = AllToAllReplay(
                ep_groups=binding.ep_groups, expert_peers=self.peers, expert_group=self.group, expert_ctrl=self.ctrl,
                world_control=world_control, rank=rank, hosts=hosts, width=self._width(0, 0),
                rule=comm_rule or StatisticalRule(), confirm_rounds=confirm_rounds,
                device=device_of(self.experts[0][0]), dtype=self._dtype(0, 0))

    def _capture(self, li: int, ei: int, expert: nn.Module) -> Any:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            if (li, ei) != self._want or self._replaying:
                return
            rows = self.binding.rows(expert, args, kwargs)
            if rows is not None:  # a copy: frameworks free or reuse their dispatch buffers
                self._seen[(li, ei)] = rows.detach().clone()
        return hook

    def _aim(self) -> None:
        """Capture for the next check only: its (layer, expert), on its source."""
        li, ei, _, si = self.rotation(self.checks)
        self._seen.clear()
        self._want = (li, ei) if self.peers[si] == self.rank else None

    def _width(self, li: int, ei: int) -> int:
        return expert_width(self.experts[li][ei], self.binding.hidden_size)

    def _dtype(self, li: int, ei: int) -> torch.dtype:
        """The dtype of the rows an expert takes: its first floating parameter's."""
        return next((p.dtype for p in self.experts[li][ei].parameters() if p.is_floating_point()), torch.float32)

    def state(self) -> dict[str, Any]:
        """The rotation and what vetting learnt, for snapshots: a restored job goes on where it was."""
        return {"checks": self.checks, "vet_always": self._vet_always,
                "untrusted": {str(r): why for r, why in self._untrusted.items()}}

    def load_state(self, saved: dict[str, Any]) -> None:
        self.checks = int(saved.get("checks", 0))
        self._vet_always = bool(saved.get("vet_always", False))
        self._untrusted = {int(r): str(why) for r, why in saved.get("untrusted", {}).items()}
        self.verdicts.reported = set(self._untrusted.items())
        self._vet_until = self.checks + self.cycle  # the machines may be new: vet one whole cycle again
        self._aim()

    # -- rotation -------------------------------------------------------------------------------------

    def representatives(self, li: int) -> list[int] | None:
        """The catalog's row counts for layer ``li`` (None: no catalog, replay the training shape)."""
        if self.catalog is None:
            return None
        return self.catalog.representatives(self.names[li], self.position) or None

    def rotation(self, check: int) -> tuple[int, int, int, int]:
        """(layer, local expert, representative index, source index) of ``check``, in mixed radix: every
        combination comes round within ``cycle x len(peers)`` checks, and one cycle covers every layer, local
        expert and representative once."""
        n_layers = len(self.experts)
        li = check % n_layers
        ei = (check // n_layers) % self.local
        ri = (check // (n_layers * self.local)) % len(self.representatives(li) or [None])
        si = (check // self.cycle) % len(self.peers)
        return li, ei, ri, si

    def _max_representatives(self) -> int:
        return max(len(self.representatives(li) or [None]) for li in range(len(self.experts)))

    @property
    def cycle(self) -> int:
        """Checks in one recipe cycle, the same on every rank: layers x local experts x the most representatives
        any layer has at any EP position. Any ``cycle`` consecutive checks replay every layer, local expert and
        representative at least once."""
        return self._cycle

    # -- one check -----------------------------------------------------------------------------------

    def boundary(self, step: int) -> ExpertCheck | None:
        """Run the check if one is due at ``step`` (every rank calls this at every boundary)."""
        if self.every <= 0 or step % self.every or self.disabled:
            return None
        check = self.checks
        self.checks += 1
        li, ei, ri, si = self.rotation(check)
        source = self.peers[si]
        reps = self.representatives(li)
        expert = self.experts[li][ei]
        device = device_of(expert)
        vet = vet_due(check, self.determinism_every, self._vet_always, self.cycle) or check < self._vet_until
        result = ExpertCheck(step, self.names[li], ei, -1, source, unit=check % self.cycle)
        guard = self.guard
        guard.reset()
        box: list[Any] = [None]
        if self.rank == source:
            box[0] = guard.run("expert input", lambda: self._source_input(li, ei, reps[ri] if reps else None))
        if not guard.agree(step):
            return self._skip(result)
        shape, dtype = broadcast_data(None if box[0] is None else (tuple(box[0].shape), str(box[0].dtype)),
                                      source, self.ctrl, what="expert input layout")
        x = guard.run("expert input buffer", lambda: box[0].to(device) if box[0] is not None else torch.empty(
            shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device))
        if not guard.agree(step) or x is None:
            return self._skip(result)
        dist.broadcast(x, src=source, group=self.group)
        result.rows = shape[0]
        with self._materialized(li):
            replayed = guard.run("expert replay", lambda: self._replay(expert, x, check, twice=vet))
        if not guard.agree(step) or replayed is None:
            return self._skip(result)
        evidence, reproducible = replayed
        tag = f"{self.names[li]}.experts.{ei}.rows{shape[0]}"
        evidence = [(f"{tag}.{n}", v) for n, v in evidence]
        if vet:
            evidence.append((REPRODUCIBLE_SURFACE, reproducible))
        evidence.append((ENVIRONMENT_SURFACE, self._environment(device)))
        surfaces = c3_exchange([v for _, v in evidence], group=self.ctrl, surfaces=[n for n, _ in evidence])
        self._vet(result, surfaces)
        if self.alltoall is not None:
            splits = guard.run("dispatch split sizes", lambda: self._splits(li))
            a2a, result.localization, result.transfers = self.alltoall.check(check, splits, guard, step)
            if a2a:
                result.surfaces += a2a
            else:  # the AllToAll part failed somewhere (every rank alike): this check's evidence is incomplete
                result.skipped = "AllToAll replay: diagnosis error"
        result.incidents = self.verdicts.judge(result)
        return self._done(result)

    @contextlib.contextmanager
    def _materialized(self, li: int) -> Iterator[None]:
        """Layer ``li``'s experts whole for the replay (``MoEBinding.materialize``, on every rank alike), inside
        the framework's replay context (Megatron's parameter-gather hooks off: they sit on the experts' modules
        too); a failure is kept by the guard (the replay then fails too, and the agreement skips the check)."""
        with self._framework_paused(), self._unsharded(li):
            yield

    @contextlib.contextmanager
    def _framework_paused(self) -> Iterator[None]:
        if self.replay_context is None:
            yield
            return
        # It may hold collectives (Megatron's parameter sync): every rank enters it, whatever failed before.
        ctx = self.guard.attempt("entering the framework's replay context", self.replay_context)
        entered = ctx is not None and self.guard.attempt("entering the framework's replay context",
                                                         lambda: ctx.__enter__() or True)
        try:
            yield
        finally:
            if entered:
                self.guard.attempt("leaving the framework's replay context", lambda: ctx.__exit__(None, None, None))

    @contextlib.contextmanager
    def _unsharded(self, li: int) -> Iterator[None]:
        if self.binding.materialize is None:
            yield
            return
        # The unshard is a collective: every rank runs it, whatever failed before on this rank (attempt, not run),
        # and its reshard always follows, or the next forward's FSDP all-gathers would pair up wrongly.
        release = self.guard.attempt("expert unshard", lambda: self.binding.materialize(self.binding.layers[li]))
        try:
            yield
        finally:
            if release is not None:
                self.guard.attempt("expert reshard", release)

    def _skip(self, result: ExpertCheck) -> ExpertCheck:
        result.skipped = "diagnosis error"
        return self._done(result)

    def _health(self, result: ExpertCheck) -> None:
        """A failure at every check (skips are agreed job-wide, so the streak is the same on every rank):
        after FAILURES_BEFORE_OFF in a row the expert recipe is switched off with one record, instead of a
        diagnosis_error at every check. Certification then waits for it forever: nothing vouches for the
        experts."""
        self._failures = self._failures + 1 if result.skipped else 0
        if self._failures < FAILURES_BEFORE_OFF:
            return
        self.disabled = True
        if self.rank == 0 and self.reporter is not None:
            self.reporter.emit(Incident(
                kind=IncidentKind.DIAGNOSIS_ERROR, scope=IncidentScope.JOB, ranks=[], hosts=[], step=result.step,
                surface="expert", evidence={"reason": "recipe_off"},
                reason=f"the expert recipe failed {self._failures} checks in a row and is switched off (see the "
                       "diagnosis_error records before this one); certification no longer vouches for any step"))

    def _splits(self, li: int) -> list[int]:
        layer = self.binding.layers[li]
        splits = self.binding.splits(layer) if self.binding.splits is not None else layer.last_plan.in_splits
        return [int(x) for x in splits]

    def _source_input(self, li: int, ei: int, rows: int | None) -> torch.Tensor:
        seen = self._seen.get((li, ei))
        if seen is not None:
            # As [rows, width] in the expert's dtype: a dispatch may hand 3-D or 4-D blocks (DeepSpeed's
            # [ep, 1, capacity, hidden]) or lower-precision rows; the rows are counted after the reshape.
            seen = seen.detach().reshape(-1, self._width(li, ei)).to("cpu", self._dtype(li, ei), copy=True)
        if rows is None:  # no catalog: the training shape, or SWEEP_ROWS seeded rows if none were routed here
            rows = seen.shape[0] if seen is not None and seen.shape[0] else SWEEP_ROWS
        if seen is None or seen.shape[0] == 0:
            return seeded_rows(li, ei, rows, self._width(li, ei), self._dtype(li, ei))
        reps = -(-rows // seen.shape[0]) if rows else 0
        return seen.repeat(reps, 1)[:rows] if rows else seen[:0]

    def _replay(self, expert: nn.Module, x: torch.Tensor, check: int, *, twice: bool = False
                ) -> tuple[list[tuple[str, Any]], bool]:
        """(evidence, reproducible): the expert's forward and backward on ``x`` signed; with ``twice``, run
        again and compare this rank's own two runs (replay compares bytes: a nondeterministic kernel is not
        evidence)."""
        first = self._replay_once(expert, x, check)
        if not twice:
            return first, True
        return first, self._replay_once(expert, x, check) == first

    def _replay_once(self, expert: nn.Module, x: torch.Tensor, check: int) -> list[tuple[str, Any]]:
        self._replaying = True
        try:
            out, grads = expert_pass(expert, x, check, self.rng_providers, deterministic=self.deterministic)
        finally:
            self._replaying = False
        return signed_surfaces(out, grads)

    def _environment(self, device: torch.device) -> str:
        if self._env is None:
            self._env = environment_fingerprint(device)
        return self._env

    def _vet(self, result: ExpertCheck, surfaces: list[C3Result]) -> None:
        """Take the vetting surfaces out; set aside every disagreement a rank that is not evidence (now or
        at any earlier check) takes part in, as the dense recipe does."""
        result.surfaces, result.untrusted = split_vetting(surfaces)
        if any(why == "nondeterministic" for why in result.untrusted.values()):
            self._vet_always = True
        self._untrusted.update({r: why for r, why in result.untrusted.items() if r not in self._untrusted})
        result.surfaces, result.unreliable = set_aside(result.surfaces, self._untrusted)

    # -- emergency sweep ---------------------------------------------------------------------------------

    def sweep(self, step: int) -> str:
        """Emergency sweep of the experts (paper section 8): every layer, local expert and catalog
        representative (without a catalog: ``SWEEP_ROWS`` rows) replayed once on seeded rows, identical on
        every expert peer without a transfer, and compared by exact C3 among the expert peers. Every rank of
        the job must call it. Returns ``"clean"``, ``"dirty"`` (SDC found and recorded) or ``"failed"`` (a
        local failure on some rank: nothing is claimed either way), the same on every rank."""
        guard = self.guard
        guard.reset()

        # Layer by layer: each layer's unshard (a collective) runs on every rank, whatever failed before on this
        # one; the replays are local work, skipped after a local failure; one agreement at the end.
        evidence: list[tuple[str, Any]] = []
        reproducible = True
        for li, experts in enumerate(self.experts):
            with self._materialized(li):
                for rows in self.representatives(li) or [SWEEP_ROWS]:
                    for ei, expert in enumerate(experts):
                        done = guard.run("expert sweep", lambda li=li, ei=ei, expert=expert, rows=rows: self._replay(
                            expert, seeded_rows(li, ei, rows, self._width(li, ei), self._dtype(li, ei)).to(
                                device_of(expert)), (1 << 20) + rows, twice=True))  # twice: kernels not yet vetted
                        if done is not None:
                            signed, again = done
                            reproducible = reproducible and again
                            tag = f"{self.names[li]}.experts.{ei}.rows{rows}"
                            evidence += [(f"{tag}.{n}", v) for n, v in signed]
        evidence.append((REPRODUCIBLE_SURFACE, reproducible))
        evidence.append((ENVIRONMENT_SURFACE, guard.run("expert sweep", lambda: self._environment(
            device_of(self.experts[0][0])))))
        if not guard.agree(step, "sweep"):
            guard.reset()
            return "failed"
        guard.reset()
        result = ExpertCheck(step, "sweep", -1, -1, -1)
        self._vet(result, c3_exchange([v for _, v in evidence], group=self.ctrl, surfaces=[n for n, _ in evidence]))
        bad = [r for r in result.surfaces if r.status is not C3Status.AGREE]
        # Evidence set aside (a rank not reproducible or in another environment) proves nothing either way.
        unproven = torch.tensor([1 if result.unreliable else 0], dtype=torch.int32)
        result.surfaces = bad
        incidents = self.verdicts.judge(result)
        for inc in incidents:
            inc.step = step
            inc.reason = "emergency sweep of the latest state: " + inc.reason
        flag = torch.tensor([1 if bad else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world_control)
        dist.all_reduce(unproven, op=dist.ReduceOp.MAX, group=self.world_control)
        return "dirty" if flag.item() else "failed" if unproven.item() else "clean"

    def _done(self, result: ExpertCheck) -> ExpertCheck:
        self._health(result)
        for inc in result.incidents:
            inc.step = result.step
        self.history.append(result)
        del self.history[:-1024]
        self._aim()
        return result

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()
        self._want = None

