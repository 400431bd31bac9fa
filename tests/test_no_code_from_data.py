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
    allow_call_closures,
    allow_call_packages,
    decode_metadata,
    decode_spec,
    encode_spec,
    spec_from_tensor,
    spec_to_tensor,
)
from scout_core.testing.launcher import RankContext, init_gloo, launch

allow_call_packages(__name__.split(".")[0])
allow_call_closures(__name__)  # the BlockMask below closes over a lambda of this module


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


@pytest.mark.parametrize("name", [
    "torch:os.system",                       # a module torch imported, reached through torch's namespace
    "torch.serialization:pickle.loads",
    "torch:builtins.eval",
    "torch:onnx.export",                     # torch's module __getattr__ would import torch.onnx
    "torch:Tensor.__reduce_ex__",
])
def test_names_resolve_only_to_what_the_named_module_itself_defines(name: str) -> None:
    with pytest.raises(NotShippable):
        spec_from_tensor(_spec_doc({"val": {"fn": name}}))


def _wrapped_fn_node(cmd: str) -> dict[str, Any]:
    """A torch inner function whose closure calls ``fn(*inputs)``: with fn = os.system, a command."""
    import torch.autograd.gradcheck  # noqa: F401 - imported, so only the rebuild rules stand in the way

    line = vars(__import__("sys").modules["torch.autograd.gradcheck"])["_with_prepare_inputs"].__code__
    inner = next(c for c in line.co_consts if getattr(c, "co_name", "") == "wrapped_fn")
    # fn is torch.save, which names resolve to: only the rule on rebuilding torch's closures refuses this
    cells = {"fast_mode": {"val": False}, "fn": {"val": {"fn": "torch.serialization:save"}}, "input_idx": {"val": 0},
             "input_to_perturb": {"val": None}, "inputs": {"seq": "builtins:tuple", "items": [{"val": cmd}]}}
    return {"function": "torch.autograd.gradcheck:_with_prepare_inputs.<locals>.wrapped_fn",
            "line": inner.co_firstlineno, "defaults": {"val": None}, "kwdefaults": {"val": None},
            "cells": [cells[n] for n in inner.co_freevars]}


def test_a_block_mask_cannot_carry_a_torch_closure_that_runs_a_command(tmp_path: Path) -> None:
    """The review's exploit: a BlockMask whose ``as_tuple`` (flex attention calls it) is shadowed by a torch
    inner function whose cells hold a function and its arguments. Each of its steps is refused on its own: the
    field (a method's name), the closure (its module is not registered for closures: any inner function could
    call what the sender put in its cells), a function by a borrowed name."""
    from torch.nn.attention.flex_attention import create_block_mask

    marker = tmp_path / "ran"
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 128, 128, device="cpu")
    tensors, spec = flatten_call(mask)
    node = encode_spec(spec)
    for inner in (_wrapped_fn_node(str(marker)), {"val": {"fn": "torch:os.system"}}, {"val": 1}):
        forged = {**node, "fields": [*node["fields"], ["as_tuple", inner]]}
        with pytest.raises(NotShippable):
            decode_spec(forged)                        # a field that shadows a method of the class
        if inner != {"val": 1}:
            with pytest.raises(NotShippable):
                decode_spec(inner)                     # the closure, or the function by a borrowed name
    cm = {"function": "torch.serialization:contextmanager.<locals>.helper", "line": 1,
          "defaults": {"val": None}, "kwdefaults": {"val": None}, "cells": []}
    with pytest.raises(NotShippable):
        decode_spec(cm)                                # code of contextlib, reached through torch's namespace
    assert decode_spec(node)[1] is type(mask) and not marker.exists()


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
                   {**good, "rng": {"cpu": "state"}}, {**good, "tensors": [((2,), torch.float32, "gpu9")]},
                   {**good, "tensors": [((1 << 40, 1 << 20), torch.float32, "cuda")]},  # a flipped high bit
                   {**good, "grads": {0: ((1 << 36,), torch.float64, "cpu")}}):
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
    # A source announcing more than a payload may hold (the limit lowered here, as 2**40 bytes cannot be sent):
    # every rank refuses from the length, before the payload buffer is allocated or anything else moves.
    limit, wire.MAX_WIRE_BYTES = wire.MAX_WIRE_BYTES, 64
    try:
        wire.broadcast_bytes(b"x" * 100 if ctx.rank == 0 else None, 0, what="huge")
    except wire.WireError as e:
        out["huge"] = str(e)
    finally:
        wire.MAX_WIRE_BYTES = limit
    # Payloads that fit the first round, fill it exactly, or need the second (one rank's only): every rank
    # reads every length from the first round and takes the same path.
    width = wire._fast_width(3)
    out["sizes"] = [len(b) for b in wire.all_gather_bytes(b"y" * (width + 1 if ctx.rank == 1 else ctx.rank))]
    out["full"] = wire.all_gather_bytes(bytes([ctx.rank]) * width)
    out["wide"] = [wire.broadcast_bytes(bytes([7]) * n if ctx.rank == 2 else b"", 2)
                   for n in (0, wire._BROADCAST_FAST_WIDTH, wire._BROADCAST_FAST_WIDTH + 1)]
    out["after"] = wire.all_gather_data(ctx.rank)  # the group still works: nobody hung
    dist.destroy_process_group()
    return out


