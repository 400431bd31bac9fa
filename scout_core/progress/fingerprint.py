"""Collective fingerprints and their compatibility rule (paper section 7).

Immediately before a rank enters a collective it publishes what healthy
callers must share: the operation, the process group, tensor shapes and
dtypes, the reduction and the root. Peers compare the fingerprints with exact
C3, so a rank that calls a different collective, or the same one with
different metadata, stands out.

Two things are legitimately rank-dependent and are kept out of the compared
key by an explicit rule:

* the caller's own position in the group: the group is described by its size
  and by member offsets relative to its lowest member, so corresponding
  groups of different replicas (TP group {0, 1} on replica 0, {2, 3} on
  replica 1) compare equal while a call on the wrong group does not;
* all-to-all split sizes and the leading (token) dimension they change, and
  the peer of a send/recv.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["CollectiveFingerprint", "describe_group", "fingerprint_call", "COMPARED_FIELDS"]

# Ops whose dim 0 and split sizes vary with routing; only trailing dims and dtype are compared.
_VARIABLE_SPLIT_OPS = frozenset({"all_to_all", "all_to_all_single"})
_P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
COMPARED_FIELDS = ("op", "group", "shapes", "dtypes", "reduce_op", "root")


class CollectiveFingerprint(NamedTuple):
    """Immutable and cheap to build: one is made before every collective."""

    op: str
    group: tuple[int, ...]
    """(size, *offsets of members from the lowest member)."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    reduce_op: str | None = None
    root: int | None = None
    peer: int | None = None
    """send/recv partner; reported, never compared."""

    def key(self) -> tuple[Any, ...]:
        """The compared part, after the compatibility rule."""
        shapes = self.shapes
        if self.op in _VARIABLE_SPLIT_OPS:
            shapes = tuple(s[1:] for s in shapes)
        return (self.op, self.group, shapes, self.dtypes, self.reduce_op, self.root)

    def hash64(self) -> int:
        return _hash_key(self.key())

    def text(self) -> str:
        return _text(self)

    def _text(self) -> str:
        shapes = ";".join("x".join(map(str, s)) for s in self.shapes)
        parts = [self.op, f"group={_group_text(self.group)}",
                 f"shapes={shapes}", f"dtypes={','.join(self.dtypes)}"]
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        return "|".join(parts)


def _group_text(group: tuple[int, ...]) -> str:
    """'16@0..15' for a contiguous group, '4@0..12/4' for a strided one, else every offset."""
    size, offsets = group[0], group[1:]
    if size > 2:
        stride = offsets[1] - offsets[0]
        if stride > 0 and all(b - a == stride for a, b in zip(offsets, offsets[1:])):
            return f"{size}@0..{offsets[-1]}" + (f"/{stride}" if stride != 1 else "")
    return f"{size}@{','.join(map(str, offsets))}"


# Training loops issue the same few collectives every step: cache what does not change.
@functools.lru_cache(maxsize=4096)
def _hash_key(key: tuple[Any, ...]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=4096)
def _text(fp: CollectiveFingerprint) -> str:
    return fp._text()


_GROUPS: dict[Any, tuple[int, ...]] = {}
_WORLDS: dict[int, tuple[int, ...]] = {}
_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def describe_group(group: Any) -> tuple[int, ...]:
    """``(size, offsets...)`` of a process group; the default group when ``None``.

    Cached per group object (membership never changes). The default group is
    not cached by identity because it is recreated when a job re-initializes.
    """
    if group is None or group is dist.group.WORLD:
        n = dist.get_world_size()
        world = _WORLDS.get(n)
        if world is None:
            world = _WORLDS[n] = (n, *range(n))
        return world
    cached = _GROUPS.get(group)
    if cached is None:
        ranks = sorted(dist.get_process_group_ranks(group))
        cached = _GROUPS[group] = (len(ranks), *(r - ranks[0] for r in ranks))
    return cached


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_tensors(v))
        return out
    return []


_REDUCE_NAMES: dict[Any, str] = {}


