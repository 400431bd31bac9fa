"""Hang classification on gathered evidence: every class, victims, lost peers."""

from __future__ import annotations

import dataclasses

from scout_core.progress.classify import Evidence, HangClass, classify
from scout_core.progress.record import Phase

WORLD = list(range(8))
FP_AR = ("ddp_bucket_all_reduce|group=8@0,1,2,3,4,5,6,7", 111)


def _ev(rank, step=3, op=50, phase=Phase.COLLECTIVE, pending=True, fp=FP_AR):
    return Evidence(rank=rank, step=step, op_id=op, phase=int(phase), pending=pending,
                    fp_hash=fp[1] if pending else 0, fingerprint=fp[0] if pending else "", silent_s=5.0)


def _healthy(ranks=WORLD):
    return {r: _ev(r) for r in ranks}


def _one(verdicts):
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def test_lagging_rank():
    ev = _healthy()
    ev[5] = _ev(5, op=41, phase=Phase.FORWARD, pending=False)
    v = _one(classify(ev, [WORLD]))
    assert v.hang_class is HangClass.LAGGING and v.ranks == (5,)
    assert (v.kind, v.scope) == ("hang", "rank")


def test_frozen_before_entering_a_collective_in_the_previous_step():
    ev = _healthy()
    ev[2] = _ev(2, step=2, op=99, phase=Phase.OPTIMIZER, pending=False)
    assert _one(classify(ev, [WORLD])).hang_class is HangClass.LAGGING


def test_fingerprint_mismatch_at_equal_progress():
    ev = _healthy()
    ev[6] = _ev(6, fp=("all_reduce|group=8@0,1,2,3,4,5,6,7|shapes=2|op=SUM", 222))
    v = _one(classify(ev, [WORLD]))
    assert v.hang_class is HangClass.PROTOCOL_MISMATCH and v.ranks == (6,)
    assert "shapes=2" in v.reason


def test_rank_ahead_in_another_collective_is_control_flow_divergence():
    ev = _healthy()
    ev[1] = _ev(1, step=4, op=60, fp=("all_reduce|other", 333))
    v = _one(classify(ev, [WORLD]))
    assert v.hang_class is HangClass.PROTOCOL_MISMATCH and v.ranks == (1,)


def test_data_and_checkpoint_stalls():
    ev = _healthy()
    ev[3] = _ev(3, op=10, phase=Phase.DATALOADER, pending=False)
    v = _one(classify(ev, [WORLD]))
    assert (v.hang_class, v.kind, v.scope, v.ranks) == (HangClass.DATA_STALL, "data_stall", "rank", (3,))
    ev = _healthy()
    ev[7] = _ev(7, op=70, phase=Phase.CHECKPOINT_WRITE, pending=False)
    v = _one(classify(ev, [WORLD]))
    assert (v.hang_class, v.kind, v.ranks) == (HangClass.CHECKPOINT_STALL, "checkpoint_stall", (7,))


def test_equal_progress_stall_is_group_scoped():
    v = _one(classify(_healthy(), [WORLD]))
    assert v.hang_class is HangClass.EQUAL_PROGRESS_STALL and v.scope == "peer_group"
    assert v.ranks == tuple(WORLD)


def test_two_peers_disagreeing_are_inconclusive_never_named():
    ev = {0: _ev(0), 1: _ev(1, op=10)}  # both inside (different) collectives: neither waits for the other
    v = _one(classify(ev, [[0, 1]]))
    assert v.hang_class is HangClass.INCONCLUSIVE and v.scope == "peer_group" and v.ranks == (0, 1)


def test_other_groups_are_victims():
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    ev = _healthy()
    ev[5] = _ev(5, op=30, phase=Phase.FORWARD, pending=False)
    v = _one(classify(ev, groups))
    assert v.ranks == (5,) and v.peer_group == (1, 3, 5, 7)


def test_equal_stall_in_every_group_gives_one_verdict_per_group():
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    verdicts = classify(_healthy(), groups)
    assert [v.ranks for v in verdicts] == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_lost_peer_named_and_survivors_not_blamed():
    ev = _healthy()
    del ev[4]
    v = _one(classify(ev, [WORLD]))
    assert v.hang_class is HangClass.LOST and v.ranks == (4,) and v.scope == "rank"


def test_lost_peer_plus_a_named_culprit():
    ev = _healthy()
    del ev[4]
    ev[5] = _ev(5, op=30, phase=Phase.FORWARD, pending=False)
    assert {v.hang_class for v in classify(ev, [WORLD])} == {HangClass.LOST, HangClass.LAGGING}


def test_identical_input_identical_output_regardless_of_order():
    ev = _healthy()
    ev[5] = _ev(5, op=30, phase=Phase.FORWARD, pending=False)
    shuffled = dict(reversed(list(ev.items())))
    assert classify(ev, [WORLD]) == classify(shuffled, [WORLD])


