"""Who corrupted AllToAll transfers, from the odd (receiver, sender) transfers (hand-built cases)."""

from __future__ import annotations

from scout_core.moe.alltoall import attribute_transfers


def _named(odd):
    return [(v.ranks, v.scope) for v in attribute_transfers(set(odd))]


def test_a_sender_odd_at_several_receivers_is_named_not_its_receivers():
    assert _named({(8, 9), (9, 9), (10, 9), (11, 9)}) == [((9,), "rank")]
    assert _named({(8, 9), (10, 9)}) == [((9,), "rank")]  # a plan that sends to only two of them


def test_a_receiver_odd_on_several_senders_is_named():
    assert _named({(9, 8), (9, 9), (9, 10), (9, 11)}) == [((9,), "rank")]


def test_a_transfer_to_itself_is_its_own_rank():
    assert _named({(9, 9)}) == [((9,), "rank")]


def test_one_odd_transfer_names_both_endpoints_as_a_group():
    assert _named({(10, 9)}) == [((9, 10), "peer_group")]


def test_a_sender_and_an_unrelated_single_transfer_in_another_replica():
    assert _named({(0, 1), (2, 1), (3, 1), (13, 14)}) == [((1,), "rank"), ((13, 14), "peer_group")]


def test_nothing_odd_names_nobody():
    assert _named(set()) == []


def test_two_corrupting_receivers_in_one_replica_are_named_not_their_healthy_senders():
    odd = {(q, s) for q in (8, 10) for s in (8, 9, 10, 11)}
    assert _named(odd) == [((8,), "rank"), ((10,), "rank")]


def test_a_corrupting_sender_and_receiver_together():
    odd = {(q, 9) for q in (8, 9, 10, 11)} | {(11, s) for s in (8, 9, 10, 11)}
    assert sorted(_named(odd)) == [((9,), "rank"), ((11,), "rank")]


def _full(group):
    return {(q, s) for q in group for s in group}


def test_clean_transfers_rule_out_a_sender_that_also_sent_clean_rows():
    """Receivers 2 and 3 corrupt, each fed only by sender 1, whose rows to 0 and 1 arrived clean."""
    carried = {(0, 1), (1, 1), (2, 1), (3, 1), (0, 0), (1, 0)}
    named = [(v.ranks, v.scope) for v in attribute_transfers({(2, 1), (3, 1)}, carried)]
    assert named == [((2,), "rank"), ((3,), "rank")]


def test_a_pattern_no_single_endpoint_explains_names_the_group():
    odd = {(0, 2), (1, 2), (0, 3), (1, 3)}
    named = [(v.ranks, v.scope) for v in attribute_transfers(odd, _full(range(4)))]
    assert named == [((0, 1, 2, 3), "peer_group")]


def test_with_every_transfer_known_the_single_culprits_stay_named():
    full = _full(range(8, 12))
    assert [(v.ranks, v.scope) for v in attribute_transfers({(q, 9) for q in range(8, 12)}, full)] == [((9,), "rank")]
    odd = {(q, s) for q in (8, 10) for s in range(8, 12)}
    assert [(v.ranks, v.scope) for v in attribute_transfers(odd, full)] == [((8,), "rank"), ((10,), "rank")]
    assert [(v.ranks, v.scope) for v in attribute_transfers({(10, 9)}, full)] == [((9, 10), "peer_group")]
