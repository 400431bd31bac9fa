"""Trainer-side hooks: what is published, in which order, and that training is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scout_core.adapter import discover_layers
from scout_core.progress.hooks import (
    ProgressTracker,
    install_collective_hooks,
    uninstall_collective_hooks,
)
from scout_core.progress.record import Phase
from scout_core.testing.launcher import RankContext, init_gloo, launch


class RecordingRecord:
    """Stands in for the shared-memory record to capture the publish sequence."""

    path = "<memory>"
    last_publish = 0.0  # the completion poller's quiet check

    def __init__(self, log=None):
        self.log = log if log is not None else []

    learning = False

    def commit_gaps(self):
        pass

    def publish(self, step, op_id, phase, pending=False, launched=None, fp=None):
        launched = op_id if launched is None else launched
        self.last = (step, op_id, bool(pending), launched)
        if Phase(phase) is Phase.COLLECTIVE and pending and op_id == launched and fp is not None:
            self.log.append(("collective", step, op_id, fp[1].split("|")[0]))  # a launch
        elif Phase(phase) is Phase.COLLECTIVE:
            self.log.append(("done" if not pending else "waiting", step, op_id, launched))
        else:
            self.log.append(("mark", step, op_id, Phase(phase).name))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def test_repeated_layers_are_modulelist_children():
    net = Net()
    assert repeated_layers([net]) == list(net.layers)
    lone = torch.nn.Linear(2, 2)
    assert repeated_layers([lone]) == [lone]


def test_nested_module_lists_belong_to_their_block():
    class MoEBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(MoEBlock() for _ in range(3))

    m = Model()
    layers, names = discover_layers([m])  # the experts' list is inside a block: not a layer of its own
    assert layers == list(m.layers) and names == ["layers.0", "layers.1", "layers.2"]


def test_layer_discovery_in_the_containers_model_libraries_use(caplog):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

    class Titan(torch.nn.Module):  # TorchTitan: blocks in a ModuleDict keyed "0", "1", ...
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(4, 2)
            self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(3)})

    class NanoGPT(torch.nn.Module):  # nanoGPT: a ModuleDict of unlike parts around the block list
        def __init__(self):
            super().__init__()
            self.transformer = torch.nn.ModuleDict(dict(
                wte=torch.nn.Embedding(4, 2), h=torch.nn.ModuleList(Block() for _ in range(2)),
                ln_f=torch.nn.LayerNorm(2)))

    titan, nano = Titan(), NanoGPT()
    assert discover_layers([titan]) == (list(titan.layers.values()), ["layers.0", "layers.1", "layers.2"])
    assert discover_layers([nano]) == (list(nano.transformer.h), ["transformer.h.0", "transformer.h.1"])
    flat = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with caplog.at_level("WARNING", logger="scout"):
        assert discover_layers([flat]) == ([flat], ["model"])
    assert "replay samples the whole model" in caplog.text


def test_named_layers_are_taken_without_the_warning_that_says_to_name_them(caplog):
    from scout_core.adapter import torch_adapter

    flat = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with caplog.at_level("WARNING", logger="scout"):
        adapter = torch_adapter(flat, torch.optim.SGD(flat.parameters(), lr=0.1), layers=[flat[0], flat[2]])
    assert adapter.repeated_layers() == [flat[0], flat[2]] and adapter.layer_names == ["0", "2"]
    assert "replay samples the whole model" not in caplog.text


def test_one_training_step_publishes_every_boundary_in_order():
    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tracker.install_module_hooks(repeated_layers([net]), backward=True)
    tracker.install_optimizer_hooks([opt])
    for x in tracker.wrap_dataloader([torch.randn(3, 4)]):
        net(x).sum().backward()
        opt.step()
        with tracker.checkpoint_io("write"):
            pass
    phases = [e[3] for e in rec.log]
    assert phases == [
        "DATALOADER", "COMPUTE",
        "FORWARD", "FORWARD",  # two repeated layers enter forward
        "BACKWARD", "BACKWARD",  # layer 1's backward is done, then layer 0's
        "OPTIMIZER", "STEP_END",
        "CHECKPOINT_WRITE", "COMPUTE",
        "DATALOADER", "COMPUTE",  # the fetch that ends the iteration
    ]
    # marks are the phase, never the coordinate: no collective ran, so the step's sequence stays at 0
    assert [e[2] for e in rec.log] == [0] * len(rec.log)
    assert rec.log[-1][1] == 1  # step counter advanced once
    tracker.remove_hooks()
    rec.log.clear()
    net(torch.randn(1, 4)).sum().backward()
    assert rec.log == []


def test_backward_marks_are_optional():
    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    net = Net()
    tracker.install_module_hooks(repeated_layers([net]))
    net(torch.randn(2, 4)).sum().backward()
    assert [e[3] for e in rec.log] == ["FORWARD", "FORWARD"]


def test_nothing_but_closed_is_published_after_close():
    """A loop that still iterates a wrapped loader after close() must not write into a record whose observer
    has read CLOSED as the trainer's last word (nor crash on a record close() unmapped)."""
    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    tracker.remove_hooks()
    for _ in tracker.wrap_dataloader([1, 2]):
        tracker.step_done()
    with tracker.checkpoint_io("write"):
        pass
    assert rec.log == []
    tracker.mark(Phase.CLOSED)
    assert [e[3] for e in rec.log] == ["CLOSED"]


