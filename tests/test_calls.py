"""Calls of any structure: flatten, ship, rebuild; capture and replay of HF-style blocks."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch

from integrations_tests.zoo import GPT2Block, LlamaBlock, LlamaRotaryEmbedding
from scout_core.replay.calls import Slot, flatten_call, rebuild, tensor_leaves
from scout_core.replay.capture import LayerCapture
from scout_core.replay.layer import replay_layer
from scout_core.replay.shipping import call_meta, receive_buffers
from scout_core.replay.spec_codec import (
    NotShippable,
    allow_call_closures,
    allow_call_packages,
    decode_metadata,
    encode_metadata,
    spec_from_tensor,
    spec_to_tensor,
)

allow_call_packages(__name__.split(".")[0])  # this module's classes and functions are the "model code" here
allow_call_closures(__name__)  # and its mask factories' inner functions are mask functions


def _shipped(spec):
    """``spec`` as a peer receives it (the call metadata) and as a restart reads it (a saved call)."""
    meta = {"spec": spec, "tensors": [], "mask": [], "grads": {}, "rng": {}}
    received = decode_metadata(encode_metadata({0: meta}), 0)[0]["spec"]
    return spec_from_tensor(spec_to_tensor(received))

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Out:
    hidden: torch.Tensor
    aux: torch.Tensor | None
    note: str = "x"


def _same(x, y):
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x) is type(y) and all(_same(getattr(x, f.name), getattr(y, f.name))
                                          for f in dataclasses.fields(x))
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    if isinstance(x, dict):
        return type(x) is type(y) and list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    return x == y


def test_none_is_never_a_tensor_slot():
    t = torch.ones(2)
    value = ((None, t, None), {"mask": None, "x": t, "flag": False, "n": 0})
    tensors, spec = flatten_call(value)
    assert len(tensors) == 2 and tensors[0] is t
    assert _same(rebuild(spec, tensors), value)


def test_keywords_tuples_dataclasses_namedtuples_and_dict_subclasses_round_trip():
    cos, sin, h = torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 3)
    value = ((h,), {"position_embeddings": (cos, sin), "past": [None, Pair(h, None)],
                    "out": Out(h, None), "od": collections.OrderedDict(z=cos, a=1)})
    tensors, spec = flatten_call(value)
    assert len(tensors) == 6
    assert _same(rebuild(_shipped(spec), tensors), value)
    assert _same(_shipped(spec), spec)


def test_tensor_leaves_of_dataclass_outputs():
    h = torch.ones(1)
    assert [id(t) for t in tensor_leaves(Out(h, None))] == [id(h)]
    assert tensor_leaves((None, {"a": [h, 2]})) == [h]
    assert tensor_leaves(3) == []
    assert isinstance(flatten_call(h)[1], Slot)


def test_spec_loader_refuses_a_pickle_without_reading_it():
    payload = b"\x80\x04cnotamod1\nThing\n."  # what an older release saved: never unpickled
    with pytest.raises(NotShippable, match="pickle"):
        spec_from_tensor(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def _captured_call(block, args, kwargs):
    cap = LayerCapture(block)
    cap.arm()
    out = block(*args, **kwargs)
    hidden = out[0]
    (hidden.float().pow(2).sum()).backward()
    captured = cap.take()
    cap.remove()
    return captured, out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_replay_of_hf_style_blocks_matches_a_direct_call(kind):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    if kind == "gpt2":
        block = GPT2Block(32, 4).train()  # dropout draws from the RNG
        args, kwargs = (x,), {"layer_past": None, "attention_mask": None, "use_cache": False}
    else:
        block = LlamaBlock(32, 4, 2).train()
        rotary = LlamaRotaryEmbedding(32 // 4)
        pos = torch.arange(16)[None].expand(2, -1)
        args, kwargs = (x,), {"attention_mask": None, "position_ids": pos, "position_embeddings": rotary(x, pos)}
    captured, _ = _captured_call(block, args, kwargs)
    assert captured is not None and captured.grad_outputs, "the gradient reaching the block output is kept"
    meta = call_meta(captured, {})
    call = receive_buffers(meta, captured, torch.device("cpu"), is_source=True)
    done = replay_layer(block, block, "b", call, variants=[1.0], providers={}, deterministic=True,
                        compare_param_state=True, vet=True)
    surfaces, compute_s = done.surfaces, done.compute_s
    assert done.reproducible is True  # dropout included: the source's RNG state is replayed both times
    names = [n for n, _ in surfaces]
    assert {"replay.inputs", "b.x1.output", "b.x1.grad_input", "b.x1.grad_param", "b.param_state"} <= set(names)
    assert compute_s > 0
    # The replayed output equals the block called directly on the same inputs under the same RNG state.
    state = torch.get_rng_state()
    torch.set_rng_state(meta["rng"]["cpu"])
    direct = block(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)[0]
    torch.set_rng_state(state)
    from scout_core.signature import sign_many

    replayed = dict(surfaces)["b.x1.output"][0][0]
    assert replayed == sign_many([direct.detach()])[0].signature


def test_replay_never_touches_live_gradients_or_rng():
    torch.manual_seed(1)
    block = GPT2Block(32, 4).train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    captured, _ = _captured_call(block, (x,), {})
    before = [p.grad.clone() for p in block.parameters()]
    rng = torch.get_rng_state()
    call = receive_buffers(call_meta(captured, {}), captured, torch.device("cpu"), is_source=True)
    replay_layer(block, block, "b", call, variants=[0.1, 1.0, 10.0], providers={}, deterministic=True,
                 compare_param_state=False)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, block.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


class _DriftingBlock(torch.nn.Module):
    """Stands in for a nondeterministic kernel: each call computes a slightly different result."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1.0 + 1e-6 * self.calls)


