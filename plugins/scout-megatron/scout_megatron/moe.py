"""Megatron-Core's MoE layers under SCOUT: ``MoELayer`` recognised, its experts bound to scout_core's expert recipe.

* Each expert is checked on its own by the expert recipe (:class:`scout_core.moe.binding.MoEBinding`), among the
  ranks holding it (Megatron's expert-data-parallel group: the same EP position in every replica), on the rows it
  received in training. Without expert parallelism that is every data-parallel rank.
* With expert parallelism (``--expert-model-parallel-size``) each EP position holds other experts and the layer
  exchanges tokens with an AllToAll: a whole layer replayed on one shared input would differ on every rank with
  nothing wrong. The experts are still bound (per EP position), and with Megatron's AllToAll dispatcher each
  expert check also replays the AllToAll with one communication plan across every EP group
  (:mod:`scout_core.moe.alltoall`), from the split sizes of the layer's last dispatch (the dispatcher's
  ``input_splits``).
* The dense recipe replays an MoE layer's attention (``self_attention``) and its router (``mlp.router``) as two
  parts wherever its experts are bound or EP is on. A router's forward in training mode counts tokens for the
  expert bias (buffers: put back after every replay, as every replayed module's buffers are) and records its
  auxiliary losses in Megatron's MoE metrics tracker, which Megatron logs: :func:`moe_metrics_kept` puts the
  tracker back as it was after each check, so the logged losses are training's only.
* Under expert tensor parallelism (``--expert-tensor-parallel-size``, by default the tensor-parallel size) each
  expert's linears hold a shard and run without collectives (Megatron's dispatcher gathers and reduces around
  them): the expert peers are the ranks with the same EP and expert-TP positions, which hold the same shard and
  receive the same rows.
* Not bound (a warning, the same on every rank; the layer is then replayed whole without EP, by its attention
  and router with EP): grouped-GEMM experts (``GroupedMLP``, ``TEGroupedMLP``: ``--moe-grouped-gemm``), and
  models where some pipeline stages have no MoE layer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

from scout_core.groups import gathered_groups
from scout_core.moe.binding import MoEBinding
from scout_core.wire import all_gather_data

__all__ = ["dense_parts", "moe_binding", "moe_layers", "moe_metrics_kept"]

log = logging.getLogger("scout_megatron")


def moe_layers(inner: list[nn.Module]) -> tuple[list[nn.Module], list[str]]:
    """Megatron's ``MoELayer`` modules in the unwrapped model chunks, with their names."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    found = [(m, f"chunk{i}.{n}" if i else n) for i, chunk in enumerate(inner) for n, m in chunk.named_modules()
             if isinstance(m, MoELayer)]
    return [m for m, _ in found], [n for _, n in found]


def _dispatch_splits(layer: nn.Module) -> list[int]:
    """The rows this rank sent to each EP position in the layer's last AllToAll dispatch."""
    splits = layer.token_dispatcher.input_splits
    if splits is None:
        raise RuntimeError("the MoE layer has not dispatched yet")
    return [int(x) for x in (splits.tolist() if hasattr(splits, "tolist") else splits)]


def moe_binding(inner: list[nn.Module]) -> MoEBinding | None:
    """The expert recipe's binding of Megatron's MoE layers, or None (no MoE layer, or a layout not bound yet).
    Every rank calls it and decides alike (the layout is the same everywhere)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    layers, names = moe_layers(inner)
    ep = parallel_state.get_expert_model_parallel_world_size()
    # Decided alike on every rank before anything else: the binding's set-up and every expert check hold world
    # collectives, and pipeline stages differ (a first stage of dense layers has no MoE layer at all).
    mine = [bool(layers), all(isinstance(m.experts, SequentialMLP) for m in layers),
            all(isinstance(m.token_dispatcher, MoEAlltoAllTokenDispatcher)
                and not getattr(m.token_dispatcher, "drop_and_pad", False) for m in layers)]
    everyone = all_gather_data(mine, what="MoE layout")
    everywhere, sequential, alltoall = (all(flags) for flags in zip(*everyone))
    if not everywhere:
        if layers:
            log.warning("scout_megatron: some pipeline stages have no MoE layer: Megatron's experts are not bound to "
                        "SCOUT's expert recipe; MoE layers replay by their attention and router")
        return None
    if not sequential:
        log.warning("scout_megatron: grouped-GEMM experts (%s) are not bound to SCOUT's expert recipe yet; they "
                    "are checked inside their layers' replays only", type(layers[0].experts).__name__)
        return None
    alltoall = alltoall and ep > 1
    if ep > 1 and not alltoall:
        dispatcher = layers[0].token_dispatcher
        log.warning("scout_megatron: expert parallelism without the AllToAll dispatcher's variable splits (%s%s): "
                    "experts are checked, the token exchange is not replayed", type(dispatcher).__name__,
                    ", padded to capacity" if getattr(dispatcher, "drop_and_pad", False) else "")
    # Megatron's expert linears are its own parallel layers, not nn.Linear: the row width is the model's.
    return MoEBinding(
        layers=layers, names=names, experts=lambda m: m.experts.local_experts,
        expert_peer_groups=gathered_groups(parallel_state.get_expert_data_parallel_group()),
        ep_groups=(gathered_groups(parallel_state.get_expert_model_parallel_group())
                   if alltoall else None),
        ep_position=parallel_state.get_expert_model_parallel_rank(),
        splits=_dispatch_splits if alltoall else None, hidden_size=int(layers[0].config.hidden_size))


def dense_parts(layers: list[nn.Module], names: list[str], *, bound: bool) -> tuple[list[nn.Module], list[str]]:
    """The repeated layers the dense recipe replays: every layer, except that a layer with an MoE MLP is replayed by
    its ``self_attention`` under expert parallelism (see the module's docstring) and where its experts are bound to
    the expert recipe (``bound``: their capture hooks must see training's rows only, and the expert recipe checks
    them)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if parallel_state.get_expert_model_parallel_world_size() <= 1 and not bound:
        return layers, names
    kept, replaced = [], 0
    for layer, name in zip(layers, names):
        if any(isinstance(m, MoELayer) for m in layer.modules()) and hasattr(layer, "self_attention"):
            kept.append((layer.self_attention, f"{name}.self_attention"))
            router = getattr(getattr(layer, "mlp", None), "router", None)
            # Megatron's routing replay (--moe-enable-routing-replay) records or replays each router call's
            # choices: a replay by SCOUT would overwrite them, or route by this rank's own record.
            if router is not None and getattr(router, "router_replay", None) is None:
                kept.append((router, f"{name}.mlp.router"))
            replaced += 1
        else:
            kept.append((layer, name))
    if replaced:
        log.warning("scout_megatron: %d MoE layer(s) replay by their attention and router in the dense recipe (their "
                    "experts: %s)", replaced, "the expert recipe" if bound else "not checked in this layout")
    return [m for m, _ in kept], [n for _, n in kept]


@contextlib.contextmanager
def moe_metrics_kept() -> Iterator[None]:
    """Megatron's MoE metrics tracker (the auxiliary losses it logs) as training left it, after whatever runs
    inside: a replayed router records its losses there too."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # pragma: no cover - an older megatron-core: nothing tracked this way
        yield
        return
    tracker = get_moe_metrics_tracker()
    saved = {name: entry.values.detach().clone() for name, entry in tracker.metrics.items()}
    try:
        yield
    finally:
        for name in [n for n in tracker.metrics if n not in saved]:
            del tracker.metrics[name]  # first recorded by a replay
        for name, values in saved.items():
            tracker.metrics[name].values.copy_(values)
