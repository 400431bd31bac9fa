"""Replay: optimizer-slice self-check, RNG alignment across peers, training left bitwise unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scout_core.config import ReplayCadence, ReplayConfig
from scout_core.consensus import C3Status
from scout_core.replay.engine import ReplayEngine
from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.rng import capture_rng, replay_rng_scope
from scout_core.signature import sign_many
from scout_core.testing.launcher import RankContext, init_gloo, launch


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-3),
])
def test_optimizer_slice_replay_matches_the_live_update(make_opt):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))
    opt = make_opt(net.parameters())
    sl = OptimizerSlice(opt, slice_elems=1000)
    for _ in range(6):  # several steps: optimizer state exists and the slice rotates
        net(torch.randn(8, 64)).square().mean().backward()
        sl.before_step()
        opt.step()
        surfaces = dict(sl.after_step())
        opt.zero_grad()
        assert surfaces["optimizer.self_check"] is True
        assert surfaces["optimizer.replayed"] == surfaces["optimizer.live"]


class _ModeOnTheObject(torch.optim.Optimizer):
    """As DeepSpeed's FusedAdam keeps ``adam_w_mode``: a constructor argument stored on the object, not in the
    parameter group."""

    def __init__(self, params, lr=1e-2, decoupled=True):
        super().__init__(params, {"lr": lr})
        self.decoupled = decoupled

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.9 if self.decoupled else 1.0).sub_(group["lr"] * p.grad)


def test_optimizer_slice_replays_a_mode_the_optimizer_keeps_on_itself():
    net = torch.nn.Linear(10, 10)
    opt = _ModeOnTheObject(net.parameters(), decoupled=False)  # the default would replay another rule
    sl = OptimizerSlice(opt, slice_elems=100)
    net(torch.randn(3, 10)).sum().backward()
    sl.before_step()
    opt.step()
    assert dict(sl.after_step())["optimizer.self_check"] is True


def test_optimizer_slice_self_check_catches_a_corrupted_update():
    torch.manual_seed(0)
    net = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sl = OptimizerSlice(opt, slice_elems=100)
    net(torch.randn(3, 10)).sum().backward()
    sl.before_step()
    opt.step()
    with torch.no_grad():
        net.weight.view(-1)[3] += 1e-3  # the live update went wrong on this rank
    assert dict(sl.after_step())["optimizer.self_check"] is False


class _SubGroupWrapper:
    """DeepSpeed ZeRO-3's step with several sub-groups (``sub_group_size``): the inner optimizer steps once per
    sub-group, each time with only that sub-group's flat partition in its parameter group."""

    def __init__(self, flats, faulty=None):
        self.flats, self.faulty = flats, faulty
        self.inner = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-2)
        self.inner.param_groups[0]["params"] = []

    def step(self, grads):
        for i, (flat, grad) in enumerate(zip(self.flats, grads, strict=True)):
            flat.grad = grad
            self.inner.param_groups[0]["params"] = [flat]
            self.inner.step()
            self.inner.param_groups[0]["params"] = []
            if i == self.faulty:
                with torch.no_grad():
                    flat.mul_(1.000001)  # this sub-group's live update goes wrong on this rank, every step


def test_optimizer_slice_rotates_over_the_sub_groups_of_one_step():
    torch.manual_seed(0)
    for faulty in (None, 0):
        flats = [torch.nn.Parameter(torch.randn(256)) for _ in range(3)]
        wrapper = _SubGroupWrapper(flats, faulty)
        sl = OptimizerSlice(wrapper.inner, slice_elems=64)
        wrapper.inner.register_step_pre_hook(lambda *_, sl=sl: sl.before_step() if sl.inner_step() else None)
        checked, verdicts = [], []
        for _ in range(7):
            sl.end_step()  # the boundary of the previous step
            wrapper.step([torch.randn(256) for _ in flats])
            checked.append(next(i for i, f in enumerate(flats) if f is sl.pending["param"]))
            verdicts.append(dict(sl.after_step())["optimizer.self_check"])
        # the first step counts the inner steps (a slice in the first); then one sub-group per check, in turn
        assert checked == [0, 1, 2, 0, 1, 2, 0]
        assert verdicts == ([True] * 7 if faulty is None else [c != faulty for c in checked])


