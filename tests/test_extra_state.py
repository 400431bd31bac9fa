"""Module extra state (Transformer Engine's FP8 scaling state): kept in snapshots, untouched by replay, compared.

Transformer Engine cannot be imported on this machine; :class:`FP8StyleLinear` keeps its state the way TE's
modules do: an amax history that is not a parameter or a buffer, rolled by every training forward, handed out by
``get_extra_state`` (serialized, as TE serializes it) and taken back by ``set_extra_state``.
"""

from __future__ import annotations

import io

import pytest
import torch

from scout_core.checkpoint.snapshot import SnapshotEngine, restore_state
from scout_core.extra_state import capture_extra_states, extra_state_tensors, restore_extra_states
from scout_core.replay.capture import LayerCapture
from scout_core.replay.layer import replay_layer
from scout_core.replay.shipping import call_meta, receive_buffers


class FP8StyleLinear(torch.nn.Linear):
    """A linear layer with TE-style FP8 scaling state: the last inputs' amax, and a scale derived from it that
    the forward uses (so the state changes what the layer computes)."""

    def __init__(self, n: int, *, serialize: str = "tensor") -> None:
        super().__init__(n, n)
        self.amax_history = torch.zeros(4)
        self.serialize = serialize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 / (1.0 + self.amax_history.max())
        if self.training:
            self.amax_history = torch.roll(self.amax_history, 1)
            self.amax_history[0] = x.detach().abs().max()
        return super().forward(x * scale)

    def get_extra_state(self) -> object:
        buf = io.BytesIO()
        torch.save({"amax_history": self.amax_history.clone()}, buf)
        if self.serialize == "bytesio":  # older Transformer Engine
            buf.seek(0)
            return buf
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)  # Transformer Engine >= 1.x

    def set_extra_state(self, state: object) -> None:
        data = state if isinstance(state, io.BytesIO) else io.BytesIO(state.numpy().tobytes())
        data.seek(0)
        self.amax_history = torch.load(data, weights_only=True)["amax_history"].clone()


def _net(serialize: str = "tensor") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(FP8StyleLinear(8, serialize=serialize), torch.nn.ReLU(), torch.nn.Linear(8, 8))


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("serialize", ["tensor", "bytesio"])
def test_snapshot_keeps_and_restores_the_fp8_state(serialize, tmp_path):
    net = _net(serialize)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = SnapshotEngine([net], [opt])
    _train(net, opt, 3)
    engine.capture(step=3)
    kept = net[0].amax_history.clone()
    _train(net, opt, 2)  # the amax history rolls on
    assert not torch.equal(net[0].amax_history, kept)
    snap = engine.result()
    # The snapshot travels through a file read back with weights_only, as SCOUT's stores read it.
    torch.save(snap, tmp_path / "snap.pt")
    snap = torch.load(tmp_path / "snap.pt", weights_only=True)
    fresh = _net(serialize)
    restore_state([fresh], [torch.optim.SGD(fresh.parameters(), lr=0.1)], snap)
    assert torch.equal(fresh[0].amax_history, kept)
    engine.close()


def test_a_restore_into_other_modules_is_refused():
    net = _net()
    saved = capture_extra_states(net)
    with pytest.raises(ValueError, match="extra state differs"):
        restore_extra_states(torch.nn.Sequential(torch.nn.Linear(8, 8)), saved)


def _replayed(layer: FP8StyleLinear, **kwargs):
    x = torch.randn(4, 8, requires_grad=True)
    cap = LayerCapture(layer)
    cap.arm()
    layer(x).square().sum().backward()
    captured = cap.take()
    cap.remove()
    call = receive_buffers(call_meta(captured, {}), captured, torch.device("cpu"), is_source=True)
    return replay_layer(layer, layer, "l", call, variants=[0.1, 1.0, 10.0], providers={}, deterministic=True,
                        compare_param_state=True, vet=True, **kwargs)