def test_rank_waiting_behind_inside_a_collective_is_a_victim_of_a_rank_named_elsewhere():
    # HSDP: rank 5 froze (not in a collective); its shard-group mate 4 waits for it inside an all-gather and
    # so looks behind its own replica peers. Only rank 5 is the culprit.
    from scout_core.progress.classify import Evidence, HangClass, classify

    def ev(rank, op, pending):
        return Evidence(rank=rank, step=3, op_id=op, phase=7 if pending else 1, pending=pending,
                        fp_hash=7 if pending else 0, fingerprint="all_gather" if pending else "", silent_s=5.0)

    evidence = {0: ev(0, 50, True), 2: ev(2, 50, True), 4: ev(4, 40, True), 6: ev(6, 50, True),
                1: ev(1, 50, True), 3: ev(3, 50, True), 5: ev(5, 39, False), 7: ev(7, 50, True)}
    verdicts = classify(evidence, [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert [(v.hang_class, v.ranks) for v in verdicts] == [(HangClass.LAGGING, (5,))]
    # Without a rank named elsewhere, a rank behind inside a collective is still reported.
    alone = classify({r: e for r, e in evidence.items() if r in (0, 2, 4, 6)}, [[0, 2, 4, 6]])
    assert [v.ranks for v in alone] == [(4,)]


def test_a_save_in_progress_is_not_a_hang():
    """Rank 0 saves alone (within the I/O tolerance) while its peers wait at a barrier; or a rank finished its
    shard first and waits in the next collective while the others still write."""
    ev = {r: _ev(r, op=5) for r in range(8)}
    ev[0] = dataclasses.replace(_ev(0, op=4, phase=Phase.CHECKPOINT_WRITE, pending=False), silent=False)
    assert classify(ev, [WORLD]) == []
    ev = {r: dataclasses.replace(_ev(r, op=4, phase=Phase.CHECKPOINT_WRITE, pending=False), silent=False)
          for r in range(8)}
    ev[3] = _ev(3, op=5)
    assert classify(ev, [WORLD]) == []


def test_two_peers_name_the_one_the_other_waits_for():
    ev = {0: _ev(0, op=5), 1: _ev(1, op=4, phase=Phase.FORWARD, pending=False)}
    v = _one(classify(ev, [[0, 1]]))
    assert (v.hang_class, v.ranks) == (HangClass.LAGGING, (1,))
    ev = {0: _ev(0, op=5), 1: _ev(1, op=5, fp=("all_reduce|other", 9))}
    assert _one(classify(ev, [[0, 1]])).hang_class is HangClass.INCONCLUSIVE


def test_exited_only_when_a_live_peer_waits_in_a_collective():
    """A rank that closed SCOUT is named `exited` only if someone waits in a collective it will never join; a
    peer silent outside any collective (stuck on its own) does not make an ordinary exit a culprit."""
    gone = dataclasses.replace(_ev(4), alive=False, step=-1, pending=False)
    waiting = {**_healthy(), 4: gone}
    assert HangClass.EXITED in {v.hang_class for v in classify(waiting, [WORLD])}
    stuck = {r: _ev(r, phase=Phase.FORWARD, pending=False) for r in WORLD}
    stuck[4] = gone
    (v,) = classify(stuck, [WORLD])
    # not named, and not "below the software" either: they may wait for it where no collective is seen
    assert v.hang_class is HangClass.INCONCLUSIVE and 4 not in v.ranks and v.evidence["exited"] == [4]


def test_peers_that_closed_in_order_are_nobody_to_wait_for():
    """The job ended on the other ranks (they closed SCOUT) while rank 0 still does unmarked work: no record."""
    stuck = {r: dataclasses.replace(_ev(r, phase=Phase.CLOSED, pending=False), alive=False, step=-1)
             for r in WORLD[1:]}
    stuck[0] = _ev(0, phase=Phase.COMPUTE, pending=False)
    assert classify(stuck, [WORLD]) == []


def test_an_equal_progress_stall_waits_for_ranks_still_settling_in_the_same_collective():
    """The race behind a rare extra record in hsdp-hang-mismatch-shape: in the episode that opens first, the
    culprit's group {1,5,9,13} has not passed its silence threshold yet while a victim group {3,7,11,15} has.
    The victim's 'every peer waits' is no stall of its own while ranks of the same collective may still be
    named: nothing is reported, and the next episode, with everyone silent, names rank 9 alone."""
    fp = ("all_reduce|group=16@0..15|shapes=1|dtypes=float32|op=SUM", 111)
    fp9 = ("all_reduce|group=16@0..15|shapes=2|dtypes=float32|op=SUM", 222)
    groups = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]

    def ev(rank, silent):
        return dataclasses.replace(_ev(rank, step=4, op=0, fp=fp9 if rank == 9 else fp), silent=silent)

    first = {r: ev(r, r in {0, 2, 3, 7, 11, 15}) for r in range(16)}
    assert classify(first, groups) == []
    v = _one(classify({r: ev(r, True) for r in range(16)}, groups))
    assert v.hang_class is HangClass.PROTOCOL_MISMATCH and v.ranks == (9,)


def test_ranks_settling_in_another_collective_do_not_postpone_a_stall():
    fp_other = ("all_gather|group=4@1..13|shapes=1|dtypes=float32|op=-", 333)
    groups = [[0, 4, 8, 12], [1, 5, 9, 13]]
    evidence = {r: _ev(r, step=4, op=0) for r in groups[0]}
    evidence |= {r: dataclasses.replace(_ev(r, step=4, op=7, fp=fp_other), silent=False) for r in groups[1]}
    v = _one(classify(evidence, groups))
    assert v.hang_class is HangClass.EQUAL_PROGRESS_STALL and v.ranks == (0, 4, 8, 12)


def test_ranks_waiting_behind_a_fetch_still_within_its_tolerance_are_not_named():
    """The clean-clone failure of hsdp-data-stall (episode 1's evidence): rank 9's data fetch stalls at step 3;
    its shard-group mates 8, 10, 11 wait in the forward's all-gather, behind their replicate peers (which wait
    in the gradient all-reduce), and rank 10 crosses its threshold before rank 9's fetch tolerance ends. Rank
    10 waits for rank 9, which is judged once its own observer opens the next episode: a data stall, alone."""
    groups = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    ag = ("all_gather_single|group=4@8..11|shapes=808;202|dtypes=float32,float32", 7)
    ar = ("all_reduce|group=4@0..12/4|shapes=280|dtypes=float32|op=AVG", 9)

    def ev(rank, silent):
        if rank == 9:
            e = _ev(9, step=3, op=0, phase=Phase.DATALOADER, pending=False)
        elif rank in (8, 10, 11):
            e = _ev(rank, step=3, op=2, fp=ag)
        else:
            e = _ev(rank, step=3, op=9, fp=ar)
        return dataclasses.replace(e, silent=silent)

    first = {r: ev(r, r in (4, 8, 10)) for r in range(16)}
    assert classify(first, groups) == []
    later = {r: ev(r, r in (4, 8, 9, 10)) for r in range(16)}
    v = _one(classify(later, groups))
    assert (v.hang_class, v.ranks, v.kind, v.scope) == (HangClass.DATA_STALL, (9,), "data_stall", "rank")
    # A rank stopped on its own is still named while another fetches within its tolerance.
    frozen = {r: dataclasses.replace(_ev(r, step=3, op=9, fp=ar), silent=True) for r in range(16)}
    frozen[9] = ev(9, False)
    frozen[6] = dataclasses.replace(_ev(6, step=3, op=4, phase=Phase.FORWARD, pending=False), silent=True)
    assert [(v.hang_class, v.ranks) for v in classify(frozen, groups)] == [(HangClass.LAGGING, (6,))]


def test_an_equal_progress_stall_elsewhere_is_named_while_a_rank_saves_alone():
    """Rank 0 saves alone (within its I/O tolerance) while its group waits at a barrier, and group {4..7} is stalled
    in its all-reduce: that stall is named now (waiting for the save would name the healthy group too, once rank 0
    reaches the barrier and every member of both groups waits)."""
    barrier = ("barrier|group=8@0..7", 9)
    ev = {r: _ev(r, op=6, fp=barrier) for r in (1, 2, 3)}
    ev[0] = dataclasses.replace(_ev(0, op=5, phase=Phase.CHECKPOINT_WRITE, pending=False), silent=False)
    ev |= {r: _ev(r, op=8) for r in (4, 5, 6, 7)}
    v = _one(classify(ev, [[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert (v.hang_class, v.ranks) == (HangClass.EQUAL_PROGRESS_STALL, (4, 5, 6, 7))


def test_a_verdict_says_where_the_rank_is_in_plain_words_and_counts_the_step_being_run():
    """A rank asleep in Python while its peers wait was described as ``at (5, 18) (collective, ...)``, where 5 meant
    five finished steps; the reason now names the step being run and what the rank is doing."""
    from scout_core.progress.classify import Evidence, classify_group, where_in_words

    def ev(rank: int, **kw) -> Evidence:
        base = dict(rank=rank, step=5, op_id=18, phase=7, pending=True, fp_hash=1, silent_s=12.0, silent=True,
                    alive=True, seq=1, fingerprint="all_reduce(float32[1024], sum)")
        return Evidence(**{**base, **kw})

    evidence = {r: ev(r) for r in range(4)}
    evidence[2] = ev(2, op_id=3, phase=2, pending=False, fp_hash=0, fingerprint="", silent_s=14.2)
    (verdict,) = classify_group([0, 1, 2, 3], evidence)["verdicts"]
    assert verdict["reason"] == ("lagging: r2 in step 6, in the backward pass, outside any collective, after "
                                 "collective 3 of the step (last progress 14.2 s ago); its peers are inside "
                                 "collective 18 of step 6")
    assert where_in_words(ev(0, phase=7, pending=False, op_id=0)) == (
        "step 6, in compute or Python code, outside any collective, before any collective of the step")
    assert where_in_words(ev(0, phase=4, pending=False)) == "step 6, in the data loader"
    assert where_in_words(ev(0, phase=6, pending=False)) == "step 6, writing a checkpoint"
    assert where_in_words(ev(0)) == "step 6, waiting inside collective 18 of the step (all_reduce(float32[1024], sum))"