def _reduce_name(op: Any) -> str | None:
    if op is None:
        return None
    try:
        return _REDUCE_NAMES[op]
    except (KeyError, TypeError):
        pass
    name = getattr(op, "name", None)
    text = str(name if name is not None else op).rsplit(".", 1)[-1].upper()
    with contextlib.suppress(TypeError):  # unhashable custom ops are simply not cached
        _REDUCE_NAMES[op] = text
    return text


# Which positional/keyword arguments carry tensors, the reduce op, the root and the group.
_SIGNATURES: dict[str, tuple[Sequence[str], str | None, str | None, str | None]] = {
    # name: (tensor args, reduce-op arg, root arg, peer arg)
    "all_reduce": (("tensor",), "op", None, None),
    "reduce": (("tensor",), "op", "dst", None),
    "broadcast": (("tensor",), None, "src", None),
    "all_gather": (("tensor_list", "tensor"), None, None, None),
    "all_gather_into_tensor": (("output_tensor", "input_tensor"), None, None, None),
    "all_gather_single": (("output_tensor", "input_tensor"), None, None, None),
    "reduce_scatter": (("output", "input_list"), "op", None, None),
    "reduce_scatter_tensor": (("output", "input"), "op", None, None),
    "reduce_scatter_single": (("output", "input"), "op", None, None),
    "all_to_all": (("output_tensor_list", "input_tensor_list"), None, None, None),
    "all_to_all_single": (("output", "input"), None, None, None),
    "gather": (("tensor", "gather_list"), None, "dst", None),
    "scatter": (("tensor", "scatter_list"), None, "src", None),
    "barrier": ((), None, None, None),
    # Object collectives: published once as themselves; their inner tensor collectives
    # carry rank-dependent pickled sizes and are not published again.
    "all_gather_object": ((), None, None, None),
    "broadcast_object_list": ((), None, "src", None),
    "send": (("tensor",), None, None, "dst"),
    "recv": (("tensor",), None, None, "src"),
    "isend": (("tensor",), None, None, "dst"),
    "irecv": (("tensor",), None, None, "src"),
}
# The argument name order of each function, for binding positional arguments.
_ORDER: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_single": ("output_tensor", "input_tensor", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output", "input", "op", "group", "async_op"),
    "reduce_scatter_single": ("output", "input", "op", "group", "async_op"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op"),
    "barrier": ("group", "async_op", "device_ids"),
    "all_gather_object": ("object_list", "obj", "group"),
    "broadcast_object_list": ("object_list", "src", "group", "device"),
    "send": ("tensor", "dst", "group", "tag"),
    "recv": ("tensor", "src", "group", "tag"),
    "isend": ("tensor", "dst", "group", "tag"),
    "irecv": ("tensor", "src", "group", "tag"),
}
SUPPORTED_OPS = tuple(_SIGNATURES)


def fingerprint_call(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CollectiveFingerprint:
    """Fingerprint a ``torch.distributed.<op>(*args, **kwargs)`` call before it runs."""
    tensor_args, reduce_arg, root_arg, peer_arg = _SIGNATURES[op]
    bound = dict(zip(_ORDER[op], args))
    bound.update(kwargs)
    tensors = []
    for name in tensor_args:
        tensors.extend(_tensors(bound.get(name)))
    reduce_op = _reduce_name(bound.get(reduce_arg, "SUM" if reduce_arg else None)) if reduce_arg else None
    root = bound.get(root_arg) if root_arg else None
    if root_arg and root is None:
        root = 0  # torch's default src/dst
    return CollectiveFingerprint(
        op=op,
        group=describe_group(bound.get("group")),
        shapes=tuple(tuple(t.shape) for t in tensors),
        dtypes=tuple(_dtype_name(t.dtype) for t in tensors),
        reduce_op=reduce_op,
        root=int(root) if root is not None else None,
        peer=int(bound[peer_arg]) if peer_arg and bound.get(peer_arg) is not None else None,
    )


def fingerprint_bucket(buffer: Any, group: Any) -> CollectiveFingerprint:
    """Fingerprint of a DDP gradient bucket all-reduce (the comm-hook path)."""
    return CollectiveFingerprint(
        op="ddp_bucket_all_reduce", group=describe_group(group), shapes=(tuple(buffer.shape),),
        dtypes=(_dtype_name(buffer.dtype),), reduce_op="SUM",
    )
