"""A check's verdicts (replay.verdicts) are pure: hand-built results in, records and the rank that writes them out,
with no process group."""

from __future__ import annotations

from scout_core.consensus import C3Result, C3Status, exact, statistical
from scout_core.replay.result import BoundaryResult
from scout_core.replay.verdicts import (
    Records,
    TimingFindings,
    VerdictContext,
    check_verdicts,
    peer_writer,
    sdc_verdicts,
)
from scout_core.report import IncidentKind, IncidentScope

PEERS = (0, 1, 2, 3)
OUT = "layers.1.x1.output"


def ctx(rank: int = 0, world_size: int = 4) -> VerdictContext:
    return VerdictContext(rank=rank, step=7, peers=PEERS, world_size=world_size,
                          hosts={r: f"node{r // 2}" for r in range(world_size)}, all_peers=(PEERS,))


def surfaces(*values_per_surface: tuple) -> list[C3Result]:
    return [exact(list(values), peer_ranks=PEERS, surface=f"{OUT}.{i}") for i, values in enumerate(values_per_surface)]


def own(records: list[Records]) -> Records:
    """The peer group's own records, always written last."""
    assert records[-1].job_wide is False
    return records[-1]


def test_peers_that_agree_make_no_record():
    result = BoundaryResult(7, surfaces=surfaces(("a", "a", "a", "a"), ("g", "g", "g", "g")))
    records = check_verdicts(ctx(), result)
    assert records == [Records([], None)]


def test_one_outlier_is_sdc_on_that_rank_written_by_the_lowest_peer_not_named():
    result = BoundaryResult(7, surfaces=surfaces(("a", "a", "b", "a"), ("g", "g", "h", "g")))
    mine = own(check_verdicts(ctx(rank=1), result))
    (inc,) = mine.incidents
    assert (inc.kind, inc.scope, inc.ranks, inc.hosts, inc.step) == (IncidentKind.SDC, IncidentScope.RANK, [2],
                                                                     ["node1"], 7)
    assert set(inc.evidence["surfaces"]) == {f"{OUT}.0", f"{OUT}.1"}  # one record with every surface that named it
    assert mine.writer == 0
    named_zero = BoundaryResult(7, surfaces=surfaces(("b", "a", "a", "a")))
    assert own(check_verdicts(ctx(), named_zero)).writer == 1  # the culprit never writes its own record


def test_no_majority_names_no_rank():
    result = BoundaryResult(7, surfaces=surfaces(("a", "a", "b", "b")))
    assert result.surfaces[0].status is C3Status.INCONCLUSIVE
    mine = own(check_verdicts(ctx(), result))
    (inc,) = mine.incidents
    assert inc.scope is IncidentScope.PEER_GROUP and inc.ranks == list(PEERS)
    assert not [i for i in mine.incidents if i.scope is IncidentScope.RANK]
    assert mine.writer == 0 == peer_writer(PEERS, mine.incidents)
    assert sdc_verdicts(ctx(), result, resolved={f"{OUT}.0"}) == []  # resolved by the replica group instead


def test_set_aside_ranks_and_a_confirmed_job_wide_straggler():
    times = statistical([0.010, 0.010, 0.030, 0.010], peer_ranks=list(PEERS), surface="replay.compute_s")
    assert times.outlier_ranks == (2,)
    result = BoundaryResult(7, timing=times, timing_world=True)
    records = check_verdicts(ctx(rank=2), result, new_untrusted=[("nondeterministic", (3,))],
                             timing=TimingFindings(new_stragglers=(2,), rounds=2))
    job, mine = records
    assert job.job_wide and job.writer == 0 and job.incidents[0].kind is IncidentKind.STRAGGLER
    assert [(i.kind, i.ranks, i.evidence["reason"]) for i in mine.incidents] == [
        (IncidentKind.INCONCLUSIVE, [3], "nondeterministic")]
    assert mine.writer == 0
    unconfirmed = check_verdicts(ctx(), BoundaryResult(7, timing=times), timing=TimingFindings(rounds=2))
    assert unconfirmed == [Records([], None)]


def test_a_shard_mates_corrupted_shard_names_its_owner_not_the_replicas_that_gathered_it():
    """HSDP: rank 2 gathered position 1's shard from a mate whose shard is corrupted (its part 1 differs): every
    surface of that layer differs on rank 2 for that reason alone. The owner is named by its own peer group."""
    def on(surface: str, values: tuple) -> C3Result:
        return exact(list(values), peer_ranks=PEERS, surface=surface)

    gathered = [on("layers.1.gathered_shard.1", ("a", "a", "b", "a")), on("layers.1.gathered_receipt", ((),) * 4),
                on("layers.1.x1.output", ("o", "o", "p", "o")), on("layers.1.param_state", ("s", "s", "t", "s"))]
    assert sdc_verdicts(ctx(), BoundaryResult(7, surfaces=gathered)) == []
    # Its own shard, another layer's outputs (layers.10 is not layers.1) and another rank stay its own findings.
    own_faults = gathered + [on("layers.1.local_shard", ("l", "l", "m", "l")),
                             on("layers.10.x1.output", ("q", "q", "r", "q")),
                             on("layers.1.x2.output", ("u", "v", "u", "u"))]
    incidents = sdc_verdicts(ctx(), BoundaryResult(7, surfaces=own_faults))
    assert {tuple(i.ranks): sorted(i.evidence["surfaces"]) for i in incidents} == {
        (2,): ["layers.1.local_shard", "layers.10.x1.output"], (1,): ["layers.1.x2.output"]}
    # A part rank 2 received otherwise than its shard group did is its own fault: nothing is set aside.
    receipt = [r for r in gathered if "receipt" not in r.surface] + [on("layers.1.gathered_receipt",
                                                                          ((), (), (1,), ()))]
    (inc,) = sdc_verdicts(ctx(), BoundaryResult(7, surfaces=receipt))
    assert inc.ranks == [2] and "layers.1.gathered_receipt" in inc.evidence["surfaces"]
    # Without a receipt (none exchanged) nothing is explained either.
    assert {i.ranks[0] for i in sdc_verdicts(ctx(), BoundaryResult(7, surfaces=gathered[:1] + gathered[2:]))} == {2}