def test_vetting_says_when_a_replay_is_not_reproducible():
    block = _DriftingBlock()
    captured, _ = _captured_call(block, (torch.randn(2, 8, requires_grad=True),), {})
    call = receive_buffers(call_meta(captured, {}), captured, torch.device("cpu"), is_source=True)
    done = replay_layer(block, block, "b", call, variants=[1.0, 10.0], providers={}, deterministic=True,
                        compare_param_state=False, vet=True)
    assert done.reproducible is False
    assert replay_layer(block, block, "b", call, variants=[1.0], providers={}, deterministic=True,
                        compare_param_state=False).reproducible is None  # not vetted


def _document_mask_mod(positions):
    """A document mask as TorchTitan builds one for packed sequences: a closure over the batch's document ids."""
    doc_ids = torch.cumsum((positions == 0).int(), dim=1) - 1

    def document_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return document_mask


class _FlexStyleBlock(torch.nn.Module):
    """A block called as TorchTitan calls its blocks under FlexAttention: ``block(x, attention_masks, positions)``
    with a ``BlockMask``; the mask is applied densely (FlexAttention has no CPU backward)."""

    def __init__(self, dim=16):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_masks, positions=None):
        from torch.nn.attention.flex_attention import create_mask

        q, k, v = self.qkv(x).chunk(3, dim=-1)
        b, s, _ = x.shape
        allowed = create_mask(attention_masks.mask_mod, b, 1, s, s, device=x.device)[:, 0]
        scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        return x + torch.softmax(scores, dim=-1) @ v


def _packed_positions(seed, b=2, s=128):
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, s, generator=g) < 0.05
    starts[:, 0] = True
    pos = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        run = 0
        for j in range(s):
            run = 0 if starts[i, j] else run + 1
            pos[i, j] = run
    return pos


def test_a_flex_attention_block_mask_with_a_closure_travels_and_rebuilds():
    """TorchTitan's default attention gives each block a BlockMask whose mask_mod closes over the batch's
    document ids: neither pickles, so every check of such a block failed. It now ships as block tensors plus
    the closure's values, and the peer's rebuilt mask is the source's, from the tensors it received."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask

    pos = _packed_positions(1)
    mask_mod = and_masks(_document_mask_mod(pos), lambda b, h, q, kv: q >= 0)  # torch's own closure, nested
    mask = create_block_mask(mask_mod, 2, None, 128, 128, device="cpu")
    tensors, spec = flatten_call(((torch.ones(1), mask), {"positions": pos}))
    received = [t.clone() for t in tensors]
    (_, rebuilt), _ = rebuild(_shipped(spec), received)  # both transports
    want = create_mask(mask_mod, 2, 1, 128, 128, device="cpu")
    assert type(rebuilt) is type(mask) and torch.equal(create_mask(rebuilt.mask_mod, 2, 1, 128, 128), want)
    assert torch.equal(rebuilt.kv_indices, mask.kv_indices) and rebuilt.BLOCK_SIZE == mask.BLOCK_SIZE
    # The closure reads the received tensor, not the source's: another batch's document ids give its mask.
    other = _packed_positions(2)
    doc_slot = next(i for i, t in enumerate(tensors) if t.dtype == torch.int64 and t.shape == (2, 128)
                    and not torch.equal(t, pos))
    received[doc_slot] = torch.cumsum((other == 0).int(), dim=1) - 1
    (_, rebuilt), _ = rebuild(spec, received)
    assert torch.equal(create_mask(rebuilt.mask_mod, 2, 1, 128, 128),
                       create_mask(and_masks(_document_mask_mod(other), lambda b, h, q, kv: q >= 0), 2, 1, 128, 128))


def test_a_function_spec_never_carries_code_and_refuses_one_this_process_cannot_find():
    tensors, spec = flatten_call(_document_mask_mod(_packed_positions(3)))
    assert not any(isinstance(v, (bytes, type(_document_mask_mod.__code__))) for v in spec)
    forged = (spec[0], spec[1], "_document_mask_mod.<locals>.not_there", *spec[3:])
    with pytest.raises(ValueError, match="cannot find"):
        rebuild(forged, tensors)


def test_replay_of_a_flex_style_block_on_a_peer_matches_the_source():
    """The whole path a peer takes: the announced call, empty buffers of its shapes, the source's tensors
    copied in (the broadcast), the replay; the peer's own, different document mask plays no part."""
    from torch.nn.attention.flex_attention import create_block_mask

    torch.manual_seed(0)
    block = _FlexStyleBlock()
    x = torch.randn(2, 128, 16, requires_grad=True)
    pos = _packed_positions(4)
    mask = create_block_mask(_document_mask_mod(pos), 2, None, 128, 128, device="cpu")
    captured, _ = _captured_call(block, (x, mask, pos), {})
    meta = call_meta(captured, {})
    source = receive_buffers(meta, captured, torch.device("cpu"), is_source=True)
    peer = receive_buffers(decode_metadata(encode_metadata({0: meta}), 0)[0], None, torch.device("cpu"),
                           is_source=False)
    for buf, t in zip(peer.tensors, source.tensors):
        buf.copy_(t)
    for i, g in peer.grad_outputs.items():
        g.copy_(source.grad_outputs[i])
    runs = [replay_layer(block, block, "b", call, variants=[1.0], providers={}, deterministic=True,
                         compare_param_state=False).surfaces for call in (source, peer)]
    assert runs[0] == runs[1] and any(n == "b.x1.output" for n, _ in runs[0])


