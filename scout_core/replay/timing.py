"""Communication timing of replay (paper sections 6.1 and 6.1.2): who is slow, a rank, a group or a machine.

Communication time belongs to a synchronizing group, never to one member (paper
Figure 2c). :class:`CommTiming` keeps what the judgement needs across rounds:

* a group spanning every peer is compared with its own clean history
  (:meth:`CommTiming.group_slowdown`), because no peer is an outlier when every
  peer waits for the slow one;
* under HSDP a training-shaped reduce-scatter (shard group) and replica
  all-reduce are timed for every rank (:func:`time_hsdp_collectives`), slow
  groups of each dimension are found across groups, and their intersection names
  a machine (:meth:`CommTiming.cross_group`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from scout_core.consensus import C3Result, C3Status, NoiseFloor, StatisticalRule, tail_floor
from scout_core.replay.layer import sync
from scout_core.topology import GroupTiming, LocalizationStreak, localize_slow_groups
from scout_core.wire import all_gather_data

__all__ = ["BASELINE_ROUNDS", "CommTiming", "job_wide_compute", "mesh_groups", "time_hsdp_collectives"]

BASELINE_ROUNDS = 10
"""Measured communication rounds a group needs before its own history can call it slow."""

TEMPORAL_EXTRA_ROUNDS = 1
"""A group is called slow against its own history only after ``consensus.confirm_rounds`` + this many slow
rounds in a row. Spatial consensus compares peers of the same round, so noise that slows the whole host cancels
out; a temporal check has no such reference, and host-wide noise reaches it whole. A clean 4-rank TorchTitan job
on this 2-core host was once called slow at two rounds: its group times are 4-9 ms with one round in twenty near
16 ms, and two such rounds in a row beat a short history (tests/test_comm_timing.py, its measured times drawn
at random: at two rounds 99 of 2,000 runs of 30 judged rounds call the group slow, at three 3)."""

TAIL_MULTIPLE = 1.0
"""A group is slow only beyond ``1 + TAIL_MULTIPLE x (q99 - 1)`` of its own history's ratios to their median
(:func:`scout_core.consensus.tail_floor`): with 1.0, slower than every reading of its last rounds but the
largest. Under the measured noise of tests/test_comm_timing.py a larger multiple (3, the compute noise floor's)
missed a sustained 4x slowdown in 71 % of runs and 8x in 42 %; with 1.0, 9 % and none."""


class CommTiming:
    """Communication judgements of one rank's replay engine, identical on every peer."""

    def __init__(self, rule: StatisticalRule, confirm_rounds: int, *, world_control: Any,
                 hosts: Mapping[int, str], compute_rule: StatisticalRule | None = None, window: int = 64) -> None:
        self.rule = rule
        self.compute_rule = compute_rule or StatisticalRule()
        self.confirm_rounds = confirm_rounds
        self.temporal_rounds = confirm_rounds + TEMPORAL_EXTRA_ROUNDS
        self.world_control = world_control
        self.hosts = dict(hosts)
        # Group medians of recent rounds that were no slowdown, isolated slow readings included once their streak
        # broke off unconfirmed: they are the clock's tail, and a history without them never learns it.
        self.baseline: deque[float] = deque(maxlen=max(window, BASELINE_ROUNDS))
        self._streak: list[float] = []  # the readings of the slow streak in progress
        self.slow_group_rounds = 0
        self.streak = LocalizationStreak()
        # HSDP groups compared with each other: the compute noise floor's rule, per dimension (a clean 16-rank
        # HSDP job on this host once had one shard group's reduce-scatters read slow twice in a row).
        self.group_floors = {dim: NoiseFloor(window) for dim in ("shard", "replica")}

    def scratch_all_reduce(self, layer: torch.nn.Module, group: Any, scratch: torch.Tensor,
                           repeats: int = 2) -> float:
        """Time a training-shaped all-reduce (the sampled layer's gradient size) on a scratch tensor.

        ``scratch`` comes from :func:`~scout_core.replay.scratch.reserve`, allocated before the ranks
        agreed to run the check. First a one-element all-reduce on the same group (a slice of the scratch):
        it absorbs the members' arrival skew (their replays take different times) at a small collective's
        cost, and an all-reduce ends on its members within a message of each other, so the timed runs start
        together. Then the fastest of ``repeats`` runs: a slow link or endpoint is slow every time, while a
        scheduler hiccup on a loaded host delays one run, so the minimum keeps the first and drops the second.
        A full run to absorb the skew would cost as much as the check's replayed passes on a 2-core host. The
        spread of one, two and three aligned runs: ``python benchmarks/replay_stages.py --probe-runs``.
        """
        dist.all_reduce(scratch.view(-1)[:1], group=group)  # not timed: the members arrive here apart
        best = float("inf")
        for _ in range(repeats):
            sync([scratch])  # the scratch's device (a layer without trainable parameters has one too)
            start = time.perf_counter()
            dist.all_reduce(scratch, group=group)
            sync([scratch])
            best = min(best, time.perf_counter() - start)
        return best

    def all_reduce_due(self, check: int, every: int, layers: int = 1) -> bool:
        """Whether this rank asks check ``check`` to time the scratch all-reduce (``replay.comm_timing_every``):
        every check while the group's history is learned (``BASELINE_ROUNDS``) or its readings run slow, else
        every ``every``-th. The history and the streak come from the exchanged readings, so every peer asks
        alike; the agreement before the check's collectives still decides for all (timed where any asked:
        :meth:`~scout_core.replay.guard.DiagnosisGuard.agree_and_ask`), so no rank can wait in it alone.

        ``layers``: the rotation's length (check ``c`` samples layer ``c % layers``). Where it shares a factor
        with ``every`` the timed checks shift by one each rotation, so every layer's all-reduce size is timed in
        turn (else with 6 layers and ``every`` = 2 only the even layers' would be, ever); where a rotation ends,
        two checks in a row then time none.

        A check without it sends no communication time (no measurement: the history and the streak stay
        as they are), so a slowdown that starts between two timed checks reads slow at the next one, and from
        there every check is timed: its verdict comes at most one check later than with ``every`` = 1 (two
        where a rotation ends).
        """
        slot = check + (check // layers if math.gcd(layers, every) > 1 else 0)
        return (every <= 1 or slot % every == 0 or len(self.baseline) < BASELINE_ROUNDS
                or self.slow_group_rounds > 0)

    def cross_group(self, t_rs: float, t_ar: float, shard_pg: Any, repl_pg: Any, *,
                    work: tuple[Any, float | None] = (None, None)) -> tuple[Any, C3Result]:
        """Intersect slow shard groups and slow replica groups to name a machine (paper section 6.1.2),
        and judge replayed compute across the whole job.

        One world all-gather of every rank's two timings; a group's time is its slowest
        member's (a synchronizing collective ends with it); statistical C3 across the groups
        of one dimension marks slow groups. The same verdict in consecutive rounds confirms it.

        ``work`` is this rank's (what it replayed, its compute time), carried by the same all-gather.
        Where every rank replayed the same work (one layer, one input shape: HSDP peer groups rotate in
        step), all compute times are comparable, and the job-wide comparison (returned, else None) has
        every rank as a peer instead of one replica group's few: a 1.3x rank among 16 stands out where
        among 8 one noisy round hides it. Otherwise (ranks replayed different layers or shapes) the round is
        "no measurement" for every rank (:func:`job_wide_compute`), never a mix of job-wide and group rounds.
        """
        timings = all_gather_data((t_rs, t_ar, *work), self.world_control, what="timings")
        return self._localize(timings, shard_pg, repl_pg), job_wide_compute(timings, self.compute_rule)

    def _localize(self, timings: list[Any], shard_pg: Any, repl_pg: Any) -> Any:
        world = len(timings)
        shard_groups = _all_groups(shard_pg, self.world_control)
        repl_groups = _all_groups(repl_pg, self.world_control)
        observations = []
        for dim, groups, col in (("shard", shard_groups, 0), ("replica", repl_groups, 1)):
            group_times = [max(timings[r][col] for r in g) for g in groups]
            res = self.rule(group_times, peer_ranks=list(range(len(groups))), surface=f"replay.{dim}_comm_s")
            res, _ = self.group_floors[dim].apply(res)
            observations += [GroupTiming(dim, tuple(g), bool(b)) for g, b in zip(groups, res.bitmap, strict=True)]
        hosts = {r: self.hosts.get(r, "?") for r in range(world)}
        loc = localize_slow_groups(observations, hosts)
        return None if self.streak.update(loc) == 0 else loc

    @property
    def loc_rounds(self) -> int:
        """Consecutive rounds the current localization has been named."""
        return self.streak.rounds

    def group_slowdown(self, comm: C3Result) -> bool:
        """Temporal reference for what spatial consensus cannot see: the whole group slower.

        A collective spanning every peer makes every peer wait for a slow member, so
        no peer is an outlier. The group's median is compared with the distribution of
        its own clean rounds by the same robust rule as the spatial one (median plus
        kappa robust sigmas of the history, with the ratio and absolute floors) and beyond the
        tail of that history (``TAIL_MULTIPLE``): a noisy history widens the threshold instead of
        producing verdicts. It needs ``BASELINE_ROUNDS`` rounds of history first and is confirmed over
        one round more than a straggler (``TEMPORAL_EXTRA_ROUNDS``).
        """
        if comm.status is C3Status.NO_MEASUREMENT:
            return False  # not evidence: the count and the clean history stay as they are
        median = float(comm.reference)
        history = sorted(self.baseline)
        slow = False
        if len(history) >= BASELINE_ROUNDS:
            base = history[len(history) // 2]
            deviations = sorted(abs(h - base) for h in history)
            scale = max(deviations[len(deviations) // 2] * 1.4826, self.rule.mad_floor_fraction * base)
            threshold = max(base + self.rule.kappa * scale, base * self.rule.min_ratio, base + self.rule.min_delta)
            if base > 0:
                threshold = max(threshold, base * tail_floor([h / base for h in history], TAIL_MULTIPLE))
            slow = median > threshold
        # Every measured round's median joins the history, also one in which a peer's own reading stood out
        # (attributed or inconclusive): the median is still the group's time. Keeping only the rounds where the
        # peers agreed kept the calm rounds (a loaded host is what scatters the peers' readings), so the history
        # learned too narrow a tail and later noisy rounds read slow: a clean 16-rank DDP job was once called
        # slow, and two rounds left out of an FSDP2 job's first eleven delayed its history past a real slowdown.
        if slow:
            self.slow_group_rounds += 1
            self._streak.append(median)
        else:
            if self.slow_group_rounds < self.temporal_rounds:
                self.baseline.extend(self._streak)  # an unconfirmed streak was noise: part of the history
            self._streak.clear()
            self.slow_group_rounds = 0
            self.baseline.append(median)
        return self.slow_group_rounds >= self.temporal_rounds


def job_wide_compute(timings: list[Any], rule: StatisticalRule) -> C3Result:
    """Statistical C3 of every rank's compute time from the gathered ``(t_rs, t_ar, work, compute_s)``,
    or "no measurement" for all when the ranks did not replay the same work (or some replayed nothing)."""
    ranks = list(range(len(timings)))
    same = timings[0][2] is not None and all(t[2] == timings[0][2] for t in timings)
    values = [t[3] for t in timings] if same else [None] * len(timings)
    return rule(values, peer_ranks=ranks, surface="replay.compute_s")


def mesh_groups(layer: torch.nn.Module) -> tuple[Any, Any] | None:
    """(shard group, replica group) of an HSDP-managed layer, else None: EVERY parameter lives on one 2-D
    mesh, replicated over one dimension and sharded over the other. A layer where some parameter differs
    (tensor parallelism with sequence-parallel norms, DDP plus TP) is not HSDP."""
    found = None
    for p in layer.parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or mesh.ndim != 2:
            return None
        shard = [d for d, pl in enumerate(placements) if pl.is_shard()]
        repl = [d for d, pl in enumerate(placements) if pl.is_replicate()]
        if len(shard) != 1 or len(repl) != 1:
            return None
        key = (id(mesh), shard[0], repl[0])
        if found is not None and found[0] != key:
            return None
        found = (key, mesh)
    if found is None:
        return None
    (_, shard_dim, repl_dim), mesh = found
    return mesh.get_group(shard_dim), mesh.get_group(repl_dim)


_GROUPS_OF: dict[Any, list[list[int]]] = {}


def _all_groups(pg: Any, control: Any) -> list[list[int]]:
    """Every group of the same dimension as ``pg`` (one world all-gather of memberships, then cached)."""
    if pg not in _GROUPS_OF:
        mine = sorted(dist.get_process_group_ranks(pg))
        everyone = all_gather_data(mine, control, what="group memberships")
        _GROUPS_OF[pg] = [list(g) for g in dict.fromkeys(tuple(g) for g in everyone)]
    return _GROUPS_OF[pg]


def time_hsdp_collectives(layer: torch.nn.Module, scratch: tuple[torch.Tensor, torch.Tensor]
                          ) -> tuple[float, float, Any, Any] | None:
    """HSDP: a training-shaped reduce-scatter (shard group) then replica all-reduce, on scratch tensors
    reserved before the ranks agreed to run the check (:func:`~scout_core.replay.scratch.reserve`)."""
    groups = mesh_groups(layer)
    if groups is None:
        return None
    shard_pg, repl_pg = groups
    full, shard = scratch
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    # The fastest of three runs each: a slow link is slow every time, a scheduler hiccup on a loaded host delays
    # one run. The three runs of one collective follow each other with no barrier: the first absorbs the
    # members' arrival skew (after a replay, or after the other dimension's runs, where a slow shard group
    # finishes late), the next two start together.
    t_rs = t_ar = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        reduce_scatter(shard, full, group=shard_pg)
        sync([shard])
        t_rs = min(t_rs, time.perf_counter() - start)
    for _ in range(3):
        start = time.perf_counter()
        dist.all_reduce(shard, group=repl_pg)
        sync([shard])
        t_ar = min(t_ar, time.perf_counter() - start)
    return t_rs, t_ar, shard_pg, repl_pg
