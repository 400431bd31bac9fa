"""The source's optimizer slice for its peers: what is sent, what a receiver refuses, and that a healthy peer's
replay of it equals the source's live update (so a defective kernel is the only way to differ)."""

from __future__ import annotations

import pytest
import torch

from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.optimizer_source import MAX_ELEMS, _checked, _replay, source_inputs
from scout_core.signature import sign_many
from scout_core.wire import decode, encode


def _stepped(n: int = 300, **opt_kwargs):
    """A parameter of ``n`` elements after two AdamW steps, with the slice of the third captured before it."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW([p], lr=1e-2, **opt_kwargs)
    sl = OptimizerSlice(opt, slice_elems=n)
    for _ in range(3):
        p.grad = torch.randn(n)
        if _ == 2:
            sl.before_step()
        opt.step()
    return p, opt, sl


def test_a_peer_replays_the_sources_slice_to_the_sources_live_update():
    p, opt, sl = _stepped()
    sent = decode(encode(source_inputs(sl.pending)))  # what crosses the wire, and back
    peer = OptimizerSlice(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-2), slice_elems=3)
    signature, nonfinite = _replay(peer, sent)
    assert signature == sign_many([p.detach()])[0].signature and nonfinite == 0


def test_what_is_sent_is_capped_plain_and_on_the_host():
    _, _, sl = _stepped(n=MAX_ELEMS + 64)
    sent = source_inputs(sl.pending)
    assert sent["value"].numel() == sent["grad"].numel() == MAX_ELEMS
    assert sent["state"]["exp_avg"].numel() == MAX_ELEMS and sent["state"]["step"].numel() == 1
    sl.pending["hyper"]["fn"] = print  # not plain data: left for the peer's own group to supply
    assert "fn" not in source_inputs(sl.pending)["hyper"] and source_inputs(None) is None


def test_a_large_whole_parameter_state_is_not_sent():
    _, _, sl = _stepped(n=256)
    sl.pending["state"]["absmax"] = torch.ones(MAX_ELEMS + 1)  # an 8-bit optimizer's block scales, say
    assert source_inputs(sl.pending) is None


@pytest.mark.parametrize("bad", [
    [1, 2],
    {"value": torch.ones(3)},
    {"value": torch.ones(3), "grad": torch.ones(4), "state": {}, "scalars": {}, "hyper": {}, "group": 0},
    {"value": torch.ones(MAX_ELEMS + 1), "grad": torch.ones(MAX_ELEMS + 1), "state": {}, "scalars": {}, "hyper": {},
     "group": 0},
    {"value": torch.ones(3), "grad": torch.ones(3), "state": {}, "scalars": {}, "hyper": {}, "group": "0"},
])
def test_a_malformed_slice_is_refused(bad):
    with pytest.raises(ValueError):
        _checked(bad)


def test_nothing_from_the_source_is_no_evidence():
    _, _, sl = _stepped()
    assert _replay(sl, None) is None
