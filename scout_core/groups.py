"""SCOUT's own process groups, created once at ``enable()`` on every rank.

A job's default group may be NCCL only; SCOUT's control traffic (flags,
object all-gathers of evidence, metadata) needs host tensors, so it gets its
own gloo groups. Replay's data (captured activations, broadcast from a source
peer) stays on the device, so it travels on a peer group of the job's own
backend: SCOUT's own subgroup when there are several peer groups, the job's
default group when one group spans every rank (a second communicator of every
rank would cost device memory for nothing; SCOUT's calls on it come from the
training thread, between the job's own, in the same order on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from scout_core.wire import all_gather_data

__all__ = ["ScoutGroups", "build_groups", "gathered_groups", "local_groups"]


@dataclass(frozen=True)
class ScoutGroups:
    """The groups one rank uses; ``None`` means the default (WORLD) group."""

    peer_ranks: tuple[int, ...]
    """Global ranks of this rank's equivalent peers (itself included), ascending."""
    peer: Any
    """The peers on the job's backend (device tensors)."""
    peer_control: Any
    """The peers on gloo (host tensors and objects)."""
    world_control: Any
    """Every rank on gloo (job-wide agreement, cross-group timing)."""
    all_peers: tuple[tuple[int, ...], ...] = ()
    """Every peer group of the job (the hang observer classifies within each)."""
    replica_ranks: tuple[int, ...] = ()
    """This rank's replica group (several peer groups whose replays of a hidden layer produce equal outputs:
    tensor-parallel partners), or () where the adapter declares none."""
    replica_control: Any = None
    """The replica group on gloo, or None."""


def gathered_groups(group: Any) -> list[list[int]]:
    """Every rank's ``group`` of the job's own layout (a framework's data- or expert-parallel group), each sorted,
    ordered by their lowest rank: the partition a plugin hands SCOUT as peer groups. One gather; every rank calls
    it. torch orders a group's ranks by global rank, so an EP group's sorted ranks are its EP positions in order."""
    everyone = all_gather_data(sorted(dist.get_process_group_ranks(group)), what="group layout")
    return [list(g) for g in sorted({tuple(g) for g in everyone}, key=lambda g: min(g))]


def build_groups(peer_groups: Sequence[Sequence[int]],
                 replica_groups: Sequence[Sequence[int]] | None = None) -> ScoutGroups:
    """Create SCOUT's groups; a collective call: every rank passes the same ``peer_groups`` (and
    ``replica_groups``: a partition of the ranks into unions of peer groups, or None)."""
    rank = dist.get_rank()
    mine = next(tuple(sorted(g)) for g in peer_groups if rank in g)
    everyone = tuple(tuple(sorted(int(r) for r in g)) for g in peer_groups)
    world_control = dist.new_group(backend="gloo")
    replica_ranks: tuple[int, ...] = ()
    replica_control = None
    if replica_groups:
        replicas = [sorted(int(r) for r in g) for g in replica_groups]
        replica_ranks = next(tuple(g) for g in replicas if rank in g)
        replica_control = (world_control if len(replicas) == 1
                           else dist.new_subgroups_by_enumeration(replicas, backend="gloo")[0])
    if len(peer_groups) == 1:  # one group spanning every rank: reuse WORLD for data, the gloo world for control
        return ScoutGroups(mine, None, world_control, world_control, everyone)
    enum = [list(g) for g in everyone]
    peer, _ = dist.new_subgroups_by_enumeration(enum)
    peer_control, _ = dist.new_subgroups_by_enumeration(enum, backend="gloo")
    return ScoutGroups(mine, peer, peer_control, world_control, everyone, replica_ranks, replica_control)


def local_groups(group: Any = None) -> ScoutGroups:
    """Groups for a component built without ``enable()`` on a gloo job: ``group`` serves data and control."""
    if dist.get_backend(group) != "gloo":
        raise ValueError("on a non-gloo backend pass ScoutGroups from build_groups() (SCOUT needs host groups)")
    peers = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    return ScoutGroups(peers, group, group, None, (peers,))
