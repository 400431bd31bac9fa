"""The temporal check of a group's communication time (``CommTiming.group_slowdown``): a group that spans every
peer is compared with its own history, which must know the clock's tail before it may call the group slow."""

from __future__ import annotations

import random

from scout_core.config import ConsensusConfig
from scout_core.consensus import C3Status, StatisticalRule, statistical
from scout_core.replay.timing import BASELINE_ROUNDS, CommTiming

COMM_RULE = StatisticalRule.for_communication(ConsensusConfig())  # what the engine judges comm_s by


def _timing() -> CommTiming:
    return CommTiming(COMM_RULE, 2, world_control=None, hosts={})


def _round(timing: CommTiming, seconds: float, peers: int = 4) -> bool:
    return timing.group_slowdown(statistical([seconds] * peers))


MEASURED_MS = (15.85, 4.95, 9.23, 10.3, 16.18, 7.36, 9.42, 4.67, 5.46, 4.49, 5.67, 5.43, 4.98, 4.98, 8.9, 7.91,
               7.05, 7.63, 4.41, 4.29, 7.61, 4.86, 16.29, 6.08, 4.75, 9.33, 5.98, 5.68, 4.29, 3.91, 5.7, 8.45, 5.6,
               4.28, 4.71, 3.97, 7.36, 4.31, 6.24, 8.25, 8.48, 7.19, 8.6, 6.06, 6.87, 6.65, 6.23, 7.64, 6.46, 4.29,
               7.51, 4.24, 5.98, 6.14, 4.89, 7.47, 4.42, 5.03, 5.26, 6.38)
"""Group medians of the timed all-gather in two clean 30-step runs of titan-fsdp-clean (4 ranks, this host): the
job one of whose 8-step runs the 5-round history called slow."""


def _measured_noise(rng: random.Random) -> float:
    """A round drawn from the measured rounds, its tail stretched by up to 25 % (harsher than measured)."""
    ms = rng.choice(MEASURED_MS)
    return ms * (1 + 0.25 * rng.random()) / 1000 if ms > 12 else ms / 1000


def test_no_verdict_before_the_history_is_long_enough():
    timing = _timing()
    for _ in range(BASELINE_ROUNDS - 1):
        assert _round(timing, 0.005) is False
    # The tenth round is not judged (nine rounds of history): it joins the history, as every round before a
    # judgement can be made does (a slowdown present from the start is the group's usual, a stated limit).
    assert _round(timing, 0.5) is False and timing.slow_group_rounds == 0
    assert len(timing.baseline) == BASELINE_ROUNDS


def test_a_slowdown_far_beyond_the_noise_is_confirmed_at_its_third_round():
    rng = random.Random(0)
    timing = _timing()
    for _ in range(30):
        _round(timing, _measured_noise(rng))
    assert [_round(timing, 0.2) for _ in range(3)] == [False, False, True]  # the cells' 0.2 s delay


def test_isolated_slow_readings_join_the_history():
    timing = _timing()
    for _ in range(BASELINE_ROUNDS):
        _round(timing, 0.005)
    assert _round(timing, 0.05) is False and timing.slow_group_rounds == 1
    assert _round(timing, 0.005) is False
    assert 0.05 in timing.baseline  # the clock's tail, learned


def test_rounds_in_which_a_peer_stood_out_join_the_history():
    """A loaded host scatters the peers' readings: its noisy rounds are the ones with a peer beyond the spatial
    rule (attributed). History built from the agreeing rounds alone learned only the calm ones, and three noisy
    rounds whose peers happened to agree were then called a slowdown (a clean 16-rank DDP cell, once)."""
    timing = _timing()
    scattered = [0.012, 0.012, 0.012, 0.040]  # the group's median 12 ms, one peer far beyond it
    for i in range(2 * BASELINE_ROUNDS):
        if i % 3 == 2:
            assert statistical(scattered).status is not C3Status.AGREE
            assert timing.group_slowdown(statistical(scattered)) is False
        else:
            _round(timing, 0.005)
    assert 0.012 in timing.baseline
    # The host's usual noisy round, its peers agreeing this time: beyond the calm rounds' 5 ms floor (10 ms), so a
    # history of the calm rounds alone calls three of them a slowdown.
    assert [_round(timing, 0.012) for _ in range(4)] == [False] * 4


def test_a_confirmed_slowdown_stays_out_of_the_history():
    timing = _timing()
    for _ in range(BASELINE_ROUNDS):
        _round(timing, 0.005)
    assert [_round(timing, 0.2) for _ in range(4)] == [False, False, True, True]
    _round(timing, 0.005)
    assert max(timing.baseline) < 0.2


