"""A straggler too mild for the noise floor, named from the same rounds' peers (``scout_core.persistence``), and
its place in the timing judge: one record per episode whichever path names the rank first."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from scout_core.config import load
from scout_core.consensus import C3Status, Persistence, StatisticalRule
from scout_core.persistence import round_ratios
from scout_core.replay.judge import TimingJudge
from scout_core.replay.result import BoundaryResult

RULE = StatisticalRule()


def _round(times: list[float], surface: str = "replay.compute_s"):
    return RULE(times, surface=surface)


def _noisy(rng: random.Random, n: int, slow: dict[int, float] | None = None, sigma: float = 0.03) -> list[float]:
    """One round's compute times: 20 ms with a few percent of noise, ``slow`` ranks times their factor."""
    slow = slow or {}
    return [0.02 * rng.lognormvariate(0, sigma) * slow.get(r, 1.0) for r in range(n)]


def test_a_rank_13x_slower_is_named_at_its_third_round_and_recorded_once():
    rng = random.Random(0)
    p = Persistence()
    named_at = []
    for k in range(8):
        named = p.update(_round(_noisy(rng, 16, {9: 1.3} if k >= 2 else None)))
        if p.newly:
            named_at.append((k, p.newly))
        assert set(named) <= {9}
    assert named_at == [(4, (9,))]  # slowed from round 2: rounds 2, 3, 4; one record for the whole episode
    assert p.means[9] == pytest.approx(1.3, abs=0.05)


def test_healthy_ranks_slow_one_round_at_a_time_are_never_named():
    """A heavy tail: every rank now and then 1.3-2.5x for one round (what a shared host's clock does); and a
    rank 1.05x slower by binning in every round. Two thousand rounds of 16 peers name nobody."""
    rng = random.Random(1)
    p = Persistence()
    for _ in range(2000):
        times = _noisy(rng, 16, {3: 1.05})
        for r in range(16):
            if rng.random() < 0.01:
                times[r] *= rng.uniform(1.3, 2.5)
        assert p.update(_round(times)) == ()


def test_two_slow_rounds_and_a_quiet_one_break_the_streak():
    p = Persistence()
    base = [0.02] * 15
    slow, quiet = [*base, 0.026], [*base, 0.0201]
    for times in (slow, slow, quiet, slow, slow):
        assert p.update(_round(times)) == ()
    assert p.update(_round(slow)) == (15,) and p.newly == (15,)


def test_one_freak_round_cannot_carry_the_average():
    """1.15x, 1.15x and one 5x round: capped at 1.35x the average is 1.213x, below the 1.22x bar (1.87x uncapped);
    and a rank 1.05x slower by binning never counts a round, so two freak rounds cannot carry it either."""
    p = Persistence()
    base = [0.02] * 15
    for factor in (1.15, 1.15, 5.0):
        assert p.update(_round([*base, 0.02 * factor])) == ()
    for factor in (1.05, 3.0, 3.0):
        assert p.update(_round([*base, 0.02 * factor])) == ()


