"""DDP's numbers under SCOUT's bucket hook where DDP scales by something else than the world size, and hooks a
user registers through DDP's class rather than the instance (issue 32, item 4)."""

from __future__ import annotations

import pytest
import torch
from test_hooks import RecordingRecord

from scout_core.progress.hooks import ProgressTracker
from scout_core.testing.launcher import RankContext, init_gloo, launch


def _uneven_weights(ctx: RankContext):
    """Final weights of a DDP run over uneven inputs (rank r has 2 + r batches) under ``join``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(ctx)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 7))
    ddp = DDP(net, bucket_cap_mb=0.01)
    tracker = None
    if ctx.args["hooked"]:
        tracker = ProgressTracker(RecordingRecord())
        assert tracker.install_ddp_comm_hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    with ddp.join(divide_by_initial_world_size=ctx.args["initial"]):
        for _ in range(2 + ctx.rank):
            ddp(torch.randn(5, 33, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    if tracker is not None:
        tracker.remove_hooks()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("initial", [False, True])
def test_join_over_uneven_inputs_ends_bit_for_bit_as_ddp(initial):
    """With ``divide_by_initial_world_size=False`` DDP divides each iteration by the ranks not yet joined (3, then
    2, then 1 here): a hook that divided by the world size changed every weight after the first rank joined."""
    plain = launch(_uneven_weights, 3, timeout_s=120, args={"hooked": False, "initial": initial})
    hooked = launch(_uneven_weights, 3, timeout_s=120, args={"hooked": True, "initial": initial})
    assert plain.ok and hooked.ok, (plain.failures(), hooked.failures())
    for rank in range(3):
        for a, b in zip(plain.values()[rank], hooked.values()[rank]):
            assert torch.equal(a, b), f"rank {rank}: {(a != b).sum().item()} of {a.numel()} elements differ"


def _class_registered(ctx: RankContext):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Subclass(DDP):
        def register_comm_hook(self, state, hook):  # a framework's override that calls DDP's own
            self.registered = hook.__name__
            super().register_comm_hook(state, hook)

    init_gloo(ctx)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 7))
    ddp = (Subclass if ctx.args["how"] == "subclass" else DDP)(net, bucket_cap_mb=0.01)
    tracker = None
    if ctx.args["hooked"]:
        tracker = ProgressTracker(RecordingRecord())
        assert tracker.install_ddp_comm_hook(ddp)
    if ctx.args["how"] == "class":
        DDP.register_comm_hook(ddp, None, default_hooks.fp16_compress_hook)
    else:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    other = DDP(torch.nn.Linear(3, 3))  # a model SCOUT does not hook keeps DDP's own registration
    other.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        DDP.register_comm_hook(other, None, default_hooks.allreduce_hook)
        second_refused = False
    except RuntimeError:
        second_refused = True
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(3):
        ddp(torch.randn(5, 33, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if tracker is not None:
        tracker.remove_hooks()
    return {"weights": [p.detach().clone() for p in net.parameters()], "second_refused": second_refused}


@pytest.mark.parametrize("how", ["class", "subclass"])
def test_a_hook_registered_through_ddps_class_after_enable_runs_as_without_scout(how):
    """``DistributedDataParallel.register_comm_hook(ddp, ...)`` and a subclass's ``super()`` call used to reach
    DDP's own method, which raised that DDP takes one hook."""
    plain = launch(_class_registered, 3, timeout_s=120, args={"hooked": False, "how": how})
    hooked = launch(_class_registered, 3, timeout_s=120, args={"hooked": True, "how": how})
    assert plain.ok and hooked.ok, (plain.failures(), hooked.failures())
    for a, b in zip(plain.values()[0]["weights"], hooked.values()[0]["weights"]):
        assert torch.equal(a, b), f"{how}: {(a != b).sum().item()} of {a.numel()} elements differ"
    assert all(v["second_refused"] for v in plain.values() + hooked.values())


def _copied(ctx: RankContext):
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(ctx)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 4))
    tracker = ProgressTracker(RecordingRecord())
    assert tracker.install_ddp_comm_hook(ddp)
    with ddp.join(divide_by_initial_world_size=False):
        ddp(torch.randn(3, 8)).sum().backward()
    twin = copy.deepcopy(ddp)  # SCOUT keeps nothing on the model: a copy is a plain DDP model with a free slot
    twin.register_comm_hook(None, default_hooks.fp16_compress_hook)  # DDP's own registration, on its reducer
    accepted = 0
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # the original's user slot is still free
        accepted += 1
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        accepted += 1
    except RuntimeError:
        pass
    tracker.remove_hooks()
    return {"accepted_on_original": accepted}


def test_a_copy_of_a_hooked_model_is_a_plain_ddp_model():
    """SCOUT's state sat on the model: a deepcopy after a join iteration failed (a Work cannot be pickled), and
    a hook registered on the copy landed on the original."""
    result = launch(_copied, 2, timeout_s=60)
    assert result.ok, result.failures()
    assert all(v == {"accepted_on_original": 1} for v in result.values()), result.values()


def _freed(ctx: RankContext):
    import gc
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(ctx)
    ddp = DDP(torch.nn.Linear(8, 4))
    tracker = ProgressTracker(RecordingRecord())
    assert tracker.install_ddp_comm_hook(ddp)
    with ddp.join(divide_by_initial_world_size=False):
        ddp(torch.randn(3, 8)).sum().backward()
    tracker.remove_hooks()
    gone = weakref.ref(ddp)
    del ddp
    gc.collect()
    return gone() is None


def test_a_hooked_model_is_freed_when_the_job_lets_go_of_it():
    """DDP's C++ reducer holds the comm hook where Python's cycle collector cannot see it: a hook (or SCOUT's
    state beside the model) that held the model kept its parameters and buckets alive for good."""
    result = launch(_freed, 2, timeout_s=60)
    assert result.ok, result.failures()
    assert result.values() == [True, True]