def test_hooks_leave_training_bitwise_unchanged():
    def run(hooked):
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        if hooked:
            tracker = ProgressTracker(RecordingRecord())
            tracker.install_module_hooks(repeated_layers([net]), backward=True)
            tracker.install_optimizer_hooks([opt])
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            net(torch.randn(6, 4, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in net.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_checkpoint_io_rejects_unknown_kind():
    tracker = ProgressTracker(RecordingRecord())
    try:
        with tracker.checkpoint_io("delete"):
            pass
    except ValueError as exc:
        assert "read" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def _collectives(ctx: RankContext):
    init_gloo(ctx)
    log = []
    real = dist.all_reduce

    def backend_all_reduce(*args, **kwargs):  # stands for the backend: logs when the call arrives
        log.append(("backend", "all_reduce"))
        return real(*args, **kwargs)

    dist.all_reduce = backend_all_reduce
    tracker = ProgressTracker(RecordingRecord(log))
    install_collective_hooks(tracker)
    install_collective_hooks(tracker)  # idempotent
    t = torch.ones(3)
    dist.all_reduce(t)
    objs = [None] * ctx.world_size
    dist.all_gather_object(objs, ctx.rank)  # nested collectives publish once
    dist.barrier()
    uninstall_collective_hooks(tracker)
    restored = dist.all_reduce is backend_all_reduce
    dist.all_reduce(t)
    return {"log": log, "restored": restored, "sum": float(t[0]), "objs": objs}


def test_collective_intent_is_published_before_the_call_and_nested_calls_once():
    result = launch(_collectives, 2, timeout_s=60)
    assert result.ok, result.failures()
    v = result.values()[0]
    assert v["log"][:2] == [("collective", 0, 1, "all_reduce"), ("backend", "all_reduce")]
    ops = [e[3] for e in v["log"] if e[0] == "collective"]
    assert ops == ["all_reduce", "all_gather_object", "barrier"]
    assert v["restored"] and v["log"][-1] == ("backend", "all_reduce")  # after uninstall: no publish
    assert v["sum"] == 4.0 and v["objs"] == [0, 1]


def _ddp(ctx: RankContext):
    init_gloo(ctx)
    torch.manual_seed(0)
    plain = torch.nn.parallel.DistributedDataParallel(Net())
    torch.manual_seed(0)
    hooked = torch.nn.parallel.DistributedDataParallel(Net())
    log = []
    tracker = ProgressTracker(RecordingRecord(log))
    assert tracker.install_ddp_comm_hook(hooked)
    assert not tracker.install_ddp_comm_hook(hooked)  # DDP allows one hook: reported, not raised
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(ctx.rank))
    plain(x).sum().backward()
    hooked(x).sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), hooked.parameters()))
    return {"same": same, "ops": [e[3] for e in log if e[0] == "collective"]}


def test_ddp_comm_hook_publishes_buckets_and_keeps_gradients():
    result = launch(_ddp, 2, timeout_s=60)
    assert result.ok, result.failures()
    for v in result.values():
        assert v["same"]
        assert v["ops"] and set(v["ops"]) == {"ddp_bucket_all_reduce"}