def test_a_recursive_inner_function_is_refused_not_recursed_forever():
    def outer():
        def walk(n):
            return 0 if n == 0 else walk(n - 1)
        return walk

    _, spec = flatten_call(outer())
    with pytest.raises(NotShippable):
        spec_to_tensor(spec)  # the check that carries it is skipped with a record, as before


def _two_masks(window):
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    near = lambda b, h, q, kv: (q - kv) < window  # noqa: E731
    return causal, near


def _branch_mask(short, limit):
    if short:
        def mask(b, h, q, kv):
            return kv < limit
    else:
        def mask(b, h, q, kv):
            return kv >= limit
    return mask


def test_functions_of_one_qualified_name_rebuild_as_the_one_the_source_ran():
    """Two lambdas of one function, or one name defined in two branches (TorchTitan's packed-document mask), share
    a qualified name: each is rebuilt from its own code (by its first line), never from the first one found."""
    q, kv = torch.tensor([5]), torch.tensor([1])
    for fn in (*_two_masks(2), _branch_mask(True, 3), _branch_mask(False, 3)):
        tensors, spec = flatten_call(fn)
        rebuilt = rebuild(_shipped(spec), tensors)
        assert rebuilt.__code__ is fn.__code__ and torch.equal(rebuilt(0, 0, q, kv), fn(0, 0, q, kv))


def test_closures_the_receiver_cannot_rebuild_exactly_are_not_shipped():
    """Two lambdas on one line (the receiver could not tell them apart), or a closure over a module (peers would
    replay the source's copy): not shipped; encoding refuses them and the check is skipped with a record."""
    pair = (lambda x: x + 1, lambda x: x + 2)  # noqa: E731
    net = torch.nn.Linear(2, 2)

    def uses_module(x):
        return net(x)

    for fn in (*pair, uses_module):
        _, spec = flatten_call(fn)
        with pytest.raises(NotShippable):
            spec_to_tensor(spec)


def _broadcast_rank(ctx: Any) -> list[bool]:
    import torch.distributed as dist

    from scout_core.replay.shipping import ShippedCall, broadcast_call
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx)
    big = 300_000  # float32: over the 1 MiB that small tensors share a broadcast in
    shapes = [((3, 4), torch.float32), ((big,), torch.float32), ((5,), torch.int64), ((2, 2), torch.float32),
              ((7,), torch.float32)]
    made = [torch.arange(torch.Size(s).numel(), dtype=d).reshape(s) + 1 for s, d in shapes]
    mine = [t.clone() if ctx.rank == 1 else torch.zeros_like(t) for t in made]
    call = ShippedCall(mine[:3], None, [False] * 3, {0: mine[3], 1: mine[4]}, {})
    sent, broadcast = [], dist.broadcast
    dist.broadcast = lambda t, **kw: sent.append(t.numel()) or broadcast(t, **kw)
    broadcast_call(call, 1, dist.group.WORLD, dist.group.WORLD)
    got = [*call.tensors, *call.grad_outputs.values()]
    return [torch.equal(a, b) for a, b in zip(got, made, strict=True)] + [sorted(sent) == [5, 23, big]]


def test_a_call_of_small_and_large_tensors_reaches_every_peer_exactly():
    """Small tensors of one dtype share a broadcast (each collective's latency is what a check pays on a busy
    host), a large one travels alone, tensors of another dtype in their own; every peer ends with the source's."""
    from scout_core.testing.launcher import launch

    result = launch(_broadcast_rank, 3, timeout_s=60)
    assert result.ok, result.failures()
    assert all(all(v) for v in result.values())
