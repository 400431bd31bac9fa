"""The expert recipe's shapes and widths (certification's coverage of its cycle: tests/test_coverage.py)."""

from __future__ import annotations

from types import SimpleNamespace


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
