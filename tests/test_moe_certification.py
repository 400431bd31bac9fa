"""Which boundaries vouch for the state when the expert recipe runs (paper section 8: K counts the checks of
one recipe cycle)."""

from __future__ import annotations

from types import SimpleNamespace

from scout_core.boundary import StepBoundary
from scout_core.config import ScoutConfig


def _handle(catalog: object | None, experts: bool = True, *, closes: bool = False,
            dense: bool = False) -> SimpleNamespace:
    boundary = SimpleNamespace(experts=SimpleNamespace(catalog=catalog) if experts else None, config=ScoutConfig(),
                               replay=SimpleNamespace(health=SimpleNamespace(disabled=set())),
                               certifier=SimpleNamespace(at_cycle_boundary=closes),
                               _dense_in_cycle=dense)
    boundary.parts = boundary  # the boundary reads the parts (experts, config, replay, certifier) there
    return boundary


HIDDEN = SimpleNamespace(checked=True, recipes=["hidden"])
NOTHING = SimpleNamespace(checked=False, recipes=[])
EXPERT = object()


def test_with_the_expert_recipe_exactly_the_expert_checks_certify():
    """K is one recipe cycle of expert checks (with or without a catalog): a dense check between them does not
    advance it."""
    for catalog in (object(), None):
        h = _handle(catalog=catalog)
        assert not StepBoundary._certifies(h, HIDDEN, None)
        assert StepBoundary._certifies(h, HIDDEN, EXPERT)
        assert StepBoundary._certifies(h, NOTHING, EXPERT)


def test_a_cycle_closes_only_if_a_dense_layer_check_ran_in_it():
    """Expert checks alone never vouch for attention and router: the boundary that would complete the cycle
    waits for a hidden-layer check in the cycle."""
    assert not StepBoundary._certifies(_handle(None, closes=True), NOTHING, EXPERT)
    assert StepBoundary._certifies(_handle(None, closes=True, dense=True), NOTHING, EXPERT)
    off = _handle(None, closes=True)
    off.config.replay.cadence.hidden = 0  # the layer recipe configured off: the expert cycle is the evidence
    assert StepBoundary._certifies(off, NOTHING, EXPERT)
    off.replay.health.disabled = {"hidden"}  # switched off by replay's health: nothing vouches
    assert not StepBoundary._certifies(off, NOTHING, EXPERT)


def test_without_experts_the_layer_checks_certify():
    h = _handle(catalog=None, experts=False)
    assert StepBoundary._certifies(h, HIDDEN, None)
    assert not StepBoundary._certifies(h, NOTHING, None)
    assert not StepBoundary._certifies(h, SimpleNamespace(checked=True, recipes=["output"]), None)


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


def test_expert_outputs_in_library_styles_and_rows_in_the_expert_dtype():
    """(out, bias) tuples, dicts and dataclasses give their first tensor; seeded rows take the expert's dtype."""
    import dataclasses

    import pytest
    import torch

    from scout_core.moe.expert_run import first_tensor, seeded_rows

    t = torch.ones(2)

    @dataclasses.dataclass
    class Out:
        aux: float
        hidden: torch.Tensor

    assert first_tensor(t) is t and first_tensor((t, None)) is t and first_tensor({"a": t}) is t
    assert first_tensor(Out(0.1, t)) is t
    with pytest.raises(TypeError, match="no tensor"):
        first_tensor((None, 1))
    assert seeded_rows(0, 1, 5, 8, torch.bfloat16).dtype is torch.bfloat16


def test_seeded_rng_scope_draws_alike_and_leaves_training_rng_alone():
    import torch

    from scout_core.replay.rng import seeded_rng_scope

    torch.manual_seed(3)
    before = torch.get_rng_state()
    with seeded_rng_scope(11):
        a = torch.rand(4)
    with seeded_rng_scope(11):
        b = torch.rand(4)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), before)


def test_a_dense_layer_holding_a_bound_moe_layer_is_refused():
    import pytest
    from torch import nn

    from scout_core.assembly import _refuse_dense_moe

    moe = nn.Module()
    moe.experts = nn.ModuleList([nn.Linear(4, 4)])
    block = nn.Sequential(nn.Linear(4, 4), moe)
    binding = SimpleNamespace(layers=[moe])
    _refuse_dense_moe([block[0]], None, binding)
    with pytest.raises(ValueError, match="layers.0, which contains a MoE layer"):
        _refuse_dense_moe([block], ["layers.0"], binding)
