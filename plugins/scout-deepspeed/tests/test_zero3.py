"""ZeRO-3 replay: DeepSpeed's module hooks set aside while a layer replays, put back afterwards, also on errors."""

import pytest
import torch
from torch import nn

from scout_deepspeed.zero3 import gather_zero3, module_hooks_set_aside


def _hooked() -> tuple[nn.Module, list[str]]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    calls: list[str] = []
    for name, m in model.named_modules():
        m.register_forward_pre_hook(lambda *_a, n=name: calls.append(f"pre:{n}"))
        m.register_forward_hook(lambda *_a, n=name: calls.append(f"post:{n}"))
        m.register_full_backward_hook(lambda *_a, n=name: calls.append(f"bwd:{n}"))
    return model, calls


def test_a_layer_replays_without_any_module_hook_and_gets_them_back():
    model, calls = _hooked()
    x = torch.randn(2, 4, requires_grad=True)
    with module_hooks_set_aside(model):
        out = model(x)
        torch.autograd.grad(out.sum(), [x, *model.parameters()])
    assert calls == []
    model(x).sum().backward()
    assert {c.split(":")[0] for c in calls} == {"pre", "post", "bwd"} and len(calls) == 12


def test_hooks_come_back_when_the_replay_fails():
    model, calls = _hooked()
    with pytest.raises(RuntimeError), module_hooks_set_aside(model):
        raise RuntimeError("replay failed")
    model(torch.randn(2, 4))
    assert len(calls) == 8


def test_gather_of_a_layer_without_zero3_parameters_only_sets_hooks_aside():
    model, calls = _hooked()
    forward, release = gather_zero3(model)
    forward(torch.randn(2, 4))
    assert calls == []
    release()
    model(torch.randn(2, 4))
    assert len(calls) == 8