def _ddp_backward(ctx: RankContext):
    init_gloo(ctx)
    torch.manual_seed(0)
    plain = torch.nn.parallel.DistributedDataParallel(Net())
    torch.manual_seed(0)
    marked = torch.nn.parallel.DistributedDataParallel(Net())
    log = []
    tracker = ProgressTracker(RecordingRecord(log))
    tracker.install_ddp_backward_marks([marked])
    at_completion = []
    complete = tracker.complete
    tracker.complete = lambda key: (at_completion.append([p.grad.clone() for p in marked.parameters()]),
                                    complete(key))[1]
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        marked(x)  # evaluation: no backward follows, nothing launched
    plain(x).sum().backward()
    marked(x).sum().backward()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), marked.parameters(), strict=True))
    # Completed after DDP's own end-of-backward wait: the gradients it saw are already the averaged ones.
    averaged = len(at_completion) == 1 and all(
        torch.equal(g, p.grad) for g, p in zip(at_completion[0], marked.parameters(), strict=True))
    with marked.no_sync():  # gradient accumulation: DDP reduces nothing in this backward, nothing launched
        marked(x).sum().backward()
    two = torch.nn.parallel.DistributedDataParallel(TwoHeads())
    tracker.install_ddp_backward_marks([two])
    out = two(x)
    (out[1].sum() + 0 * out[0].detach().sum()).backward()  # through the second output only: launched, once
    tracker.remove_hooks()
    marked(x).sum().backward()  # after close: nothing more
    return {"same": same, "averaged": averaged, "log": log}


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.body(x)
        return y * 2, y * 3


def test_ddp_backward_is_one_collective_launched_at_its_start_and_done_after_ddps_wait():
    """The shipped DDP hang path: no comm hook (DDP's C++ buckets untouched, gradients bit for bit DDP's own);
    each backward pass published as one collective, complete only once DDP has waited for its buckets."""
    result = launch(_ddp_backward, 2, timeout_s=60)
    assert result.ok, result.failures()
    for v in result.values():
        assert v["same"] and v["averaged"]
        assert v["log"] == [("collective", 0, 1, "ddp_gradient_reduction"), ("done", 0, 1, 1),
                            ("collective", 0, 2, "ddp_gradient_reduction"), ("done", 0, 2, 2)], v["log"]


def test_a_collective_inside_ddps_backward_is_shown_while_the_reduction_spans_it():
    """DDP's reduction stays in flight for its whole backward; a collective issued inside it (SyncBatchNorm's, a
    user's) is what the record shows while it is in flight, so a rank stopped before it is told apart."""
    from scout_core.progress.fingerprint import CollectiveFingerprint

    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    ddp = tracker.launch(CollectiveFingerprint(op="ddp_gradient_reduction", group=(2, 1), shapes=((8,),), dtypes=()))
    assert rec.last == (0, 1, True, 1)
    inner = tracker.launch(CollectiveFingerprint(op="all_reduce", group=(2, 1), shapes=((3,),), dtypes=("float32",)))
    assert rec.last == (0, 2, True, 2)  # the collective inside backward, not the reduction around it
    tracker.complete(inner)
    assert rec.last == (0, 1, True, 2)  # back to the reduction, still in flight
    tracker.complete(ddp)
    assert rec.last == (0, 2, False, 2)


def repeated_layers(chunks):
    return discover_layers(chunks)[0]


def _protocol(ctx: RankContext):
    """What a rank publishes: per-step sequences, extra work on rank 0, foreign threads, async launches."""
    import threading

    init_gloo(ctx)
    log = []
    tracker = ProgressTracker(RecordingRecord(log))
    install_collective_hooks(tracker)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tracker.install_module_hooks(repeated_layers([net]))
    tracker.install_optimizer_hooks([opt])
    points = []
    side_group = dist.new_group([0, 1])
    for _step in range(2):
        if ctx.rank == 0:  # rank-0-only evaluation and checkpoint write: phase only
            with torch.no_grad():
                net(torch.randn(2, 4))
            with tracker.checkpoint_io("write"):
                pass
        t = torch.ones(2)
        dist.all_reduce(t)
        side = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1), group=side_group))
        side.start()
        side.join()  # a user thread's collective: not in the trainer's sequence
        work = dist.all_reduce(torch.ones(3), async_op=True)
        work.wait()
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        points.append((tracker.step, tracker.launched))
    last_launch = [e for e in log if e[0] == "collective"][-1]
    uninstall_collective_hooks(tracker)
    import time

    deadline = time.monotonic() + 5
    while tracker._inflight and time.monotonic() < deadline:  # gloo's callback thread completes it
        time.sleep(0.01)
    return {"points": points, "last_launch": last_launch, "inflight": len(tracker._inflight),
            "launches": [e[1:3] for e in log if e[0] == "collective"]}