def test_every_sub_group_gets_every_offset_of_its_slice():
    """Three sub-groups whose partitions have three slice offsets each: each sub-group's offsets rotate on their
    own (a count shared with the rotation over sub-groups gave sub-group j only offset j)."""
    torch.manual_seed(0)
    flats = [torch.nn.Parameter(torch.randn(192)) for _ in range(3)]
    wrapper = _SubGroupWrapper(flats)
    sl = OptimizerSlice(wrapper.inner, slice_elems=64)
    wrapper.inner.register_step_pre_hook(lambda *_: sl.before_step() if sl.inner_step() else None)
    seen: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    for _ in range(10):
        sl.end_step()
        wrapper.step([torch.randn(192) for _ in flats])
        seen[next(i for i, f in enumerate(flats) if f is sl.pending["param"])].add(sl.pending["slice"].start)
        assert dict(sl.after_step())["optimizer.self_check"] is True
    assert seen == {0: {0, 64, 128}, 1: {0, 64, 128}, 2: {0, 64, 128}}


def test_rng_scope_installs_source_state_and_restores_local():
    torch.manual_seed(1)
    source = capture_rng()
    torch.manual_seed(2)
    before = torch.get_rng_state()
    with replay_rng_scope(source):
        a = torch.rand(4)
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(1)
    assert torch.equal(a, torch.rand(4))


class DropNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Dropout(0.3), torch.nn.Tanh()) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _train(ctx: RankContext):
    init_gloo(ctx)
    torch.manual_seed(0)
    if ctx.args.get("layout") == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = DropNet()
        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp_shard",))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.module = model  # the same attribute path as DDP below
    else:
        model = torch.nn.parallel.DistributedDataParallel(DropNet())
    torch.manual_seed(100 + ctx.rank)  # different RNG streams per rank, as in real data-parallel jobs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = None
    if ctx.args["replay"]:
        cfg = ReplayConfig(cadence=ReplayCadence(hidden=1, optimizer=1), optimizer_slice_elems=64)
        engine = ReplayEngine(list(model.module.layers), opt, config=cfg)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(6):
        model(torch.randn(5, 12, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    statuses = sorted({r.status.value for res in engine.history for r in res.surfaces}) if engine else []
    tensors = [p.detach() for p in model.parameters()] + [torch.get_rng_state()]
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"sigs": [s.signature for s in sign_many(tensors)], "statuses": statuses}


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_replay_leaves_training_bitwise_unchanged_and_aligns_dropout(layout):
    off = launch(_train, 4, timeout_s=120, args={"replay": False, "layout": layout})
    on = launch(_train, 4, timeout_s=120, args={"replay": True, "layout": layout})
    assert off.ok and on.ok, off.failures() + on.failures()
    for a, b in zip(off.values(), on.values()):
        assert a["sigs"] == b["sigs"]  # parameters, optimizer state and the training RNG stream
    # Dropout draws from the source's RNG on every peer: nothing disagrees.
    assert on.values()[0]["statuses"] == [C3Status.AGREE.value]


def test_a_users_hook_that_fsdp2_replay_passes_by_is_named_once(caplog):
    """FSDP2 replay calls the gathered layer's forward itself, past the module's own hooks: a user's hook there is
    named once in a warning (torch's and SCOUT's own are not), never skipped in silence."""
    import logging

    from scout_core.replay.layer import _say_hooks_skipped

    layer = torch.nn.Linear(4, 4)

    def users_hook(_m, _a, _out):
        return None

    layer.register_forward_hook(users_hook)
    with caplog.at_level(logging.WARNING, logger="scout"):
        _say_hooks_skipped(layer)
        _say_hooks_skipped(layer)
        _say_hooks_skipped(torch.nn.Linear(4, 4))  # no hooks: nothing to say
        patched = torch.nn.Linear(4, 4)
        patched.forward = lambda x: x  # an instance's own forward: replay runs the class's
        _say_hooks_skipped(patched)
    said = [r.getMessage() for r in caplog.records if "past the module's own hooks" in r.getMessage()]
    assert len(said) == 2 and "users_hook" in said[0] and "<lambda>" in said[1], said
