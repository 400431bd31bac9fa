"""Where each rank's shard comes from at a restart: the vote on ``latest`` over every rank's in-memory
inventory, and the exchange that sends a rank whose machine lost its slot the replica its partner keeps."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from scout_core.checkpoint.coordinator import CheckpointCoordinator
from scout_core.replay.guard import DiagnosisGuard

__all__ = ["exchange_replicas", "load_shard", "vote_latest"]


def vote_latest(inventories: list[dict[str, Any]]) -> tuple[int | None, dict[int, int]]:
    """Newest step whose snapshot exists for EVERY rank (own slot or a partner's replica), and for each
    rank without its own copy the rank that holds its replica. Pure."""
    steps = {inv["own"] for inv in inventories if inv["own"] is not None}
    steps |= {s for inv in inventories for s in inv["replicas"].values()}
    for step in sorted(steps, reverse=True):
        fetch: dict[int, int] = {}
        for r, inv in enumerate(inventories):
            if inv["own"] == step:
                continue
            holder = next((h for h, other in enumerate(inventories) if other["replicas"].get(r) == step), None)
            if holder is None:
                break
            fetch[r] = holder
        else:
            return step, fetch
    return None, {}


def _int(value: int | None = None) -> torch.Tensor:
    return torch.tensor([0 if value is None else value], dtype=torch.int64)


def exchange_replicas(read: Callable[[int], torch.Tensor], guard: DiagnosisGuard, group: Any, *, rank: int,
                      gen: int, fetch: dict[int, int]) -> torch.Tensor | None:
    """Holders send the replicas that lost ranks need; returns ours (the serialized bytes) if we needed one.
    ``read(owner)``: the replica of ``owner``'s snapshot of ``gen`` this rank keeps.

    Per pair: the holder sends the size (-1: it could not read the replica, its guard keeps why), the
    receiver allocates its buffer under the guard and answers ready (1) or not (0), and only then the bytes
    go. Neither rank ever waits for bytes the other will not send, and a failed allocation is a failure
    like any other (kept by the guard, agreed on later), never an exception out of ``resume()``. Every rank
    walks the pairs in the same order, so the earliest unfinished pair always has both of its ranks waiting
    on it: no deadlock, whatever the pairing.
    """
    mine = None
    for r, holder in sorted(fetch.items()):
        if rank == holder:
            payload = guard.run(f"reading the replica of rank {r} at step {gen}", lambda r=r: read(r))
            size = payload.numel() if payload is not None else -1
            dist.send(_int(size), r, group=group)
            if payload is not None:
                ready = _int()
                dist.recv(ready, r, group=group)
                if int(ready) == 1:
                    dist.send(payload, r, group=group)
            del payload
        elif rank == r:
            size_t = _int()
            dist.recv(size_t, holder, group=group)
            size = int(size_t)
            if size < 0:
                guard.fail(RuntimeError(f"rank {holder} could not read its replica of this rank's snapshot of "
                                        f"step {gen}"), "receiving the replica")
                continue
            buf = guard.run(f"allocating {size} bytes for the replica of step {gen}",
                            lambda size=size: torch.empty(size, dtype=torch.uint8))
            dist.send(_int(1 if buf is not None else 0), holder, group=group)
            if buf is not None:
                dist.recv(buf, holder, group=group)
                mine = buf
    return mine


def _checked(snap: dict[str, Any], step: int) -> dict[str, Any]:
    """``snap`` if it is a whole snapshot of ``step`` (what restoring reads is there), else ValueError."""
    missing = [k for k in ("step", "model", "optim", "rng", "extra") if k not in snap]
    if missing or int(snap["step"]) != step:
        raise ValueError(f"the snapshot loaded as step {step} is not one (step {snap.get('step')}, "
                         f"missing {missing})")
    return snap


def load_shard(coord: CheckpointCoordinator, guard: DiagnosisGuard, *, rank: int, gen: int, from_memory: bool,
               exchange: Callable[[], torch.Tensor | None]) -> dict[str, Any] | None:
    """This rank's snapshot of ``gen``, checked whole: own slot, a partner's replica (``exchange``, which runs
    on every rank whatever happened), or the durable store. A failure is kept by the guard (None)."""
    if not from_memory:
        snap = guard.run(f"loading durable generation {gen}", lambda: coord.store.load(gen))
    else:
        received = exchange()
        if received is not None:
            snap = guard.run(f"loading the replica of step {gen} received from its partner",
                             lambda: torch.load(io.BytesIO(memoryview(received.numpy())), weights_only=True))
        else:
            snap = guard.run(f"loading the in-memory snapshot of step {gen}",
                             lambda: coord.memory.load("own", rank, gen))
    return guard.run(f"checking the snapshot of step {gen}", lambda: _checked(snap, gen))