def test_coordinates_are_per_step_collective_sequences_that_extra_work_and_threads_do_not_shift():
    result = launch(_protocol, 2, timeout_s=60)
    assert result.ok, result.failures()
    r0, r1 = result.values()
    assert r0["launches"] == r1["launches"] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert r0["points"] == r1["points"] == [(1, 0), (2, 0)]
    assert r0["inflight"] == r1["inflight"] == 0  # async completion was published


class _Work:
    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def test_a_rank_that_launched_and_then_stopped_shows_the_collective_done_not_pending():
    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    from scout_core.progress.fingerprint import CollectiveFingerprint

    fp = CollectiveFingerprint("all_reduce", (2, 1), ((4,),), ("float32",), "SUM")
    key1 = tracker.launch(fp)
    key2 = tracker.launch(fp)
    assert rec.last == (0, 1, True, 2)  # the oldest incomplete launch is the point
    tracker.complete(key1)
    assert rec.last == (0, 2, True, 2)
    tracker.complete(key2)
    assert rec.last == (0, 2, False, 2)  # stopped now, this rank shows bucket 2 done, not pending
    # a device work completes later than its future: polled at every publish
    work = _Work()
    key3 = tracker.launch(fp)
    tracker._polled.append((key3, work))
    tracker.mark(Phase.FORWARD)
    assert rec.last == (0, 3, True, 3) and tracker._inflight
    work.done = True
    tracker.mark(Phase.FORWARD)
    assert not tracker._inflight


def test_a_collective_inside_a_checkpoint_save_keeps_the_checkpoint_phase():
    """A distributed checkpoint gathers and waits on barriers inside its save: those waits are the storage's,
    published as checkpoint I/O (the observer allows them the I/O tolerance), not as a training collective."""
    from scout_core.progress.fingerprint import CollectiveFingerprint

    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    fp = CollectiveFingerprint(op="gather", group=(4, 0, 1, 2, 3), shapes=((8,),), dtypes=("uint8",))
    with tracker.checkpoint_io("write"):
        key = tracker.launch(fp)
        tracker.complete(key)
    tracker.complete(tracker.launch(fp))
    assert [(e[0], e[3]) for e in rec.log] == [("mark", "CHECKPOINT_WRITE")] * 3 + [("mark", "COMPUTE"),
                                                                                  ("collective", "gather"),
                                                                                  ("done", 2)]


def test_the_io_tolerance_covers_a_pending_collective_of_a_checkpoint_only():
    import dataclasses

    from scout_core.progress.control import ControlPlane
    from scout_core.progress.observer import ObserverSpec, silence_threshold
    from scout_core.progress.record import ProgressSnapshot

    spec = ObserverSpec(run_id="r", rank=0, world_size=2, record_path="", peer_groups=[[0, 1]], hosts={}, devices={},
                        control=ControlPlane("localhost", 1, "daemon"),
                        silence_threshold_s=5.0, io_silence_s=300.0, gather_timeout_s=1.0, startup_timeout_s=1.0,
                        jsonl_path=None)
    snap = ProgressSnapshot(seq=1, step=3, op_id=1, launched=1, phase=Phase.CHECKPOINT_WRITE, pending=True,
                            t_publish=0.0, t_phase=0.0, gap_max=0.5, fp_hash=0, fingerprint="", owner_pid=1)
    assert silence_threshold(spec, snap) == 300.0
    assert silence_threshold(spec, dataclasses.replace(snap, phase=Phase.COLLECTIVE)) == 5.0
    assert silence_threshold(spec, dataclasses.replace(snap, phase=Phase.DATALOADER)) == 5.0


