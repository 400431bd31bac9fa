"""Running one recipe: materialize its layer (an unshard in reserved memory), replay it, sign it, reshard it.

Every stage runs inside the check's :class:`~scout_core.replay.guard.DiagnosisGuard`: a local failure is kept
for the next agreement, never raised into training, and the collectives every peer joins still run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scout_core.config import ReplayConfig
from scout_core.replay.capture import LayerCapture
from scout_core.replay.guard import DiagnosisGuard
from scout_core.replay.layer import (
    LayerReplay,
    gather_ranks,
    gathered_shard_surfaces,
    materialize,
    release_of,
    replay_layer,
)
from scout_core.replay.optimizer import OptimizerSlice
from scout_core.replay.optimizer_source import source_slice_surface
from scout_core.replay.rng import RngProvider
from scout_core.replay.scratch import Scratch, fsdp_module, reserve, unshard_bytes
from scout_core.replay.shipping import ShippedCall
from scout_core.replay.timing import CommTiming, mesh_groups, time_hsdp_collectives
from scout_core.replay.vetting import SELF_CHECK_SURFACE
from scout_core.signature import sign_many

__all__ = ["OptimizerRecipe", "RecipeRun", "RecipeRunner", "Replayed", "peers_hold_equal_shards", "place_layers"]


@dataclass
class RecipeRun:
    """What replaying one layer gave: its signed surfaces and timings (None: not measured)."""

    surfaces: list[tuple[str, Any]]
    compute_s: float | None = None
    gather_s: float | None = None
    reproducible: bool | None = None
    hsdp_comm: tuple[float, float, Any, Any] | None = None
    """HSDP: the timed reduce-scatter and replica all-reduce, with their groups (the hidden recipe's only)."""


@dataclass
class Replayed:
    """What the recipes due at one boundary gave on this rank, ready for the exchange."""

    evidence: list[tuple[str, Any]] = field(default_factory=list)
    # None: not measured on this rank this round (the replay failed, or nothing was timed): "no
    # measurement" for every peer, which neither confirms a straggler nor clears one, nor moves a baseline.
    compute_s: float | None = None
    comm_s: float | None = None
    work: Any = None
    """What makes compute times comparable beyond the peer group (the timed layer and its input shapes)."""
    comm_ranks: tuple[int, ...] = ()
    """The ranks of the collective that ``comm_s`` timed."""
    reproducible: bool | None = True
    hsdp_comm: tuple[float, float, Any, Any] | None = None


def place_layers(layers: Sequence[torch.nn.Module], names: Sequence[str] | None, *,
                 embedding: torch.nn.Module | None = None, output: torch.nn.Module | None = None
                 ) -> tuple[list[torch.nn.Module], list[str], dict[str, int]]:
    """(layers, names, boundary recipe -> layer index): the repeated layers first; embedding and output (LM
    head) recipes ride behind them, each on its own cadence (under FSDP2 their parameters belong to an outer
    FSDP module, the boundary owner)."""
    if not layers:
        raise ValueError("replay needs at least one repeated layer")
    placed = list(layers)
    placed_names = list(names) if names else [f"layers.{i}" for i in range(len(placed))]
    extra: dict[str, int] = {}
    for recipe, module in (("embedding", embedding), ("output", output)):
        if module is not None:
            extra[recipe] = len(placed)
            placed.append(module)
            placed_names.append(recipe)
    return placed, placed_names, extra


@dataclass(eq=False)
class RecipeRunner:
    """Replays the engine's layers (repeated layers, then embedding and head) one recipe at a time."""

    layers: Sequence[torch.nn.Module]
    names: Sequence[str]
    captures: Sequence[LayerCapture]
    cfg: ReplayConfig
    n_hidden: int
    boundary_owner: torch.nn.Module | None = None
    layer_owners: Sequence[torch.nn.Module | None] = ()
    """The FSDP2 block a repeated layer unshards through when it is not one itself (a block's attention)."""
    rng_providers: dict[str, RngProvider] = field(default_factory=dict)
    compare_param_state: bool = True
    compare_param_grads: bool = True
    compare_extra_state: bool = True
    gather_layer: Callable[[torch.nn.Module], tuple[Any, Callable[[], None]]] | None = None
    """A framework's own gather of a layer sharded at rest outside FSDP2 (DeepSpeed ZeRO-3), or None."""
    gather_bytes: Callable[[torch.nn.Module], int] | None = None
    replaying: bool = False
    """True while replay runs the sampled layer (model hooks may use it to stay out of the way)."""
    peer_ranks: tuple[int, ...] = ()
    """This rank's peer group (empty: not known). HSDP's shard surfaces are compared only where the peers are
    the replica group: the replicas of one shard position."""

    def owner(self, idx: int) -> torch.nn.Module | None:
        """The FSDP module that unshards layer ``idx`` when it is not one itself: the outer module of a
        boundary module (embedding, head), the enclosing block of a repeated layer's part."""
        return self.boundary_owner if idx >= self.n_hidden else self.layer_owners[idx]

    def unshard_bytes(self, idx: int, guard: DiagnosisGuard) -> int:
        layer, owner = self.layers[idx], self.owner(idx)
        if self.gather_bytes is not None and not fsdp_module(layer) and not fsdp_module(owner):
            # The framework's own gather (DeepSpeed ZeRO-3); a failure to size it skips the check everywhere.
            gather_bytes = self.gather_bytes
            return guard.run(f"gather size of {self.names[idx]}", lambda: gather_bytes(layer)) or 0
        return unshard_bytes(layer, owner)

    def reserve(self, idx: int, *, timed: bool, headroom: int) -> Scratch:
        """The memory replaying layer ``idx`` needs in its collectives (timed: the hidden recipe's)."""
        layer = self.layers[idx]
        owner = self.owner(idx)  # an unshard, of the layer or its owner, is the timed collective then
        return reserve(layer, owner, time_all_reduce=timed and not fsdp_module(layer) and not fsdp_module(owner),
                       hsdp_groups=mesh_groups(layer) if timed else None, headroom_bytes=headroom)

    def replay(self, idx: int, call: ShippedCall, scratch: Scratch, guard: DiagnosisGuard, *, timed: bool,
               vet: bool = False) -> RecipeRun:
        """Materialize the layer (its collectives use memory reserved in ``scratch``), replay it, reshard."""
        layer, name = self.layers[idx], self.names[idx]
        run = RecipeRun([])
        hsdp = mesh_groups(layer)
        # The shards are compared where the peers are the replica group (the replicas of one shard position);
        # peers at other positions hold other shards. The same on every rank: the mesh and the groups are.
        shards = hsdp is not None and (not self.peer_ranks or
                                       sorted(dist.get_process_group_ranks(hsdp[1])) == sorted(self.peer_ranks))
        if hsdp is not None:
            # HSDP: replicas hold the same shard, so compare the local shards BEFORE unsharding (a
            # corrupted shard would otherwise reach its whole shard group through the all-gather).
            # Pure FSDP has no owner copy to compare a shard against.
            def local_shard() -> None:
                signed = sign_many([torch.cat([p.to_local().reshape(-1) for p in layer.parameters()])])[0]
                run.surfaces.append((f"{name}.local_shard", (signed.signature, signed.nonfinite)))

            if shards:
                guard.run(f"local shard signature of {name}", local_shard)
            shard_dims = [next(pl.dim for pl in p.placements if pl.is_shard()) for p in layer.parameters()]
            if timed and scratch.hsdp is not None:  # the hidden recipe's timings are compared across groups
                run.hsdp_comm = time_hsdp_collectives(layer, scratch.hsdp)
        owner = self.owner(idx)
        # Always run (its all-gather is a collective every peer joins), but a local failure (out of memory
        # copying the parameters out after the gather) is kept for the agreement, not raised into training.
        materialized = guard.attempt(f"unshard of {name}",
                                     lambda: materialize(layer, owner, scratch, self.gather_layer))
        forward, run.gather_s, release = materialized or (None, None, release_of(layer, owner))
        if shards:  # an exchange over the shard group every mate joins, whatever failed before on this rank
            surfaces = guard.attempt(f"gathered shard signatures of {name}", lambda: gathered_shard_surfaces(
                layer, name, hsdp[0], shard_dims, gathered=materialized is not None))
            run.surfaces.extend(surfaces or [])
        done: list[LayerReplay] = []

        def replay() -> None:
            self.captures[idx].suspended, self.replaying = True, True
            try:
                done.append(replay_layer(
                    forward, layer, name, call, variants=self.cfg.input_variants, providers=self.rng_providers,
                    deterministic=self.cfg.deterministic, compare_param_state=self.compare_param_state, vet=vet,
                    param_grads=self.compare_param_grads, compare_extra_state=self.compare_extra_state))
            finally:
                self.captures[idx].suspended, self.replaying = False, False
            run.surfaces.extend(done[0].surfaces)

        try:
            guard.run(f"replay of {name}", replay)
        finally:
            if release is not None:
                guard.attempt(f"reshard of {name}", release)
        if done:
            run.compute_s, run.reproducible = done[0].compute_s, done[0].reproducible
        return run

    def replay_due(self, due: Sequence[tuple[str, int]], calls: dict[int, ShippedCall], scratch: dict[int, Scratch],
                   guard: DiagnosisGuard, *, vet: bool, timing: CommTiming, group: Any, peers: Sequence[int],
                   saved: dict[str, tuple[ShippedCall, int]]) -> Replayed:
        """Replay every due recipe on its broadcast call; the hidden recipe's timings are the ones compared.
        Each replayed call is kept in ``saved`` (the emergency sweep's inputs)."""
        out = Replayed()
        for recipe, idx in due:
            timed = recipe == "hidden"  # the hidden layer's timings are the ones compared
            run = self.replay(idx, calls[idx], scratch[idx], guard, timed=timed, vet=vet)
            out.evidence += run.surfaces
            out.reproducible = (None if out.reproducible is None or run.reproducible is None
                                else out.reproducible and run.reproducible)
            if timed:
                out.hsdp_comm = run.hsdp_comm
                self._timed(out, idx, calls[idx], scratch[idx], run.compute_s, run.gather_s,
                            timing=timing, group=group, peers=peers)
            # One saved call per layer class: the sweep replays each class's layers on an input of their own.
            # (The vetting surfaces follow the loop: every peer sends them, None where a replay failed.)
            key = f"hidden:{type(self.layers[idx]).__qualname__}" if recipe == "hidden" else recipe
            saved[key] = (calls[idx], idx)
        return out

    def _timed(self, out: Replayed, idx: int, call: ShippedCall, scratch: Scratch, compute_s: float | None,
               gather_s: float | None, *, timing: CommTiming, group: Any, peers: Sequence[int]) -> None:
        """The hidden recipe's timings: its compute, and its timed collective (the unshard's all-gather, or a
        training-shaped all-reduce over the peers where nothing unsharded)."""
        out.compute_s = compute_s
        # What makes compute times comparable beyond the peer group: the same layer (its place, class
        # and parameters) on the same input shapes.
        layer = self.layers[idx]
        out.work = (self.names[idx], type(layer).__qualname__,
                    tuple((tuple(p.shape), str(p.dtype)) for p in layer.parameters()),
                    tuple(tuple(t.shape) for t in call.tensors))
        all_reduce = scratch.all_reduce
        if gather_s is None and all_reduce is not None:
            gather_s = timing.scratch_all_reduce(layer, group, all_reduce)
            out.comm_ranks = tuple(peers)
        elif gather_s is not None:  # the unshard's all-gather, over the FSDP shard group
            out.comm_ranks = gather_ranks(layer, self.owner(idx))
        out.comm_s = gather_s


class OptimizerRecipe:
    """The optimizer recipe: a rotating slice captured around the real step, replayed on a clone at the boundary."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, slice_elems: int, local_only: Sequence[torch.Tensor],
                 compare_slices: bool) -> None:
        self.slice = OptimizerSlice(optimizer, slice_elems, local_only=local_only)
        # Where peers hold different shards (pure FSDP owns each update uniquely) only the self-check is
        # comparable across peers.
        self.compare_slices = compare_slices
        self.error: BaseException | None = None
        """A failure capturing the slice before the step, reported at the boundary (every peer agrees to skip)."""

    def before_step(self, due: bool) -> None:
        """Capture the slice before the real step of a boundary where the recipe is ``due``."""
        if not self.slice.inner_step() or not due:
            return
        try:
            self.slice.before_step()
        except Exception as exc:  # noqa: BLE001 - reported at the boundary, where every peer agrees to skip
            self.slice.pending, self.error = None, exc

    def take_error(self) -> BaseException | None:
        error, self.error = self.error, None
        return error

    def replay(self, guard: DiagnosisGuard, *, rank: int, src: int, host_group: Any) -> list[tuple[str, Any]]:
        """Replay the update on the cloned slice: its surfaces for the exchange. Where peers hold different shards,
        every peer also replays the source's slice (``optimizer_source``): the self-check alone cannot see a
        kernel that errs on every call."""
        pending = self.slice.pending
        replayed = guard.run("optimizer replay", self.slice.after_step) or []
        out = [(n, v) for n, v in replayed if self.compare_slices or n == SELF_CHECK_SURFACE]
        if not self.compare_slices:
            out += source_slice_surface(self.slice, pending, guard, rank=rank, src=src, host_group=host_group)
        return out


def peers_hold_equal_shards(optimizer: torch.optim.Optimizer | None, peers: Sequence[int], rank: int) -> bool:
    """False when some peer holds a different shard of a parameter (its sharding dim spans peers): then only the
    optimizer's self-check is comparable across peers (pure FSDP owns each update uniquely)."""
    if optimizer is None:
        return True
    others = set(peers) - {rank}
    for group in optimizer.param_groups:
        for p in group["params"]:
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                continue
            for dim, placement in enumerate(p.placements):
                if placement.is_shard():
                    members = set(dist.get_process_group_ranks(mesh.get_group(dim)))
                    if members & others:
                        return False
    return True
