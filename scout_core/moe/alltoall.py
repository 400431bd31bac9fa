"""AllToAll replay (paper section 6.2): one communication plan, executed by every EP group, compared across
replicas; its durations intersected across EP and expert-DP groups to name a machine.

Routing differs from replica to replica, so the AllToAll of training is never comparable: a replica whose
tokens went mostly to one expert sends more and takes longer without anything being wrong. Replay therefore
makes every EP group execute the *same* plan:

1. every rank contributes the split sizes of its last dispatch (``MoEBinding.splits``); one world
   all-gather gives every rank every EP group's send matrix, and all use the matrix of the EP group whose turn
   it is (rotating), so routing imbalance is the same everywhere;
2. each rank fills what it sends to each EP peer with rows seeded by (check, its EP position, the peer's):
   the same bytes at the same position in every replica; the exchange runs three times after a barrier on the
   EP group, and the fastest run is its time; a training-shaped all-reduce of the received rows over the
   expert peers (how expert gradients are synchronized) is timed the same way;
3. the rows received from each EP position are signed apart and compared exactly among the expert peers; one
   world all-gather of the odd transfers (receiver, sender) then names the fewest endpoints that explain them
   (corrupting senders and receivers; both endpoints of a transfer nothing else explains, scope
   ``peer_group``) (:func:`attribute_transfers`, ``sdc``);
   every rank's two times go to the same world all-gather as the plan of the next check:
   statistical C3 across the EP groups and across the expert-DP groups marks slow groups, and their
   intersection (:func:`~scout_core.topology.localize_slow_groups`) names the machine, confirmed over the
   consensus's confirmation rounds (``straggler``, scope ``machine``).

Hangs inside AllToAll stay with the observer (its fingerprint rule excludes split sizes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scout_core.consensus import C3Result, C3Status, StatisticalRule, c3_exchange
from scout_core.signature import sign_many
from scout_core.topology import GroupTiming, Localization, LocalizationStreak, localize_slow_groups
from scout_core.wire import all_gather_data

__all__ = ["AllToAllReplay", "TransferVerdict", "attribute_transfers"]


@dataclass(frozen=True)
class TransferVerdict:
    """Who corrupted AllToAll transfers: one rank (scope ``rank``) or the two endpoints of one transfer."""

    ranks: tuple[int, ...]
    scope: str
    transfers: tuple[tuple[int, int], ...]
    """The odd (receiver, sender) transfers it explains."""
    reason: str


def attribute_transfers(odd: set[tuple[int, int]],
                        carried: set[tuple[int, int]] | None = None) -> list[TransferVerdict]:
    """Name the endpoints of odd AllToAll transfers ``(receiver, sender)`` (each odd among the receiver's
    expert peers, i.e. the same transfer in the other replicas) with the fewest culprits.

    ``carried``: every transfer that moved rows (default: the odd ones). A sender is a candidate only if every
    transfer it sent is odd, a receiver only if every transfer it received is (a clean one contradicts it).
    Each group of odd transfers linked by shared ranks is explained by the fewest candidates (greedy, from
    each of the candidates that explain the most); if that explanation is unique, its culprits are named
    (scope ``rank``), otherwise, or if no candidates explain it, the endpoints of the group's transfers are
    named together (scope ``peer_group``: an endpoint or a link, no more can be told)."""
    clean = (set(carried) if carried is not None else set(odd)) - set(odd)
    out: list[TransferVerdict] = []
    for part in _linked(set(odd)):
        covers = _fewest_culprits(part, {s for _, s in clean}, {q for q, _ in clean})
        if covers is None:
            pairs = tuple(sorted(part))
            out.append(TransferVerdict(_ends(pairs), "peer_group", pairs, f"AllToAll replay: transfers between "
                                       f"ranks {list(_ends(pairs))} differ, and no one endpoint explains them "
                                       "(either endpoints or links)"))
            continue
        for role, rank, pairs in covers:
            ordered = tuple(sorted(pairs))
            verb = f"sent differs at {len(ordered)} receiver(s)" if role == "sender" else \
                f"received differs from {len(ordered)} sender(s)"
            out.append(TransferVerdict((rank,), "rank", ordered, f"AllToAll replay: what rank {rank} {verb}"))
    return sorted(out, key=lambda v: v.ranks)


def _linked(pairs: set[tuple[int, int]]) -> list[set[tuple[int, int]]]:
    """The odd transfers in groups that share ranks (one replica's AllToAll shares none with another's)."""
    parts: list[tuple[set[int], set[tuple[int, int]]]] = []
    for pair in sorted(pairs):
        joined = [p for p in parts if p[0] & set(pair)]
        ranks, members = set(pair), {pair}
        for p in joined:
            ranks |= p[0]
            members |= p[1]
            parts.remove(p)
        parts.append((ranks, members))
    return [m for _, m in parts]


def _fewest_culprits(part: set[tuple[int, int]], bad_senders: set[int], bad_receivers: set[int]
                     ) -> list[tuple[str, int, set[tuple[int, int]]]] | None:
    """The unique smallest greedy explanation of ``part`` (None: none, or several of one size)."""

    def cover(left: set[tuple[int, int]]) -> dict[tuple[str, int], set[tuple[int, int]]]:
        out: dict[tuple[str, int], set[tuple[int, int]]] = {}
        for q, s in left:
            if q not in bad_receivers:
                out.setdefault(("receiver", q), set()).add((q, s))
            if s not in bad_senders:
                out.setdefault(("sender", s), set()).add((q, s))
        return out

    def greedy(first: tuple[str, int]) -> list[tuple[str, int, set[tuple[int, int]]]] | None:
        left, chosen, pick = set(part), [], first
        while left:
            options = cover(left)
            if pick is None:
                if not options:
                    return None
                pick = min(options, key=lambda k: (-len(options[k]), k[1], k[0]))
            chosen.append((*pick, options[pick]))
            left -= options[pick]
            pick = None
        return chosen

    options = cover(part)
    if not options:
        return None
    most = max(len(v) for v in options.values())
    found = [c for c in (greedy(k) for k in sorted(options) if len(options[k]) == most) if c is not None]
    if not found:
        return None
    size = min(len(c) for c in found)
    smallest = {frozenset(rank for _, rank, _ in c) for c in found if len(c) == size}
    return next(c for c in found if len(c) == size) if len(smallest) == 1 else None


def _ends(pairs: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    return tuple(sorted({r for pair in pairs for r in pair}))


class AllToAllReplay:
    """The AllToAll check of one rank (collective: every rank of the job runs it at the same boundary)."""

    def __init__(self, *, ep_groups: Sequence[Sequence[int]], expert_peers: Sequence[int], expert_group: Any,
                 expert_ctrl: Any, world_control: Any, rank: int, hosts: dict[int, str], width: int,
                 rule: StatisticalRule, confirm_rounds: int, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.device = device or torch.device("cpu")
        self.dtype = dtype  # the experts' (a bf16 job moves bf16 rows)
        self.ep_groups = [sorted(g) for g in ep_groups]
        self.my_ep = next(g for g in self.ep_groups if rank in g)
        self.position = self.my_ep.index(rank)
        self.expert_peers = list(expert_peers)
        self.expert_group, self.expert_ctrl, self.world_control = expert_group, expert_ctrl, world_control
        self.rank, self.hosts, self.width = rank, hosts, width
        self.rule, self.confirm_rounds = rule, confirm_rounds
        self.ep_group, _ = dist.new_subgroups_by_enumeration(self.ep_groups)
        self.dp_groups = _partition_of(self.expert_peers, world_control)
        self.streak = LocalizationStreak()
        self._times: tuple[float, float] | None = None  # this rank's last (AllToAll, all-reduce) times

    def check(self, check: int, my_splits: Sequence[int] | None, guard: Any, step: int
              ) -> tuple[list[C3Result], Localization | None, list[TransferVerdict]]:
        """One check: exact comparison of the rows received from each EP position among expert peers, the
        endpoints of odd transfers (the same on every rank), and the localization of slow groups from the
        previous check's times (``None`` when nothing is slow or not yet confirmed). Local work runs under
        ``guard`` (the job-wide diagnosis guard); if it fails anywhere, every rank skips the exchange
        together."""
        mine = None if my_splits is None else [int(x) for x in my_splits]
        everyone = all_gather_data((mine, self._times), self.world_control, what="AllToAll splits")
        loc = self._localize([t for _, t in everyone]) if all(t is not None for _, t in everyone) else None
        owner = self.ep_groups[check % len(self.ep_groups)]
        built = guard.run("AllToAll plan", lambda: self._build(check, [everyone[r][0] for r in owner], owner))
        if not guard.agree(step) or built is None:
            self._times = None  # nothing measured now: the next round must not count these times twice
            return [], loc, []
        send, received, reduced, in_splits, out_splits = built
        t_a2a = t_ar = float("inf")
        for _ in range(3):  # the fastest of three: a slow endpoint is slow every time, a hiccup once
            dist.barrier(group=self.ep_group)
            start = time.perf_counter()
            dist.all_to_all_single(received, send, out_splits, in_splits, group=self.ep_group)
            _sync(self.device)  # on a GPU the collective has finished, not just been enqueued
            t_a2a = min(t_a2a, time.perf_counter() - start)
            reduced[: received.shape[0]].copy_(received)
            dist.barrier(group=self.expert_group)
            start = time.perf_counter()
            dist.all_reduce(reduced, group=self.expert_group)
            _sync(self.device)
            t_ar = min(t_ar, time.perf_counter() - start)
        self._times = (t_a2a, t_ar)
        signed = sign_many(list(torch.split(received, out_splits)))  # one signature per sending position
        results = c3_exchange([(x.signature, x.nonfinite) for x in signed], group=self.expert_ctrl,
                              surfaces=[f"alltoall.plan{owner[0]}.from{i}" for i in range(len(out_splits))])
        mine = [(self.rank, self.my_ep[i]) for i, r in enumerate(results)
                if r.status is C3Status.ATTRIBUTED and self.rank in r.outlier_ranks]
        odd = all_gather_data(mine, self.world_control, what="AllToAll outliers")
        plan = [everyone[r][0] for r in owner]  # every EP group ran this plan: which transfers moved rows
        carried = {(g[j], g[i]) for g in self.ep_groups for i in range(len(g)) for j in range(len(g)) if plan[i][j]}
        return results, loc, attribute_transfers({tuple(t) for ts in odd for t in ts}, carried)

    def _build(self, check: int, plan: list[Any], owner: list[int]) -> tuple[torch.Tensor, ...] | Any:
        """The send buffer, the receive buffer and a fixed-size all-reduce payload for ``plan`` (``plan[i][j]``:
        rows EP position i sends to position j). The all-reduce payload has the plan's largest receive size
        at every position, so expert-DP groups compare equal work whatever their position receives."""
        n = len(self.my_ep)
        if len(plan) != n or any(row is None or len(row) != n for row in plan):
            raise ValueError(f"split sizes of EP group {owner} do not form a {n}-square plan: {plan}")
        send = torch.cat([_rows(check, self.position, j, plan[self.position][j], self.width)
                          for j in range(n)]).to(self.device, self.dtype)
        out_splits = [plan[i][self.position] for i in range(n)]
        largest = max(sum(plan[i][p] for i in range(n)) for p in range(n))
        received = torch.empty(sum(out_splits), self.width, device=self.device, dtype=self.dtype)
        reduced = torch.zeros(largest, self.width, device=self.device, dtype=self.dtype)
        return send, received, reduced, list(plan[self.position]), out_splits

    def _localize(self, times: list[tuple[float, float]]) -> Localization | None:
        observations = []
        for dim, groups, col in (("ep", self.ep_groups, 0), ("expert_dp", self.dp_groups, 1)):
            group_times = [max(times[r][col] for r in g) for g in groups]  # a collective ends with its slowest
            res = self.rule(group_times, peer_ranks=list(range(len(groups))), surface=f"alltoall.{dim}_s")
            observations += [GroupTiming(dim, tuple(g), bool(b)) for g, b in zip(groups, res.bitmap, strict=True)]
        loc = localize_slow_groups(observations, {r: self.hosts.get(r, "?") for r in range(len(times))})
        return loc if self.streak.update(loc) == self.confirm_rounds else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rows(check: int, src: int, dst: int, n: int, width: int) -> torch.Tensor:
    """The rows position ``src`` sends position ``dst`` in ``check``: identical in every replica."""
    gen = torch.Generator().manual_seed((check * 1_000_003 + src * 1_009 + dst) % (2**63))
    return torch.randn(n, width, generator=gen)


def _partition_of(mine: Sequence[int], control: Any) -> list[list[int]]:
    """Every group of a partition, from each rank's own (one world all-gather)."""
    everyone = all_gather_data(sorted(mine), control, what="group memberships")
    return [list(g) for g in dict.fromkeys(tuple(g) for g in everyone)]
