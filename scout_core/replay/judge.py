"""The timing judge: one round's replay times through noise floors and confirmation into straggler findings.

Compute times are compared across peers (job-wide under HSDP) beyond each kind of work's noise floor and
confirmed over consecutive rounds, or found persistently slower than the same rounds' peers
(:class:`~scout_core.persistence.Persistence`, for a straggler too mild for the floor); communication is judged by
:class:`~scout_core.replay.timing.CommTiming`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scout_core.consensus import C3Result, Confirmation, NoiseFloor, Persistence
from scout_core.replay.recipe import Replayed
from scout_core.replay.result import BoundaryResult
from scout_core.replay.timing import CommTiming
from scout_core.replay.verdicts import TimingFindings

__all__ = ["TimingJudge"]


class TimingJudge:
    """Noise floors and straggler confirmation of one rank's replay engine (identical on every peer)."""

    def __init__(self, comm: CommTiming, *, confirm_rounds: int, noise_window: int,
                 persistence: Persistence | None = None) -> None:
        self.comm = comm
        self.confirm = Confirmation(rounds=confirm_rounds)
        self.persist = persistence if persistence is not None else Persistence(rounds=0)
        self.by_floor: tuple[int, ...] = ()
        """Ranks the floor's path newly confirmed in the last round, in no episode of either path before it."""
        self.by_persistence: tuple[int, ...] = ()
        """Ranks only the persistence path newly named in the last round, in no episode before it."""
        # A compute straggler must also stray further than healthy ranks lately did (a host clock's heavy
        # tail would otherwise confirm healthy ranks now and then): one noise floor per kind of work.
        self.noise_window = noise_window
        self.noise: dict[Any, NoiseFloor] = {}

    def judge(self, result: BoundaryResult, times: C3Result, comm: C3Result, replayed: Replayed,
              peers: Sequence[int]) -> None:
        """Judge one timing round (``times``: replayed compute, ``comm``: the timed collective) into ``result``."""
        work = replayed.work
        # Communication time is a property of a synchronizing group, not of one member (paper
        # Figure 2c): it is never attributed to a rank. It feeds the group's temporal check and,
        # where a rank sits in groups of two dimensions (HSDP), the cross-group intersection.
        if replayed.hsdp_comm is not None:
            # HSDP: compute is judged job-wide in every round (a round whose ranks replayed different
            # work is "no measurement" for all), so every rank keeps the same confirmation counts.
            result.localization, times = self.comm.cross_group(*replayed.hsdp_comm, work=(work, replayed.compute_s))
            result.timing_world = True
        # One floor per layer class and parameter shapes: the rotation's layers of one class are one
        # work, and input shapes may change every step (ratios to the median cancel their size).
        kind = work[1:3] if work else None
        floor = self.noise.setdefault(kind, NoiseFloor(self.noise_window))
        named_before = self._named(times)
        # A rank slower than the same round's peers in every round, too mildly for the floor (judged on the
        # rule's evidence before the floor clears anything).
        persistent = self.persist.update(times, kind=kind)
        times, result.noise_floor = floor.apply(times)
        result.timing, result.comm_timing = times, comm
        # Counted per kind of work too: checks that alternate kinds (an MoE block's attention and router)
        # must not reset the streak of a rank slow in only one of them.
        confirmed = self.confirm.update(times, kind=kind)
        result.stragglers = tuple(sorted({*confirmed, *persistent}))
        result.persistent = dict(self.persist.means)
        # One record per episode, whichever path names the rank first; the record says which path it was.
        floor_new = {r for r in times.outlier_ranks if r in self.confirm.newly} - named_before
        persist_new = set(self.persist.newly) - named_before - floor_new
        self.by_floor = tuple(r for r in times.peer_ranks if r in floor_new)
        self.by_persistence = tuple(r for r in times.peer_ranks if r in persist_new)
        # The temporal check judges a collective that spans exactly the peer group. Under HSDP the
        # timed unshard spans the shard group, not the peers (a replica group): its slowness is the
        # cross-group intersection's to place, never this group's.
        if replayed.comm_ranks == tuple(peers):
            result.group_slowdown = self.comm.group_slowdown(comm)

    def findings(self, result: BoundaryResult) -> TimingFindings | None:
        """What is confirmed after the round judged into ``result`` (None: no timing round in this check)."""
        if result.timing is None:
            return None
        return TimingFindings(
            new_stragglers=tuple(r for r in result.timing.peer_ranks
                                 if r in self.by_floor or r in self.by_persistence),
            by_persistence=self.by_persistence, rounds=self.confirm.rounds, persist_rounds=self.persist.rounds,
            machine_confirmed=self.comm.loc_rounds == self.confirm.rounds,
            group_slowdown_confirmed=self.comm.slow_group_rounds == self.comm.temporal_rounds)

    def _named(self, times: C3Result) -> set[int]:
        """Ranks in an episode either path has already recorded on this surface."""
        return {r for r in times.peer_ranks
                if self.confirm.naming(times.surface, r) or self.persist.naming(times.surface, r)}
