"""Which boundaries vouch for the state when the expert recipe runs (paper section 8: K counts the checks of
one recipe cycle)."""

from __future__ import annotations

from types import SimpleNamespace

from scout_core.config import ScoutConfig
from scout_core.handle import ScoutHandle


def _handle(catalog: object | None, experts: bool = True) -> SimpleNamespace:
    return SimpleNamespace(experts=SimpleNamespace(catalog=catalog) if experts else None, config=ScoutConfig(),
                           replay=SimpleNamespace(health=SimpleNamespace(disabled=set())))


HIDDEN = SimpleNamespace(checked=True, recipes=["hidden"])
NOTHING = SimpleNamespace(checked=False, recipes=[])
EXPERT = object()


def test_with_the_expert_recipe_exactly_the_expert_checks_certify():
    """K is one recipe cycle of expert checks (with or without a catalog): a dense check between them does not
    advance it."""
    for catalog in (object(), None):
        h = _handle(catalog=catalog)
        assert not ScoutHandle._certifies(h, HIDDEN, None)
        assert ScoutHandle._certifies(h, HIDDEN, EXPERT)
        assert ScoutHandle._certifies(h, NOTHING, EXPERT)


def test_without_experts_the_layer_checks_certify():
    h = _handle(catalog=None, experts=False)
    assert ScoutHandle._certifies(h, HIDDEN, None)
    assert not ScoutHandle._certifies(h, NOTHING, None)
    assert not ScoutHandle._certifies(h, SimpleNamespace(checked=True, recipes=["output"]), None)


def test_a_missing_check_starts_the_recipe_cycle_over():
    """K = 4: a skipped check in the middle means the next four accepted checks, not the remaining ones,
    complete the cycle (any K consecutive checks of the rotation cover every recipe; K with a hole need not)."""
    from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier

    cert = Certifier(recipes_per_cycle=4)
    clean, missing = BoundaryEvidence(), BoundaryEvidence(missing=True)
    actions = [cert.on_boundary(step, missing if step == 3 else clean) for step in range(1, 9)]
    assert actions[2] is Action.SKIP
    assert [s for s, a in enumerate(actions, start=1) if a is Action.CAPTURE_AND_PERSIST] == [7]


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