def test_replay_leaves_the_fp8_state_as_training_left_it():
    torch.manual_seed(1)
    layer = FP8StyleLinear(8).train()
    layer(torch.randn(4, 8))
    x = torch.randn(4, 8, requires_grad=True)
    cap = LayerCapture(layer)
    cap.arm()
    layer(x).sum().backward()
    captured = cap.take()
    cap.remove()
    before = layer.amax_history.clone()
    call = receive_buffers(call_meta(captured, {}), captured, torch.device("cpu"), is_source=True)
    done = replay_layer(layer, layer, "l", call, variants=[0.1, 1.0, 10.0], providers={}, deterministic=True,
                        compare_param_state=True, vet=True)
    assert torch.equal(layer.amax_history, before), "a replay rolled the amax history training uses next"
    assert done.reproducible is True  # the vetting run starts from the same state as the first


def _param_state(layer: FP8StyleLinear, **kwargs) -> object:
    torch.manual_seed(2)
    return dict(_replayed(layer, **kwargs).surfaces)["l.param_state"]


def test_the_fp8_state_is_compared_with_the_parameter_state():
    a, b = FP8StyleLinear(8), FP8StyleLinear(8)
    b.load_state_dict(a.state_dict())
    assert _param_state(a) == _param_state(b)
    a, b = FP8StyleLinear(8), FP8StyleLinear(8)
    b.load_state_dict(a.state_dict())
    b.amax_history[2] = 7.0  # a corrupted scaling state on one peer, weights alike
    assert _param_state(a) != _param_state(b)
    # Where each rank scales by its own amax (Megatron's --tp-only-amax-red), only the weights are compared.
    assert _param_state(a, compare_extra_state=False) == _param_state(b, compare_extra_state=False)


def test_extra_state_signatures_cover_every_kind():
    saved = {"t": torch.arange(3, dtype=torch.uint8), "none": None, "empty": io.BytesIO(b"")}
    from scout_core.extra_state import _storable

    tensors = extra_state_tensors({k: _storable(v) for k, v in saved.items()})
    assert [t.dtype for t in tensors] == [torch.uint8] * 3


def _te2_state(seed: int) -> torch.Tensor:
    """Transformer Engine >= 2's serialized FP8 state: ``pickle.dumps`` of a dict of tensors and flags."""
    import pickle

    torch.manual_seed(seed)
    state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.rand(4, 3),
             "extra_fp8_variables": {"num_gemms": 1, "recipe": object()}}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def test_serialized_fp8_state_is_compared_by_content_not_by_its_pickle():
    """A pickle of a tensor holds its storage's address: the same state pickles to other bytes on another rank.
    Two such pickles of equal state must sign alike, and a changed amax must not."""
    from scout_core.extra_state import _storable
    from scout_core.signature import sign_many

    def signed(t: torch.Tensor) -> list[int]:
        return [x.signature for x in sign_many(extra_state_tensors({"l": _storable(t)}))]

    a, b = _te2_state(0), _te2_state(0)
    assert not torch.equal(a, b)  # equal state, other bytes (each pickle names its own storages)
    assert signed(a) == signed(b)
    assert signed(a) != signed(_te2_state(1))


def test_torch_saved_fp8_state_is_compared_by_content():
    """Older Transformer Engine hands out ``torch.save`` of its FP8 state (a zip archive naming each storage's
    device): decoded onto the host and compared by content; a different amax still differs."""
    from scout_core.extra_state import _storable
    from scout_core.signature import sign_many

    def saved(amax: float, legacy: bool = False) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save({"scale_fwd": torch.ones(3), "amax_history_fwd": torch.full((4, 3), amax)}, buf,
                   _use_new_zipfile_serialization=not legacy)
        buf.seek(0)
        return buf

    def signed(state: object) -> list[int]:
        return [x.signature for x in sign_many(extra_state_tensors({"l": _storable(state)}))]

    for legacy in (False, True):
        assert signed(saved(1.0, legacy)) == signed(saved(1.0, legacy))
        assert signed(saved(1.0, legacy)) != signed(saved(2.0, legacy)), "a different amax must not compare equal"
