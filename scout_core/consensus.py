"""Consensus Collective Communication (C3), paper section 5: one all-gather of local evidence over a process
group, and the same comparison rule applied on every member.

C3 maps one piece of evidence per peer to a result ``(status, bitmap, evidence)``. The comparison rules
(:func:`exact`, :func:`statistical`) are pure functions (:mod:`scout_core.consensus_rules`) so that every peer,
given the same gathered evidence, derives the same verdict without a coordinator. The transport
(:func:`c3_exchange`) all-gathers local evidence over a process group and applies the rule locally on every
member. Confirmation across rounds and the noise floor of timings are in :mod:`scout_core.confirmation`, the
persistently slower rank in :mod:`scout_core.persistence`. Every name of the four modules is importable from here.

Neither rule ever names a rank without a strict healthy majority.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

# Re-exported: the rules and the confirmation across rounds are C3's too, imported from here across the package.
from scout_core.confirmation import Confirmation, NoiseFloor, tail_floor
from scout_core.consensus_rules import (
    MAD_NORMAL_CONSISTENCY,
    C3Result,
    C3Status,
    StatisticalRule,
    exact,
    group_disagreements,
    statistical,
)
from scout_core.persistence import Persistence
from scout_core.wire import all_gather_data, encode

__all__ = [
    "C3Status",
    "C3Result",
    "exact",
    "statistical",
    "c3_compare",
    "c3_exchange",
    "c3_exchange_unless_failed",
    "SurfaceMismatch",
    "Confirmation",
    "Persistence",
    "group_disagreements",
    "MAD_NORMAL_CONSISTENCY",
    "NoiseFloor",
    "StatisticalRule",
    "tail_floor",
]


def c3_exchange(
    local_evidence: Sequence[Any],
    *,
    group: dist.ProcessGroup | None = None,
    surfaces: Sequence[str] | None = None,
    rule: str | StatisticalRule | Sequence[str | StatisticalRule] = "exact",
) -> list[C3Result]:
    """All-gather K pieces of local evidence in ONE exchange and return K results.

    Every member of ``group`` must call this with the same K and surfaces. The
    returned list is identical on every member because the same deterministic
    rule runs on the same gathered evidence. ``rule`` is ``"exact"`` or a
    :class:`StatisticalRule` applied to every surface, or one of those per surface
    (signatures and times in one exchange: a collective's latency is what a check pays).
    """
    local = list(local_evidence)
    names, rules = _names_and_rules(local, surfaces, rule)
    gathered = all_gather_data((names, local), group, what="evidence exchange")
    return c3_compare(gathered, names, rules, group=group)


def c3_exchange_unless_failed(
    local_evidence: Sequence[Any] | None,
    *,
    group: dist.ProcessGroup | None = None,
    surfaces: Sequence[str] | None = None,
    rule: str | StatisticalRule | Sequence[str | StatisticalRule] = "exact",
) -> list[C3Result] | None:
    """:func:`c3_exchange` that a member which already failed joins with ``None`` instead of its evidence: then
    no member compares and all return None (the exchange needs no agreement before it, one collective less; the
    agreement after it tells every member why). Evidence of this member's that cannot travel (not plain data,
    surfaces that do not match it) is sent as ``None`` too and raises here only, after the all-gather."""
    error: Exception | None = None
    if local_evidence is not None:
        try:  # this member's own evidence that cannot travel (bad arguments, not plain data) fails here alone
            local = list(local_evidence)
            names, rules = _names_and_rules(local, surfaces, rule)
            encode((names, local))
        except Exception as exc:  # noqa: BLE001 - re-raised below, after joining the all-gather
            error, local_evidence = exc, None
    # Every member joins the all-gather whatever happened before: its peers wait in it.
    gathered = all_gather_data(None if local_evidence is None else (names, local), group, what="evidence exchange")
    if error is not None:
        raise error
    if local_evidence is None or any(g is None for g in gathered):
        return None
    return c3_compare(gathered, names, rules, group=group)


def _names_and_rules(local: Sequence[Any], surfaces: Sequence[str] | None,
                     rule: str | StatisticalRule | Sequence[str | StatisticalRule]
                     ) -> tuple[list[str], list[str | StatisticalRule]]:
    k = len(local)
    names = list(surfaces) if surfaces is not None else [f"surface{i}" for i in range(k)]
    if len(names) != k:
        raise ValueError(f"{len(names)} surface names for {k} pieces of evidence")
    rules = list(rule) if isinstance(rule, (list, tuple)) else [rule] * k
    if len(rules) != k:
        raise ValueError(f"{len(rules)} rules for {k} pieces of evidence")
    return names, rules


class SurfaceMismatch(RuntimeError):
    """The members of one exchange sent different surfaces. Every member raises it with the same message, and only
    ``writer`` (the group's first rank) records it: one exchange, one record."""

    def __init__(self, message: str, writer: int) -> None:
        super().__init__(message)
        self.writer = writer


def c3_compare(gathered: Sequence[Any], names: Sequence[str], rules: Sequence[str | StatisticalRule], *,
               group: dist.ProcessGroup | None = None) -> list[C3Result]:
    """Every member's ``(surfaces, evidence)``, gathered in group rank order, compared surface by surface. Members
    that sent other surfaces make every member raise :class:`SurfaceMismatch` alike (not deadlock the group)."""
    names, k = list(names), len(names)
    peer_ranks = _group_ranks(group, len(gathered))
    sent: dict[tuple[tuple[str, ...], int], list[int]] = {}
    for peer, (peer_names, peer_local) in zip(peer_ranks, gathered):
        sent.setdefault((tuple(peer_names), len(peer_local)), []).append(peer)
    if list(sent) != [(tuple(names), k)]:
        told = "; ".join(f"ranks {ranks} sent {len(n)} surfaces {list(n)} with {m} values"
                         for (n, m), ranks in sent.items())
        raise SurfaceMismatch(f"C3 exchange mismatch: {told}", writer=peer_ranks[0])
    results = []
    for i, (name, how) in enumerate(zip(names, rules, strict=True)):
        column = [peer_local[i] for _, peer_local in gathered]
        if how == "exact":
            results.append(exact(column, peer_ranks=peer_ranks, surface=name))
        elif isinstance(how, StatisticalRule):
            results.append(how(column, peer_ranks=peer_ranks, surface=name))
        else:
            raise ValueError(f"unknown C3 rule {how!r}; use 'exact' or a StatisticalRule")
    return results


def _group_ranks(group: dist.ProcessGroup | None, world: int) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(world))
    return tuple(dist.get_process_group_ranks(group))
