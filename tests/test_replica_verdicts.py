"""The replica comparison's verdicts (verdicts.replica_verdicts), decided from one exchange's results alone."""

from __future__ import annotations

from types import SimpleNamespace

from scout_core.consensus import C3Result, C3Status
from scout_core.replay.engine import REPLICA_UNTRUSTED, REPLICATED_STATE, BoundaryResult
from scout_core.replay.verdicts import VerdictContext, replica_verdicts

RANKS = (0, 1, 2, 3)


def result(surface: str, values: tuple, ranks: tuple[int, ...] = RANKS) -> C3Result:
    """An exact C3 result over ``ranks`` as c3_exchange computes it: the strict majority's value, the others set."""
    majority = next((v for v in values if values.count(v) * 2 > len(values)), None)
    if majority is None:
        status, bitmap = (C3Status.AGREE if len(set(values)) == 1 else C3Status.INCONCLUSIVE), (0,) * len(values)
    else:
        bitmap = tuple(int(v != majority) for v in values)
        status = C3Status.ATTRIBUTED if any(bitmap) else C3Status.AGREE
    return C3Result(status, bitmap, values, ranks, surface, majority)


def engine(rank: int, peers: tuple[tuple[int, ...], ...] = ((0, 2), (1, 3)), untrusted=()):
    ctx = VerdictContext(rank=rank, step=3, peers=next(g for g in peers if rank in g), world_size=len(RANKS),
                         all_peers=peers, replica_ranks=RANKS)
    return SimpleNamespace(ctx=ctx, untrusted=set(untrusted), emitted=[])


def verdicts(fake, surfaces):
    res = BoundaryResult(step=3, replica_surfaces=list(surfaces))
    resolved, records = replica_verdicts(fake.ctx, res, fake.untrusted)
    named = [(i.kind.value, i.scope.value, tuple(i.ranks)) for i in records.incidents]
    if fake.ctx.rank == records.writer:
        fake.emitted.extend(named)
    return resolved, named


OUT = "layers.1.x1.output"
BAD_ON_1 = ("a", "b", "a", "a")


def test_a_rank_its_two_replica_group_cannot_outvote_is_named_by_its_replica_group():
    for rank in RANKS:
        fake = engine(rank)
        resolved, records = verdicts(fake, [result(OUT, BAD_ON_1)])
        assert records == [("sdc", "rank", (1,))]
        assert resolved == ({OUT} if rank in (1, 3) else set())  # only rank 1's peer group drops its record
        assert fake.emitted == (records if rank == 0 else [])  # one writer: the lowest member not named


def test_copied_parameters_that_differ_void_the_comparison():
    state = result(f"layers.1{REPLICATED_STATE}", ("p", "q", "p", "q"))
    assert verdicts(engine(0), [result(OUT, BAD_ON_1), state]) == (set(), [])


def test_the_groups_record_says_why_the_replica_group_named_nobody():
    """Rank 1's peer group {1, 3} has no majority and its copies differ from the other pair's: the group's record
    carries the replica surfaces' statuses, so a reader sees the comparison was void, not missing."""
    from scout_core.replay.verdicts import sdc_verdicts

    fake = engine(1)
    state = result(f"layers.1{REPLICATED_STATE}", ("p", "q", "p", "q"))
    res = BoundaryResult(step=3, surfaces=[result(OUT, ("a", "b"), ranks=(1, 3))],
                         replica_surfaces=[result(OUT, BAD_ON_1), state])
    resolved, _ = replica_verdicts(fake.ctx, res, fake.untrusted)
    (group,) = sdc_verdicts(fake.ctx, res, resolved)
    assert (group.scope.value, group.ranks) == ("peer_group", [1, 3])
    assert group.evidence["replica_surfaces"][f"layers.1{REPLICATED_STATE}"]["status"] == "inconclusive"
    assert group.evidence["replica_surfaces"][OUT] == {"status": "attributed", "peer_ranks": [0, 1, 2, 3],
                                                      "bitmap": [0, 1, 0, 0]}


def test_a_rank_another_member_found_nondeterministic_is_never_named():
    untrusted = result(REPLICA_UNTRUSTED, ((), (1,), (), ()))  # rank 1's own group found it, rank 0's did not
    assert verdicts(engine(0), [result(OUT, BAD_ON_1), untrusted]) == (set(), [])


def test_a_peer_group_with_a_majority_keeps_its_own_verdict():
    fake = engine(0, peers=((0, 2, 4), (1, 3, 5)))
    values = ("a", "b", "a", "a", "a", "a")
    assert verdicts(fake, [result(OUT, values, ranks=(0, 1, 2, 3, 4, 5))]) == (set(), [])


def test_a_peer_group_of_one_rank_has_no_majority():
    fake = engine(0, peers=((0,), (1,), (2,), (3,)))
    _, records = verdicts(fake, [result(OUT, BAD_ON_1)])
    assert records == [("sdc", "rank", (1,))]
