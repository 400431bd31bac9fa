"""What makes a replay check's evidence trustworthy: independent rotation, vetting for determinism, the
optimizer self-check, and rounds without a measurement."""

from __future__ import annotations

import pytest

from scout_core.consensus import C3Result, C3Status, Confirmation, exact, statistical
from scout_core.replay.timing import CommTiming
from scout_core.replay.vetting import (
    ENVIRONMENT_SURFACE,
    REPRODUCIBLE_SURFACE,
    SELF_CHECK_SURFACE,
    environment_fingerprint,
    optimizer_misconfigured,
    rotation,
    split_vetting,
    vet_due,
)


@pytest.mark.parametrize(("layers", "peers"), [(4, 2), (8, 4), (12, 4), (2, 4), (3, 16), (16, 16), (5, 7), (1, 3)])
def test_every_layer_source_pair_within_layers_times_peers_checks(layers, peers):
    pairs = {rotation(c, layers, peers) for c in range(layers * peers)}
    assert pairs == {(layer, src) for layer in range(layers) for src in range(peers)}


def test_one_shared_counter_never_rotated_the_sources_of_a_layer():
    """The first scheme (layer = c mod L, source = c mod P) when P divides L: layer 0 always from source 0."""
    layers, peers = 8, 4
    assert {(c % layers, c % peers) for c in range(layers * peers * 10) if c % layers == 0} == {(0, 0)}
    assert {rotation(c, layers, peers) for c in range(layers * peers) if c % layers == 0} == {(0, s) for s in range(4)}


def test_rotation_rejects_an_empty_group():
    with pytest.raises(ValueError):
        rotation(0, 0, 4)


def test_vetting_covers_whole_rotations_so_every_layer_is_vetted_again():
    for layers in (3, 10, 32, 40, 48):
        vetted = [c for c in range(layers * 25) if vet_due(c, 10, False, layers=layers)]
        assert {c % layers for c in vetted[:layers]} == set(range(layers))  # the first rotation, whole
        again = [c for c in vetted if c >= layers]
        assert {c % layers for c in again} == set(range(layers)), layers  # and every layer again later
        assert len(vetted) == len(range(0, 25, 10)) * layers
    assert not any(vet_due(c, 0, False, layers=3) for c in range(50))
    assert all(vet_due(c, 10, True) for c in range(50))


def test_a_non_reproducible_rank_is_pulled_out_of_the_evidence():
    results = [exact([1, 1, 2, 1], peer_ranks=[0, 1, 2, 3], surface="layers.1.x1.output"),
               exact([True, True, False, True], peer_ranks=[0, 1, 2, 3], surface=REPRODUCIBLE_SURFACE)]
    kept, untrusted = split_vetting(results)
    assert [r.surface for r in kept] == ["layers.1.x1.output"] and untrusted == {2: "nondeterministic"}
    kept, untrusted = split_vetting(results[:1])
    assert untrusted == {}


def test_a_rank_in_another_environment_is_pulled_out_of_the_evidence():
    env = exact(["torch=2.13", "torch=2.13", "torch=2.12", "torch=2.13"], peer_ranks=[0, 1, 2, 3],
                surface=ENVIRONMENT_SURFACE)
    _, untrusted = split_vetting([env])
    assert untrusted == {2: "environment"}
    split = exact(["a", "b", "a", "b"], peer_ranks=[0, 1, 2, 3], surface=ENVIRONMENT_SURFACE)
    assert split_vetting([split])[1] == dict.fromkeys([0, 1, 2, 3], "environment")  # no majority: nobody


def test_the_environment_fingerprint_names_what_decides_the_bits():
    import torch

    fp = environment_fingerprint(torch.device("cpu"))
    assert fp.startswith(f"torch={torch.__version__}") and "fp32_matmul=" in fp
    torch.set_float32_matmul_precision("medium")
    try:
        assert environment_fingerprint(torch.device("cpu")) != fp
    finally:
        torch.set_float32_matmul_precision("highest")


def test_an_optimizer_self_check_failing_on_a_majority_is_a_misconfiguration():
    majority = exact([False, False, False, True], peer_ranks=[0, 1, 2, 3], surface=SELF_CHECK_SURFACE)
    assert majority.status is C3Status.ATTRIBUTED and majority.outlier_ranks == (3,)  # what C3 alone would say
    assert optimizer_misconfigured([majority]) is majority
    everyone = exact([False] * 4, peer_ranks=[0, 1, 2, 3], surface=SELF_CHECK_SURFACE)
    assert everyone.status is C3Status.AGREE  # ... and this looked like agreement
    assert optimizer_misconfigured([everyone]) is everyone
    one = exact([True, True, False, True], peer_ranks=[0, 1, 2, 3], surface=SELF_CHECK_SURFACE)
    assert optimizer_misconfigured([one]) is None  # a minority failing is SDC evidence on it, as before


def test_a_round_without_a_measurement_neither_confirms_nor_resets():
    conf = Confirmation(rounds=2)
    slow = statistical([0.01] * 15 + [0.02])
    assert conf.update(slow) == ()
    missing = statistical([0.01] * 15 + [None])
    assert missing.status is C3Status.NO_MEASUREMENT and missing.outlier_ranks == ()
    assert conf.update(missing) == ()
    assert conf.update(slow) == (15,)  # the count survived the round without a measurement


def test_a_round_without_a_measurement_leaves_the_comm_baseline_alone():
    from scout_core.consensus import StatisticalRule

    timing = CommTiming(StatisticalRule(), 2, world_control=None, hosts={})
    for _ in range(6):
        timing.group_slowdown(statistical([0.01] * 16))
    before = list(timing.baseline)
    none = C3Result(C3Status.NO_MEASUREMENT, (0,) * 16, (None,) * 16, tuple(range(16)), "replay.comm_s")
    assert timing.group_slowdown(none) is False
    assert list(timing.baseline) == before and timing.slow_group_rounds == 0