def _coalesced(ctx: RankContext):
    """A coalesced batch of two all-reduces, as Megatron's buckets issue it. Rank 1 joins only after rank 0 has
    looked at its record, so the batch cannot have completed by then (no timing assumption)."""
    init_gloo(ctx)
    store = dist.distributed_c10d._get_default_store()
    rec = RecordingRecord()
    tracker = ProgressTracker(rec)
    install_collective_hooks(tracker)
    a, b = torch.ones(3), torch.ones(5)
    seen = {}
    try:
        if ctx.rank == 1:
            store.wait(["looked"])
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a, async_op=True)
            dist.all_reduce(b, async_op=True)
        if ctx.rank == 0:
            seen["inflight_after_block"] = len(tracker._inflight)
            seen["point"] = rec.last
            store.set("looked", "1")
        cm.wait()
        tracker.mark(Phase.FORWARD)  # a publish polls the works in flight
        seen["inflight_after_wait"] = len(tracker._inflight)
        # Megatron's distributed-optimizer buckets: gloo's coalesced reduce-scatter work never reports itself
        # completed, even after its wait returned.
        shard = torch.zeros(4)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(shard, torch.ones(8), async_op=True)
        cm.wait()
        tracker.mark(Phase.FORWARD)
        seen["inflight_after_reduce_scatter"] = len(tracker._inflight)
        with dist._coalescing_manager():  # synchronous: done when the block ends
            dist.all_reduce(a)
        seen["inflight_after_sync"] = len(tracker._inflight)
    finally:
        uninstall_collective_hooks(tracker)
        tracker.remove_hooks()
    return {**seen, "sums": [float(a[0]), float(b[0])], "restored": not hasattr(dist._coalescing_manager,
                                                                                 "__scout_original__")}


def test_a_coalesced_batch_stays_in_flight_until_its_work_completes():
    """Inside ``_coalescing_manager`` a collective call only queues its operation: without the wrapped manager the
    bucket showed done at once, and a rank waiting in it was not seen waiting."""
    result = launch(_coalesced, 2, timeout_s=60)
    assert result.ok, result.failures()
    r0, r1 = result.values()
    assert r0["inflight_after_block"] == 2 and r0["point"][:3] == (0, 1, True)  # waiting in the first of the batch
    assert r0["inflight_after_wait"] == r1["inflight_after_wait"] == 0
    assert r0["inflight_after_reduce_scatter"] == r1["inflight_after_reduce_scatter"] == 0
    assert r0["inflight_after_sync"] == r1["inflight_after_sync"] == 0
    assert r0["sums"] == [4.0, 2.0] and r0["restored"] and r1["restored"]  # a: the batch, then the synchronous one


def test_late_bound_stand_in_calls_torch_distributed_at_call_time(monkeypatch):
    """A framework's name for a torch.distributed function, bound before SCOUT's hooks (DeepSpeed's backend,
    Megatron's buckets), becomes a stand-in that reaches whatever torch.distributed holds at call time."""
    from scout_core.progress.hooks import late_bound

    bound = dist.all_gather_into_tensor
    late = late_bound(bound)
    assert late is not None and late.__name__ == "all_gather_into_tensor" and late_bound(late) is None
    seen = []
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: seen.append((a, k)) or "hooked")
    assert late(1, 2, group=None) == "hooked" and seen == [((1, 2), {"group": None})]
    assert late_bound(lambda *a: None) is None  # a framework's own function is left alone


