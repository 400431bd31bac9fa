"""Nothing SCOUT reads from a snapshot or from another rank can run code (issue 32, item 1).

Each crafted payload goes through the product's own readers (a restored snapshot's saved calls, the call metadata
a peer receives, the wire collectives) and must give SCOUT's own error and leave no trace: the side effect each
payload would cause (a marker file) must not exist afterwards.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from scout_core import wire
from scout_core.replay.calls import flatten_call
from scout_core.replay.spec_codec import (
    NotShippable,
    allow_call_packages,
    decode_metadata,
    decode_spec,
    encode_spec,
    spec_from_tensor,
    spec_to_tensor,
)
from scout_core.testing.launcher import RankContext, init_gloo, launch

allow_call_packages(__name__.split(".")[0])


@dataclasses.dataclass
class Args:
    mask: torch.Tensor | None
    window: int = 4


class _Reduce:
    """A pickle that runs ``os.system(cmd)`` when loaded: what a planted slot would hold."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _spec_doc(spec_json: Any) -> torch.Tensor:
    return _as_tensor(wire.encode({"format": "SCOUT-SPEC/1", "spec": spec_json}))


def test_a_pickled_os_system_in_a_saved_call_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Reduce(f"touch {marker}"))
    with pytest.raises(NotShippable, match="pickle"):
        spec_from_tensor(_as_tensor(payload), where="slot 7's saved call")
    assert not marker.exists()


def test_a_whole_snapshot_with_a_planted_call_restores_without_running_it(tmp_path: Path) -> None:
    """The snapshot loads (weights only), and the sweep's reader leaves the planted call out and names it."""
    from scout_core.replay.sweep import EmergencySweep

    marker = tmp_path / "ran"
    saved = {"hidden": {"layer": 0, "tensors": [torch.ones(2)], "on_host": [True], "mask": [False], "grads": {},
                        "rng": {}, "spec": _as_tensor(pickle.dumps(_Reduce(f"touch {marker}")))}}
    buf = io.BytesIO()
    torch.save({"calls": saved}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    sweep = EmergencySweep.__new__(EmergencySweep)
    sweep.load_calls(loaded["calls"])
    assert sweep.calls == {} and "hidden" in (sweep.unreadable or "") and "pickle" in sweep.unreadable
    with pytest.raises(ValueError, match="cannot be read"):
        sweep._work()  # run under the guard: every rank then skips the sweep together
    assert not marker.exists()


@pytest.mark.parametrize("node", [
    {"seq": "subprocess:Popen", "items": [{"val": "touch /tmp/x"}]},           # a constructor of another package
    {"map": "os:environ", "items": []},
    {"val": {"fn": "os:system"}},                                               # a function by name
    {"val": {"type": "subprocess:Popen"}},
    {"dataclass": "torch:load", "fields": []},                                  # an allowed package, wrong kind
    {"namedtuple": "torch:Size", "items": []},
    {"seq": "torch.serialization:load", "items": []},
    {"function": "os:system", "line": 1, "defaults": {"val": None}, "kwdefaults": {"val": None}, "cells": []},
    {"function": "torch.serialization:load", "line": 1, "defaults": {"val": None}, "kwdefaults": {"val": None},
     "cells": []},                                                              # an allowed module, no such code
    {"function": "torch.serialization:load", "line": __import__("torch").serialization.load.__code__.co_firstlineno,
     "defaults": {"val": None}, "kwdefaults": {"val": None}, "cells": []},     # its real line: still no closure
    {"enum": "os:system", "member": "x"},
    {"slot": -1},
    {"val": {"device": "not a device"}},
])
def test_a_spec_naming_code_outside_the_declared_model_is_refused(node: Any) -> None:
    with pytest.raises(NotShippable):
        spec_from_tensor(_spec_doc(node))


def test_a_dataclass_rebuild_sets_only_its_declared_fields() -> None:
    _, spec = flatten_call(Args(mask=None))
    data = encode_spec(spec)
    assert decode_spec(data)[1] is Args
    data["fields"].append(["__class__", {"val": None}])
    with pytest.raises(NotShippable, match="no field '__class__'"):
        decode_spec(data)


def test_truncated_oversized_and_garbled_saved_calls_give_scouts_error() -> None:
    good = spec_to_tensor(flatten_call((torch.ones(1), {"w": 3}))[1]).numpy().tobytes()
    for bad in (good[: len(good) // 2], good + b"x", b"", b"\xff\xfe", b"[" * 100_000, b'{"$x": 1}'):
        with pytest.raises(wire.WireError):
            spec_from_tensor(_as_tensor(bad) if bad else torch.empty(0, dtype=torch.uint8))
    with pytest.raises(wire.WireError, match="more than"):
        wire.decode(b" " * (wire.MAX_WIRE_BYTES + 1))


def test_call_metadata_from_a_peer_is_checked_field_by_field() -> None:
    good = {"spec": {"slot": 0}, "tensors": [((2, 3), torch.float32, "cpu")], "mask": [True], "grads": {},
            "rng": {"cpu": torch.zeros(4, dtype=torch.uint8)}}
    assert decode_metadata(wire.encode({0: good}), 3)[0]["tensors"] == [((2, 3), torch.float32, "cpu")]
    for broken in ({**good, "tensors": [((-1,), torch.float32, "cpu")]}, {**good, "extra": 1},
                   {**good, "rng": {"cpu": "state"}}, {**good, "tensors": [((2,), torch.float32, "gpu9")]}):
        with pytest.raises(NotShippable, match="rank 3"):
            decode_metadata(wire.encode({0: broken}), 3)


def test_the_wire_carries_plain_data_only() -> None:
    value = {"a": (1, 2.5, float("nan")), 3: [None, b"\x00\x01", torch.bfloat16], "t": torch.arange(4)}
    back = wire.decode(wire.encode(value))
    assert back["a"][:2] == (1, 2.5) and back["a"][2] != back["a"][2] and back[3] == [None, b"\x00\x01",
                                                                                       torch.bfloat16]
    assert torch.equal(back["t"], torch.arange(4))
    for not_data in (object(), {1, 2}, _Reduce("true"), torch.ones(1 << 19)):
        with pytest.raises(wire.WireError):
            wire.encode(not_data)


def _exchanges(ctx: RankContext) -> Any:
    init_gloo(ctx)
    out: dict[str, Any] = {"gather": wire.all_gather_data({"rank": ctx.rank}),
                           "bcast": wire.broadcast_data(("from", ctx.rank), src=1)}
    # One rank cannot encode its value: every rank raises together, naming it, and none is left waiting.
    try:
        wire.all_gather_data(object() if ctx.rank == 2 else 1, what="test exchange")
    except wire.WireError as e:
        out["refused"] = str(e)
    # A source announcing 2**40 bytes: refused from the length, before anything is allocated.
    length = torch.tensor([1 << 40 if ctx.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(length, src=0)
    try:
        wire._lengths_or_raise([int(length)], [0], "huge", None)
    except wire.WireError as e:
        out["huge"] = str(e)
    out["after"] = wire.all_gather_data(ctx.rank)  # the group still works: nobody hung
    dist.destroy_process_group()
    return out


def test_wire_collectives_agree_and_fail_together_on_three_ranks() -> None:
    result = launch(_exchanges, 3, timeout_s=60)
    assert result.ok, result.failures()
    for out in result.values():
        assert out["gather"] == [{"rank": r} for r in range(3)] and out["bcast"] == ("from", 1)
        assert "rank(s) [2]" in out["refused"] and "rank(s) [0]" in out["huge"] and out["after"] == [0, 1, 2]
