"""The emergency sweep (paper section 8): replay every layer on the newest saved calls before a restart.

It also keeps those calls (the newest replayed call per recipe, :attr:`EmergencySweep.calls`), which every
snapshot stores with the schedule so that a restored job sweeps and rotates on from where it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from scout_core.consensus import C3Status, c3_exchange
from scout_core.groups import ScoutGroups
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.recipe import RecipeRunner
from scout_core.replay.result import BoundaryResult
from scout_core.replay.saved import call_from_dict, call_to_dict, to_device
from scout_core.replay.scratch import module_compute_device
from scout_core.replay.shipping import ShippedCall
from scout_core.replay.trust import Trust
from scout_core.replay.verdicts import VerdictContext, peer_writer, sdc_verdicts
from scout_core.report import Incident

__all__ = ["EmergencySweep"]


class EmergencySweep:
    """The saved calls of one engine and the sweep that replays every layer on them."""

    def __init__(self, recipes: RecipeRunner, guard: DiagnosisGuard, groups: ScoutGroups, *,
                 extra: Mapping[str, int]) -> None:
        self.recipes = recipes
        self.guard = guard
        self.groups = groups
        self.extra = extra  # boundary recipe -> its layer index
        self.calls: dict[str, tuple[ShippedCall, int]] = {}
        """The newest replayed call per recipe (identical on every peer): the sweep's inputs."""
        self.unreadable: str | None = None
        """Why a restored snapshot's saved call could not be read (the sweep then fails on every rank)."""

    def saved_calls(self) -> dict[str, Any]:
        """The calls as a snapshot stores them (weights-only safe)."""
        return {recipe: call_to_dict(call, idx) for recipe, (call, idx) in self.calls.items()}

    def load_calls(self, saved: Mapping[str, Any]) -> None:
        """The restored snapshot's calls. One that does not read as SCOUT data (tampered, truncated, or pickled
        by an older release) is left out and named: the sweep then fails on every rank together, so the
        latest state is not proven clean, and nothing in it runs."""
        self.calls, self.unreadable = {}, None
        for recipe, d in saved.items():
            try:
                self.calls[recipe] = call_from_dict(d)
            except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is left out and named
                self.unreadable = f"the saved call of {recipe} cannot be read: {e}"

    def _work(self) -> list[tuple[int, ShippedCall]]:
        """Every layer with a saved call of its kind: each repeated layer on its class's call, embedding, head."""
        if self.unreadable is not None:
            raise ValueError(self.unreadable)
        layers, work = self.recipes.layers, []
        for recipe, (call, idx) in sorted(self.calls.items()):
            if recipe.startswith("hidden"):
                kind = type(layers[idx])
                work += [(i, call) for i in range(self.recipes.n_hidden) if type(layers[i]) is kind]
            elif recipe in self.extra:
                work.append((self.extra[recipe], call))
        return work

    def run(self, ctx: VerdictContext, trust: Trust, emit: Callable[[Sequence[Incident]], None]) -> str:
        """Replay EVERY layer on the newest saved calls and compare with exact C3 across peers. Every rank of
        the job must call it. Returns ``"clean"``, ``"dirty"`` (SDC found and recorded) or ``"failed"`` (nothing
        saved to replay, or a local failure on some rank: the latest state is not proven clean, and no SDC is
        claimed)."""
        guard, recipes, step = self.guard, self.recipes, ctx.step
        # Local work, before the first collective: a rank whose listing raises takes part with nothing to
        # replay, and the first agreement below ends the sweep on every rank.
        work = guard.run("listing the sweep's layers", self._work) or []
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
                prepared = guard.run(f"sweep inputs of {recipes.names[idx]}", lambda c=call, i=idx: (
                    to_device(c, module_compute_device(recipes.layers[i])),
                    recipes.reserve(i, timed=False, headroom=recipes.unshard_bytes(i, guard))))
            # One agreement per layer, before its collectives: a local failure (out of memory moving the
            # inputs or reserving the unshard) ends the sweep on every rank together.
            if not guard.agree(step, "sweep"):
                break
            if item is not None and prepared is not None:
                evidence += recipes.replay(item[0], *prepared, guard, timed=False).surfaces
        ok = guard.agree(step, "sweep")
        guard.reset()
        if not ok or not work:
            return "failed"
        results = c3_exchange([v for _, v in evidence], group=self.groups.peer_control,
                              surfaces=[n for n, _ in evidence])
        swept = BoundaryResult(step, surfaces=results)
        trust.set_aside(swept)  # a rank known not to be evidence makes no SDC in a sweep either
        bad = [r for r in swept.surfaces if r.status is not C3Status.AGREE]
        if swept.unreliable and not bad:
            return "failed"  # disagreements set aside prove nothing either way: the latest state is not shown clean
        if bad:
            incidents = sdc_verdicts(ctx, BoundaryResult(step, surfaces=bad))
            for inc in incidents:
                inc.reason = "emergency sweep of the latest state: " + inc.reason
            if ctx.rank == peer_writer(ctx.peers, incidents):
                emit(incidents)
        return "dirty" if bad else "clean"
