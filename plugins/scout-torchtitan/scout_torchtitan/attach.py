"""Attach SCOUT to a built TorchTitan Trainer: its model parts, inner optimizers, meshes and state.

Everything comes from the Trainer's own objects; nothing of SCOUT's mechanisms is re-implemented here
(scout_core's framework adapter, ``enable_with``, does the rest):

* chunks: ``trainer.model_parts`` (one per local pipeline stage), wrapped as TorchTitan wraps them
  (FSDP2 / HSDP ``fully_shard``, TP DTensors);
* optimizers: the torch optimizers inside TorchTitan's ``OptimizersContainer`` (its ``optimizers`` list, one
  per model part), not the container: SCOUT's boundary is the last inner optimizer's step;
* peer groups: from ``trainer.parallel_dims``, laid out as TorchTitan lays out its world mesh (pipeline
  outermost, then data replicate, data shard, context, tensor innermost): peers vary along data replicate
  (or data shard where there is no replication) with every other coordinate fixed, as
  :func:`scout_core.topology.peer_groups` defines them;
* repeated layers, embedding and output: discovered by scout_core in TorchTitan's model classes (the blocks'
  ``ModuleDict``, ``tok_embeddings``, ``output``);
* state: the LR schedulers, the data loader (both ``Stateful``) and the Trainer's token count, kept in SCOUT's
  snapshots so a restore resumes the same batches with the same learning rate.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from scout_core.adapter import dense_part, torch_adapter
from scout_core.replay.spec_codec import allow_call_closures
from scout_core.runtime import ScoutHandle, enable_with
from scout_core.topology import peer_groups as peer_groups_of_shape
from scout_torchtitan.config import ScoutSection, to_core
from scout_torchtitan.moe import expert_binding

__all__ = ["TITAN_MESH_ORDER", "attach", "peer_groups"]

log = logging.getLogger("scout_torchtitan")

TITAN_MESH_ORDER = ("p", "d", "s", "c", "t", "e")
"""TorchTitan's world mesh, outermost first: pp, dp_replicate, dp_shard, cp, tp (ParallelDims.build_mesh),
as scout_core's axes (expert parallelism is carved out of these, not a world dimension of its own: e = 1)."""


def peer_groups(parallel_dims: Any) -> list[list[int]]:
    """SCOUT's peer groups for TorchTitan's ``ParallelDims``: ranks that hold the same layers' equivalent
    state (data-parallel replicas, or the shards of one FSDP group where nothing is replicated)."""
    shape = {"p": parallel_dims.pp, "d": parallel_dims.dp_replicate, "s": parallel_dims.dp_shard,
             "c": parallel_dims.cp, "t": parallel_dims.tp, "e": 1}
    return [list(g) for g in peer_groups_of_shape(shape, TITAN_MESH_ORDER)]


def dense_parts(layers: list[Any], names: list[str], ep: int) -> tuple[list[Any], list[str]]:
    """The repeated layers the dense recipe replays: TorchTitan's blocks, except that under expert parallelism
    a block with an MoE layer is replayed by its attention only (inside the block's FSDP unshard).

    Why: an expert-parallel MoE holds different experts on each EP position and exchanges tokens with an
    AllToAll, so replaying the whole block on one shared input gives each rank a different result, and the
    peers would disagree with nothing wrong (measured: every MoE block of ``deepseek_v3_debugmodel`` at EP 2
    named all four ranks SDC). Without expert parallelism every rank holds every expert, and the block replays
    whole, experts included. The attention is found by structure, not by name (``attention`` in most of
    TorchTitan's models, ``attn`` in Qwen3.5): the block's child without an MoE layer that holds the most
    parameters (the norms beside it are tiny, and not replayed)."""
    if ep <= 1:
        return layers, names
    names = names or [f"layers.{i}" for i in range(len(layers))]
    from torchtitan.models.common.moe import MoE

    def has_moe(module: torch.nn.Module) -> bool:
        return any(isinstance(m, MoE) for m in module.modules())

    kept: list[tuple[Any, str]] = []
    dropped: list[str] = []
    for layer, name in zip(layers, names):
        block = getattr(layer, "_checkpoint_wrapped_module", layer)  # inside activation checkpointing
        if not has_moe(block):
            kept.append((layer, name))
            continue
        part = dense_part(block, has_moe)
        if part is not None:
            kept.append((part[1], f"{name}.{part[0]}"))
        else:
            dropped.append(name)
    replaced = [n for _, n in kept if n not in names]
    if replaced:
        log.warning("scout_torchtitan: expert parallelism %d: the dense recipe replays %d MoE block(s) by their %s "
                    "(their experts are the expert recipe's; router, shared experts and norms are not replayed)",
                    ep, len(replaced), replaced[0].rsplit(".", 1)[-1])
    if dropped:
        log.warning("scout_torchtitan: expert parallelism %d: MoE block(s) %s have no dense part to replay: not "
                    "replayed", ep, ", ".join(dropped))
    if not kept:
        raise ValueError(f"scout_torchtitan: expert parallelism {ep}: no block of this model has a dense part SCOUT "
                         "can replay; switch replay off (--scout.replay.enabled false) or run without EP")
    return [m for m, _ in kept], [n for _, n in kept]