def _ddp_weights(ctx: RankContext):
    """Final weights of a short DDP run, with SCOUT's bucket hook or DDP's own reduction."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(ctx)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 7))
    mode = ctx.args.get("mode", "default")
    ddp = DDP(net, bucket_cap_mb=0.01, gradient_as_bucket_view=mode == "bucket_view")  # several buckets
    tracker = None
    if ctx.args["hooked"]:
        tracker = ProgressTracker(RecordingRecord())
        assert tracker.install_ddp_comm_hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(4):
        if mode == "no_sync":  # gradient accumulation: one micro-batch without the reduction
            with ddp.no_sync():
                ddp(torch.randn(5, 33, generator=gen)).pow(2).mean().backward()
        ddp(torch.randn(5, 33, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=mode != "bucket_view")  # kept grads alias their bucket from the 2nd step
    if tracker is not None:
        tracker.remove_hooks()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("mode", ["default", "bucket_view", "no_sync"])
def test_the_bucket_hook_averages_bit_for_bit_like_ddp_at_any_world_size(mode):
    """DDP scales each gradient by the reciprocal of the world size as it copies it into the bucket, but divides
    a gradient that already is its bucket's view (gradient_as_bucket_view with kept gradients); a hook that
    scaled otherwise changed about a third of the elements at 3, 5, 6 or 12 ranks (never at 2, 4, 16)."""
    for world in (3, 5, 6, 12):
        plain = launch(_ddp_weights, world, timeout_s=120, args={"hooked": False, "mode": mode})
        hooked = launch(_ddp_weights, world, timeout_s=120, args={"hooked": True, "mode": mode})
        assert plain.ok and hooked.ok, (plain.failures(), hooked.failures())
        for a, b in zip(plain.values()[0], hooked.values()[0]):
            assert torch.equal(a, b), f"{world} ranks: {(a != b).sum().item()} of {a.numel()} elements differ"


def _user_hook_weights(ctx: RankContext):
    """Final weights of a short DDP run whose user registers a compression hook, with or without SCOUT's first."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(ctx)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 7))
    ddp = DDP(net, bucket_cap_mb=0.01)
    log: list = []
    tracker = None
    if ctx.args["hooked"]:
        tracker = ProgressTracker(RecordingRecord())
        launch_ = tracker.launch
        tracker.launch = lambda fp: log.append(fp.text()) or launch_(fp)
        install_collective_hooks(tracker)
        assert tracker.install_ddp_comm_hook(ddp)
    kind = ctx.args["kind"]
    if ctx.args.get("python_reducer"):  # compiled DDP's reducer: hooks get (grad, param), built-ins never run
        from torch._dynamo import config as dynamo_config

        dynamo_config.optimize_ddp = "python_reducer"
    if kind.startswith("builtin_"):
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kind[len("builtin_"):].upper()))
    elif kind == "powersgd":  # a stateful hook with its own all-reduces (bf16 compression needs NCCL)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    second_refused = False
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError:
        second_refused = True
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(3):
        ddp(torch.randn(5, 33, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if tracker is not None:
        uninstall_collective_hooks(tracker)
        tracker.remove_hooks()
    return {"weights": [p.detach().clone() for p in net.parameters()], "second_refused": second_refused,
            "published": log}


def _same_weights(kind: str, *, python_reducer: bool) -> None:
    args = {"kind": kind, "python_reducer": python_reducer}
    plain = launch(_user_hook_weights, 3, timeout_s=120, args={**args, "hooked": False})
    hooked = launch(_user_hook_weights, 3, timeout_s=120, args={**args, "hooked": True})
    assert plain.ok and hooked.ok, (plain.failures(), hooked.failures())
    for a, b in zip(plain.values()[0]["weights"], hooked.values()[0]["weights"]):
        assert torch.equal(a, b), f"{kind}: {(a != b).sum().item()} of {a.numel()} elements differ"
    assert all(v["second_refused"] for v in plain.values() + hooked.values())


@pytest.mark.parametrize("kind", ["fp16", "builtin_fp16_compress", "powersgd"])
def test_a_users_own_comm_hook_after_enable_runs_untouched_and_is_seen(kind):
    """DDP allows one comm hook and SCOUT's takes the slot: a user's compression hook registered afterwards used
    to raise. It now gets every bucket, the run equals the same hook without SCOUT bit for bit, a second user
    hook is refused as DDP refuses it, and each bucket is published once, on every rank alike."""
    _same_weights(kind, python_reducer=False)
    hooked = launch(_user_hook_weights, 3, timeout_s=120, args={"hooked": True, "kind": kind})
    assert hooked.ok, hooked.failures()
    published = [v["published"] for v in hooked.values()]
    assert published[0] == published[1] == published[2] and len(published[0]) >= 3, published  # each step
    # One collective per bucket, on every rank alike: PowerSGD's second all-reduce runs in a future's callback,
    # on the autograd thread on some ranks and on gloo's on others, so it is inside the bucket's, never counted.
    assert all(text.startswith("ddp_bucket_all_reduce") for text in published[0]), published[0]


@pytest.mark.parametrize("kind", ["builtin_fp16_compress", "builtin_allreduce"])
def test_built_in_hooks_after_enable_keep_ddps_python_reducer_unchanged(kind):
    """Compiled DDP's Python reducer calls the listed Python hooks with (grad, param) and never DDP's C++
    built-ins: a built-in registered after enable() must leave that path to DDP's own reduction."""
    _same_weights(kind, python_reducer=True)


def _preregistered(ctx: RankContext):
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(ctx)
    ddp = DDP(torch.nn.Linear(4, 2))
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    tracker = ProgressTracker(RecordingRecord())
    installed = tracker.install_ddp_comm_hook(ddp)
    return {"installed": installed, "listed": len(ddp._comm_hooks)}


def test_a_hook_registered_before_enable_keeps_the_slot_and_nothing_of_scouts_is_left_listed():
    """DDP lists a Python hook before its C++ side refuses a second one: SCOUT's, left listed, would run beside
    the user's in the Python reducer (every gradient reduced twice)."""
    result = launch(_preregistered, 2, timeout_s=60)
    assert result.ok, result.failures()
    assert all(v == {"installed": False, "listed": 0} for v in result.values())
