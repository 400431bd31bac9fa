"""Which boundaries vouch for the state when the expert recipe runs (paper section 8: K counts the checks of
one recipe cycle)."""

from __future__ import annotations

from types import SimpleNamespace

from scout_core.config import ScoutConfig
from scout_core.handle import ScoutHandle


def _handle(catalog: object | None) -> SimpleNamespace:
    return SimpleNamespace(experts=SimpleNamespace(catalog=catalog), config=ScoutConfig(),
                           replay=SimpleNamespace(health=SimpleNamespace(disabled=set())))


HIDDEN = SimpleNamespace(checked=True, recipes=["hidden"])
NOTHING = SimpleNamespace(checked=False, recipes=[])
EXPERT = object()


def test_with_a_catalog_exactly_the_expert_checks_certify():
    """K is one recipe cycle of expert checks: a dense check between them does not advance it."""
    h = _handle(catalog=object())
    assert not ScoutHandle._certifies(h, HIDDEN, None)
    assert ScoutHandle._certifies(h, HIDDEN, EXPERT)
    assert ScoutHandle._certifies(h, NOTHING, EXPERT)


def test_without_a_catalog_the_layer_checks_certify():
    h = _handle(catalog=None)
    assert ScoutHandle._certifies(h, HIDDEN, None)
    assert ScoutHandle._certifies(h, HIDDEN, EXPERT)
    assert not ScoutHandle._certifies(h, NOTHING, EXPERT)
    assert not ScoutHandle._certifies(h, SimpleNamespace(checked=True, recipes=["output"]), None)


def test_expert_width_reads_linear_experts_and_raw_weights():
    import torch
    from torch import nn

    from scout_core.moe.binding import expert_width

    class SwiGLU(nn.Module):  # Mixtral / Hugging Face style: Linear stores [out, in]
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(24, 96), nn.Linear(96, 24), nn.Linear(24, 96)

    class Raw(nn.Module):  # Megatron grouped style: [hidden, ffn]
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Parameter(torch.zeros(24, 96))

    assert expert_width(SwiGLU()) == 24
    assert expert_width(Raw()) == 24
    assert expert_width(SwiGLU(), hidden_size=7) == 7