def attach(trainer: Any, section: ScoutSection) -> ScoutHandle:
    """Install SCOUT, configured by ``section``, on a Trainer whose model parts, optimizers, LR schedulers,
    data loader and meshes exist (every rank calls it)."""
    state: dict[str, Any] = {
        name: obj for name, obj in (("lr_schedulers", getattr(trainer, "lr_schedulers", None)),
                                    ("dataloader", getattr(trainer, "dataloader", None)))
        if obj is not None and hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")}
    if hasattr(trainer, "ntokens_seen"):
        # The Trainer's own count of tokens (its ``step`` is the snapshot's step, set by the restart): read when
        # the next batch is fetched, before the Trainer adds that batch's tokens.
        state["train_state"] = (lambda: {"ntokens_seen": int(trainer.ntokens_seen)},
                                lambda saved: setattr(trainer, "ntokens_seen", int(saved["ntokens_seen"])))
    chunks = list(trainer.model_parts)
    adapter = torch_adapter(chunks, list(trainer.optimizers.optimizers), peer_groups=peer_groups(trainer.parallel_dims),
                            state=state or None, moe=expert_binding(trainer, chunks))
    adapter.name = "torchtitan"
    # Tensor- and context-parallel partners sit in other peer groups and run the sampled layer's collectives
    # together in replay.
    adapter.replay_pairs_across_groups = trainer.parallel_dims.tp > 1 or trainer.parallel_dims.cp > 1
    blocks = adapter.repeated_layers()
    adapter.layers, adapter.layer_names = dense_parts(blocks, list(adapter.layer_names or []),
                                                      trainer.parallel_dims.ep)
    adapter.marked_layers = blocks  # hangs are placed by TorchTitan's blocks, whatever part replay samples
    # TorchTitan's FlexAttention masks are closures of its attention module (and of a model's own module):
    # replay ships them to peers, so those modules are registered for closures.
    allow_call_closures("torchtitan.models.common.attention", *{type(c).__module__ for c in chunks})
    handle = enable_with(adapter, config=to_core(section))
    if handle.rank == 0:
        log.info("scout_torchtitan: SCOUT attached to %d model part(s), %d optimizer(s), peer groups %s; hidden "
                 "layers replayed every %d steps", len(adapter.chunks), len(adapter.optimizers),
                 peer_groups(trainer.parallel_dims), section.replay.cadence.hidden)
        warning = unseeded_warning(trainer)
        if warning:
            log.warning(warning)
    return handle


def unseeded_warning(trainer: Any) -> str:
    """What to say when the job has no ``--debug.seed`` (TorchTitan 0.3: ``Trainer.config.debug``): the README's
    "bitwise as without SCOUT" needs one; empty when a seed is set."""
    debug = getattr(getattr(trainer, "config", None), "debug", None)
    if debug is None or getattr(debug, "seed", 0) is not None:
        return ""
    return ("scout_torchtitan: --debug.seed is not set: each run of this job starts from other random weights, so "
            "no two runs (with SCOUT or without) can be compared bit for bit; SCOUT's own checks compare replicas "
            "within this run and need no seed")