def test_a_round_without_a_majority_within_its_spread_names_nobody_and_breaks_streaks():
    p = Persistence()
    n = 8
    one = [0.02] * (n - 1) + [0.026]
    half = [0.02] * (n // 2) + [0.026] * (n // 2)
    for times in (one, one, half):
        assert p.update(_round(times)) == ()
    assert p.update(_round(one)) == ()  # the streak began again
    assert p.update(_round(one)) == ()
    assert p.update(_round(one)) == (n - 1,)


def test_rounds_of_another_kind_neither_count_nor_break_a_kinds_streak():
    """An MoE block's checks alternate attention and router: a rank slow in the router only."""
    p = Persistence()
    base = [0.02] * 15
    slow, quiet = [*base, 0.027], [*base, 0.02]
    named = []
    for k in range(6):
        kind, times = ("router", slow) if k % 2 else ("attention", quiet)
        named.append(p.update(_round(times), kind=kind))
    assert named == [(), (), (), (), (), (15,)]


def test_too_few_peers_missing_times_and_off_are_no_evidence():
    assert round_ratios([0.02, 0.02, 0.03]) is None
    assert round_ratios([0.02, 0.02, float("nan"), 0.02]) is None
    off = Persistence(rounds=0)
    for _ in range(5):
        assert off.update(_round([0.02] * 7 + [0.03])) == ()
    absent = RULE([0.02, None, 0.02, 0.02])
    assert absent.status is C3Status.NO_MEASUREMENT and Persistence().update(absent) == ()
    with pytest.raises(ValueError):
        Persistence(rounds=-1)


def test_it_is_off_as_shipped_and_one_setting_turns_it_on():
    assert Persistence.from_config(load(None, []).consensus).rounds == 0
    p = Persistence.from_config(load(None, ["consensus.persist_rounds=3"]).consensus)
    assert (p.rounds, p.ratio, p.min_step) == (3, 1.22, 1.1)


def _judge() -> TimingJudge:
    comm = SimpleNamespace(loc_rounds=0, slow_group_rounds=0, temporal_rounds=3)
    return TimingJudge(comm, confirm_rounds=2, noise_window=64, persistence=Persistence())


def _feed(judge: TimingJudge, times: list[float], step: int) -> tuple[BoundaryResult, tuple[int, ...]]:
    result = BoundaryResult(step=step)
    replayed = SimpleNamespace(work=("hidden", "Block", ((512, 512),)), hsdp_comm=None, comm_ranks=())
    judge.judge(result, _round(times), _round([0.01] * len(times)), replayed, tuple(range(len(times))))
    found = judge.findings(result)
    return result, found.new_stragglers


def _namings(judge: TimingJudge, seed: int, steps: int, factor: float, onset: int) -> tuple[list, BoundaryResult]:
    """Rounds 1..steps of 16 noisy peers, rank 9 ``factor`` slower from ``onset``: each round's new stragglers."""
    rng = random.Random(seed)
    new = []
    for step in range(1, steps + 1):
        result, fresh = _feed(judge, _noisy(rng, 16, {9: factor} if step >= onset else None), step)
        new += [(step, fresh)] if fresh else []
    return new, result


def test_the_judge_names_a_mild_straggler_below_the_floor_once():
    new, result = _namings(_judge(), seed=2, steps=8, factor=1.3, onset=3)
    assert new == [(5, (9,))]
    assert result.persistent[9] > 1.22 and 9 in result.stragglers


def test_below_a_high_floor_only_the_persistent_path_names_the_rank_and_its_record_says_so():
    """A noisy host: 40 rounds with a heavy tail lift the floor above 1.3x; a rank 1.3x slower from then on is
    named by the persistence path alone at its third slowed round, and its record says which path and why."""
    from scout_core.replay.verdicts import VerdictContext, timing_verdicts
    from scout_core.report import IncidentKind

    judge = _judge()
    rng = random.Random(4)
    for step in range(1, 41):
        times = _noisy(rng, 16, sigma=0.05)
        for r in range(16):
            if rng.random() < 0.04:
                times[r] *= rng.uniform(1.2, 1.6)
        _feed(judge, times, step)
    records = []
    for step in range(41, 44):
        result, fresh = _feed(judge, _noisy(rng, 16, {9: 1.3}, sigma=0.01), step)
        ctx = VerdictContext(rank=0, step=step, peers=tuple(range(16)), world_size=16)
        incidents: list = []
        timing_verdicts(ctx, result, judge.findings(result), incidents)
        records += [i for i in incidents if i.kind is IncidentKind.STRAGGLER]
    assert judge.confirm.count("replay.compute_s", 9) == 0  # the floor cleared every one of its flags
    (record,) = records
    assert record.ranks == [9] and record.step == 43
    assert "beyond their spread in 3 consecutive rounds" in record.reason and "on average rank 9 1.2" in record.reason
    assert record.evidence["path"] == {"9": "persistent"} and record.evidence["persistent"]["9"] > 1.22


def test_a_rank_both_paths_name_is_recorded_once():
    """3x slower: the floor's path confirms it at its second slow round after the warm-up, the persistent path
    one round later: one record."""
    new, _ = _namings(_judge(), seed=3, steps=9, factor=3.0, onset=4)
    assert new == [(5, (9,))]


def _model_job(rng: random.Random, peers: int, rounds: int, slow: dict[int, float], start: int) -> list:
    from test_consensus import _measured_round  # this host's measured noise, a little heavier (docs/consensus.md)

    out = []
    for k in range(rounds):
        times = _measured_round(rng, peers)
        for rank, factor in slow.items() if k >= start else ():
            times[rank] *= factor
        out.append(RULE(times))
    return out


@pytest.mark.parametrize("peers", [16, 8])
def test_under_the_hosts_noise_a_13x_rank_is_named_within_three_rounds_in_nearly_every_run(peers):
    """The paper's 1.3x straggler under the measured-noise model, slowed from the third round: named by its
    third slowed round in 97 % of 400 runs at 16 peers, 96 % at 8 (the figures in docs/consensus.md)."""
    rng = random.Random(5 + peers)
    hits = others = 0
    for _ in range(400):
        p = Persistence()
        named = set()
        for res in _model_job(rng, peers, 5, {peers - 3: 1.3}, start=2):
            p.update(res)
            named |= set(p.newly)
        hits += peers - 3 in named
        others += len(named - {peers - 3})
    assert hits >= 0.94 * 400, hits  # 389 and 384
    assert others <= 2, others  # the model's heavy tail names a healthy rank about once per 2,000 rounds at 8


def test_under_the_hosts_noise_healthy_ranks_are_named_rarely():
    """20,000 healthy rounds of 16 under the model: about once per 4,500 rounds (22 per 100,000 in a longer
    run), against once per 1,600 with a 1.2x bar and 1.4x cap, and once per 9,000 for the floor's path."""
    rng = random.Random(21)
    p = Persistence()
    named = 0
    for res in _model_job(rng, 16, 20_000, {}, start=0):
        p.update(res)
        named += len(p.newly)
    assert named <= 10, named
