"""TorchTitan's grouped experts as scout_core's expert recipe sees them: one view per local expert."""

from __future__ import annotations

import torch
from torchtitan.models.common.moe import GroupedExperts  # triton stubbed by conftest.py

from scout_core.moe.binding import MoEBinding
from scout_torchtitan.moe import GroupedExpertSlice


def _grouped(seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    g = GroupedExperts.Config(dim=16, hidden_dim=32, num_experts=4).build()
    with torch.no_grad():
        for w in (g.w1_EFD, g.w2_EDF, g.w3_EFD):
            w.normal_(0, 0.2)
    return g


def test_a_view_computes_its_expert_as_the_grouped_call_does_and_takes_its_own_rows():
    g = _grouped()
    counts = torch.tensor([8, 0, 16, 8])
    x = torch.randn(int(counts.sum()), 16)
    full = g(x, counts)
    ends = torch.cumsum(counts, 0)
    for e in range(4):
        view = GroupedExpertSlice(g, e)
        rows = MoEBinding.rows(view, (x, counts), {})
        start = int(ends[e - 1]) if e else 0
        assert torch.equal(rows, x[start:int(ends[e])])
        if rows.shape[0]:
            assert torch.equal(view(rows), full[start:int(ends[e])])


def test_a_views_gradients_are_its_own_experts_alone():
    g = _grouped()
    view = GroupedExpertSlice(g, 2)
    params = list(view.parameters())
    assert [tuple(p.shape) for p in params] == [(1, 32, 16), (1, 16, 32), (1, 32, 16)]
    x = torch.randn(8, 16, requires_grad=True)
    out = view(x)
    grads = torch.autograd.grad([out], [x, *params], grad_outputs=[torch.ones_like(out)])
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    assert view.trained_parameters() == [g.w1_EFD, g.w2_EDF, g.w3_EFD]
    assert g.w1_EFD.grad is None  # functional gradients only: training's .grad untouched