def _false_verdicts(runs: int, rounds: int) -> int:
    """Runs of ``rounds`` measured-noise rounds (after the history's) in which the group was called slow."""
    bad = 0
    for seed in range(runs):
        rng = random.Random(seed)
        timing = _timing()
        bad += any([_round(timing, _measured_noise(rng)) for _ in range(BASELINE_ROUNDS + rounds)])
    return bad


def test_the_measured_noise_is_almost_never_a_slowdown():
    """The false positive this fixes: heavy-tailed group times on a loaded host, tail rounds in a row. What is
    left is three tail rounds in a row before the history has seen two of them: 3 of 2,000 runs of 30 judged
    rounds (one per 20,000 rounds; the compute noise floor's rate is one per 9,000 rounds of 16 ranks)."""
    assert _false_verdicts(2000, 30) <= 6  # measured 3; twice that before this test calls it a regression


def test_at_two_rounds_the_same_noise_is_called_slow(monkeypatch):
    """The guard of the test above: confirming the temporal check at two rounds, as spatial consensus does,
    calls this noise slow in some runs."""
    import scout_core.replay.timing as timing_module

    monkeypatch.setattr(timing_module, "TEMPORAL_EXTRA_ROUNDS", 0)
    assert _false_verdicts(2000, 30) > 30


def _detected(factor: float, runs: int = 200) -> int:
    """Runs in which a sustained slowdown by ``factor`` (after 40 rounds of measured noise) is confirmed within
    six rounds."""
    hits = 0
    for seed in range(runs):
        rng = random.Random(seed)
        timing = _timing()
        for _ in range(40):
            _round(timing, _measured_noise(rng))
        hits += any([_round(timing, _measured_noise(rng) * factor) for _ in range(6)])
    return hits


def test_a_sustained_slowdown_beyond_the_noise_tail_is_found():
    """The other side of the floor: a group 4x slower than its usual (beyond the measured 2.7x tail) is confirmed
    in most runs, 8x in every run (a tail multiple of 3 found 4x in 58 and 8x in 116 of 200)."""
    assert _detected(4.0) >= 170
    assert _detected(8.0) == 200


def _checks_timed(timing: CommTiming, readings: list[float | None], every: int = 2) -> list[bool]:
    """Judge one round per check as the engine does: a check that times no all-reduce sends no time."""
    timed = []
    for check, seconds in enumerate(readings):
        due = timing.all_reduce_due(check, every)
        timed.append(due)
        timing.group_slowdown(statistical([seconds if due else None] * 4))
    return timed


def test_the_scratch_all_reduce_is_timed_on_every_check_until_the_history_is_learned():
    timing = _timing()
    timed = _checks_timed(timing, [0.005] * (BASELINE_ROUNDS + 6))
    assert timed == [True] * BASELINE_ROUNDS + [True, False] * 3  # then on every second check (check % 2 == 0)
    assert len(timing.baseline) == BASELINE_ROUNDS + 3  # the checks without it leave the history as it is
    assert all(_checks_timed(_timing(), [0.005] * 16, every=1))


def test_a_slow_streak_times_every_check_until_it_is_confirmed_or_broken():
    rng = random.Random(1)
    timing = _timing()
    calm = [_measured_noise(rng) for _ in range(31)]
    _checks_timed(timing, calm)  # checks 0..30 (30 is timed)
    # Slow from check 31, which times nothing: check 32 reads slow, and every check from there is timed, so the
    # third slow reading (check 34) confirms it, one check later than timing every check would; it stays slow.
    slow = []
    for check in range(31, 36):
        due = timing.all_reduce_due(check, 2)
        slow.append((due, timing.group_slowdown(statistical([0.2 if due else None] * 4))))
    assert slow == [(False, False), (True, False), (True, False), (True, True), (True, True)]
    # Back to calm: the streak breaks at the first calm reading, and the checks go sparse again.
    assert timing.all_reduce_due(37, 2) is True
    timing.group_slowdown(statistical([0.005] * 4))
    assert timing.slow_group_rounds == 0
    assert [timing.all_reduce_due(check, 2) for check in (39, 40)] == [False, True]


def test_every_layer_of_the_rotation_has_its_all_reduce_timed_in_turn():
    timing = _timing()
    _checks_timed(timing, [0.005] * BASELINE_ROUNDS)
    for layers in (2, 3, 4, 6, 7):
        checks = range(BASELINE_ROUNDS, BASELINE_ROUNDS + 4 * layers)
        timed = [c for c in checks if timing.all_reduce_due(c, 2, layers)]
        assert {c % layers for c in timed} == set(range(layers)), layers  # check c samples layer c % layers
        assert len(timed) == len(checks) // 2  # still every second check