def test_wire_collectives_agree_and_fail_together_on_three_ranks() -> None:
    result = launch(_exchanges, 3, timeout_s=60)
    assert result.ok, result.failures()
    for out in result.values():
        assert out["gather"] == [{"rank": r} for r in range(3)] and out["bcast"] == ("from", 1)
        assert "rank(s) [2]" in out["refused"] and "rank(s) [0]" in out["huge"] and out["after"] == [0, 1, 2]
        width = wire._fast_width(3)
        assert out["sizes"] == [0, width + 1, 2] and out["full"] == [bytes([r]) * width for r in range(3)]
        assert out["wide"] == [bytes([7]) * n for n in (0, wire._BROADCAST_FAST_WIDTH, wire._BROADCAST_FAST_WIDTH + 1)]


_UNSAFE = ("all_gather_object(", "broadcast_object_list(", "gather_object(", "scatter_object_list(",
           "pickle.load", "Unpickler", "weights_only=False", "marshal.load", "yaml.load(")
# Where a pickle is read on purpose, and why that is not data from outside this process.
_EXEMPT = {
    "scout_core/extra_state.py": "decodes the bytes this rank's own live module just handed out (Transformer "
                                 "Engine's FP8 state), never bytes read from disk or a peer",
    "scout_core/testing/launcher.py": "test machinery: a forked child's result sent to its own parent",
    "scout_core/checkpoint/vetted_state.py": "a dry-run unpickler that knows only tensors, dtypes and containers, "
                                             "checking saved module state before the module unpickles it",
}


def test_no_production_module_reads_a_pickle() -> None:
    """A static scan, like test_layout: every object collective and unpickling call is gone from the product,
    apart from the two named exemptions (docs/security.md explains them)."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in [*root.glob("scout_core/**/*.py"), *root.glob("plugins/*/scout_*/**/*.py")]:
        rel = path.relative_to(root).as_posix()
        if rel in _EXEMPT:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(u in code for u in _UNSAFE) and '"' not in code.split("(")[0]:
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


class _Fp8Like(torch.nn.Module):
    """Keeps its state the way Transformer Engine >= 2 does: pickle.dumps of a dict in a uint8 tensor, unpickled
    by set_extra_state."""

    def __init__(self) -> None:
        super().__init__()
        self.state = {"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 3}}

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(self.state)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.state = pickle.loads(state.numpy().tobytes())


def test_saved_module_state_is_vetted_before_the_module_unpickles_it(tmp_path: Path) -> None:
    from scout_core.checkpoint.vetted_state import UnsafeState
    from scout_core.extra_state import capture_extra_states, restore_extra_states

    model = torch.nn.Sequential(_Fp8Like())
    saved = capture_extra_states(model)
    model[0].state = {}
    restore_extra_states(model, saved)  # real FP8-like state: handed over as before
    assert torch.equal(model[0].state["scale_fwd"], torch.ones(3))
    marker = tmp_path / "ran"
    planted = {"0": torch.frombuffer(bytearray(pickle.dumps({"x": _Reduce(f"touch {marker}")})), dtype=torch.uint8)}
    with pytest.raises(UnsafeState, match="module 0"):
        restore_extra_states(model, planted)
    assert not marker.exists() and torch.equal(model[0].state["scale_fwd"], torch.ones(3))


def _fake_te_recipe_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in for transformer_engine.common.recipe: what TE >= 2 pickles into its FP8 state (a DelayedScaling
    dataclass whose Format enum members hold named tuples, and a named-tuple field)."""
    import enum
    import sys
    import types
    from typing import NamedTuple

    name = "transformer_engine.common.recipe"
    mod = types.ModuleType(name)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    class _OverrideLinearPrecision(NamedTuple):
        fprop: bool = False
        dgrad: bool = False
        wgrad: bool = False

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        override_linear_precision: _OverrideLinearPrecision = _OverrideLinearPrecision()

    for cls in (_FormatHelper, Format, _OverrideLinearPrecision, DelayedScaling):
        cls.__module__, cls.__qualname__ = name, cls.__name__
        setattr(mod, cls.__name__, cls)
    for parent in ("transformer_engine", "transformer_engine.common"):  # removed again after the test
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_transformer_engines_fp8_state_with_its_recipe_is_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE >= 2 pickles its recipe with the FP8 tensors: a restore must accept it, or every FP8 job's snapshot
    would fail to restore."""
    from scout_core.extra_state import capture_extra_states, restore_extra_states

    recipe = _fake_te_recipe_module(monkeypatch).DelayedScaling()
    model = torch.nn.Sequential(_Fp8Like())
    model[0].state = {"recipe": recipe, "scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 3}}
    saved = capture_extra_states(model)
    model[0].state = {}
    restore_extra_states(model, saved)
    assert model[0].state["recipe"] == recipe


@pytest.mark.parametrize("shape", ["1d-uint8", "2d-uint8", "int8"])
def test_a_planted_pickle_of_any_dtype_or_shape_is_refused(tmp_path: Path, shape: str) -> None:
    """TE unpickles ``state.numpy().tobytes()`` of whatever tensor it is given, so every tensor is vetted."""
    from scout_core.checkpoint.vetted_state import UnsafeState
    from scout_core.extra_state import restore_extra_states

    marker = tmp_path / "ran"
    raw = torch.frombuffer(bytearray(pickle.dumps({"x": _Reduce(f"touch {marker}")})), dtype=torch.uint8)
    value = {"1d-uint8": raw, "2d-uint8": raw.reshape(1, -1), "int8": raw.view(torch.int8)}[shape]
    model = torch.nn.Sequential(_Fp8Like())
    with pytest.raises(UnsafeState):
        restore_extra_states(model, {"0": value})
    assert not marker.exists()
