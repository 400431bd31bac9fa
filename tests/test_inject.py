"""The injector: schedules, determinism, and each fault kind."""

from __future__ import annotations

import time

import pytest
import torch

from scout_core.testing.inject import Fault, FaultKind, Injector, Schedule


def test_schedules():
    assert Schedule.once(3).active(3) and not Schedule.once(3).active(4)
    assert Schedule.from_step(2).active(100) and not Schedule.from_step(2).active(1)
    s = Schedule.between(2, 5)
    assert [s.active(i) for i in range(7)] == [False, False, True, True, True, False, False]
    with pytest.raises(ValueError):
        Schedule.between(5, 5)


def test_bitflip_only_on_target_rank_and_step():
    inj = Injector([Fault(surface="out", rank=2, kind="bitflip", bit=31, index=4, schedule=Schedule.once(1))])
    t = torch.ones(8)
    assert not inj.corrupt("out", t, rank=1, step=1)
    assert not inj.corrupt("out", t, rank=2, step=0)
    assert not inj.corrupt("other", t, rank=2, step=1)
    assert torch.equal(t, torch.ones(8))
    assert inj.corrupt("out", t, rank=2, step=1)
    assert t[4] == -1.0 and t.sum() == 6.0  # sign bit
    assert inj.log[0].index == 4 and inj.log[0].bit == 31


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool])
def test_bitflip_changes_exactly_one_bit(dtype):
    t = torch.zeros(3, 5, dtype=dtype)
    width = 1 if dtype == torch.bool else t.element_size() * 8
    inj = Injector([Fault(surface="s", rank=0, kind="bitflip", bit=width - 1)], seed=3)
    inj.corrupt("s", t, rank=0, step=0)
    as_int = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    changed = (as_int != 0).sum().item()  # -0.0 == 0.0 as floats, so compare the bits
    assert changed == 1


def test_drawn_index_is_deterministic_per_seed():
    def run(seed):
        inj = Injector([Fault(surface="s", rank=0, kind="set", value=7.0)], seed=seed)
        t = torch.zeros(1000)
        inj.corrupt("s", t, rank=0, step=5)
        return int(t.nonzero()[0])

    assert run(1) == run(1)
    assert len({run(s) for s in range(8)}) > 1


def test_scale_and_set_whole_tensor():
    t = torch.ones(4)
    Injector([Fault(surface="s", rank=0, kind="scale", factor=3.0, all_elements=True)]).corrupt("s", t, rank=0, step=0)
    assert torch.equal(t, torch.full((4,), 3.0))
    Injector([Fault(surface="s", rank=0, kind="set", value=float("nan"), index=1)]).corrupt("s", t, rank=0, step=0)
    assert torch.isnan(t[1]) and t[0] == 3.0


def test_delay_sleeps_and_logs():
    inj = Injector([Fault(surface="coll", rank=1, kind="delay", seconds=0.05, schedule=Schedule.from_step(2))])
    assert inj.delay("coll", rank=1, step=1) == 0.0
    start = time.perf_counter()
    assert inj.delay("coll", rank=1, step=2) == 0.05
    assert time.perf_counter() - start >= 0.05
    assert inj.log[-1].kind is FaultKind.DELAY


def test_clear_disables():
    inj = Injector([Fault(surface="s", rank=0, kind="set", value=1.0)])
    inj.clear()
    t = torch.zeros(3)
    assert not inj.corrupt("s", t, rank=0, step=0)


def test_from_dict_and_errors():
    f = Fault.from_dict({"surface": "s", "rank": 3, "kind": "bitflip", "bit": 2, "between": [1, 4]})
    assert f.schedule == Schedule.between(1, 4) and f.kind is FaultKind.BITFLIP
    with pytest.raises(ValueError, match="at most one"):
        Fault.from_dict({"surface": "s", "rank": 0, "kind": "set", "step": 1, "from_step": 2})
    with pytest.raises(ValueError):
        Fault(surface="s", rank=0, kind="explode")
    with pytest.raises(ValueError, match="seconds"):
        Fault(surface="s", rank=0, kind="delay")
    with pytest.raises(ValueError, match="bit 40"):
        Injector([Fault(surface="s", rank=0, kind="bitflip", bit=40)]).corrupt("s", torch.ones(2), rank=0, step=0)
    with pytest.raises(IndexError):
        Injector([Fault(surface="s", rank=0, kind="set", index=9)]).corrupt("s", torch.ones(2), rank=0, step=0)
