"""Attach SCOUT to Megatron-Core's own objects: model chunks, optimizer, parallel state and RNG tracker.

Everything comes from what Megatron built; nothing of SCOUT's mechanisms is re-implemented here (scout_core's
framework adapter and ``enable_with`` do the rest):

* chunks: the list Megatron's ``setup_model_and_optimizer`` returns (one per virtual pipeline stage), wrapped
  as Megatron wraps them (its ``DistributedDataParallel``, ``Float16Module``); layers, embedding and output are
  found inside the unwrapped ``GPTModel`` (``decoder.layers``, ``embedding``, ``output_layer``);
* optimizers: the torch optimizers inside ``ChainedOptimizer`` / ``FP32Optimizer`` /
  ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer``; SCOUT's boundary follows Megatron's own
  ``optimizer.step()`` (its distributed optimizer gathers the updated shards after its inner optimizers stepped);
* peer groups: every rank's data-parallel group without context parallelism, from
  ``megatron.core.parallel_state`` (the ranks holding the same parameters); tensor- and pipeline-parallel
  partners are in different peer groups and replay the same sampled layer at the same check, so a tensor-
  parallel layer's collectives pair up in replay as in training; those partners form *replica groups*
  (:func:`replica_groups`): a layer's replayed output is compared across them too, which names the rank where
  its own peer group of two data-parallel replicas has no majority;
* RNG: every stream of Megatron's tensor-parallel RNG tracker (Transformer Engine's tracker where Megatron uses
  it) is a replay RNG provider, so a replay runs under the source's dropout streams;
* MoE: Megatron's ``MoELayer`` recognised and its experts bound to the expert recipe (:mod:`scout_megatron.moe`);
* state: Megatron's LR/weight-decay scheduler (``OptimizerParamScheduler``) in SCOUT's snapshots;
* the hang path: Megatron's gradient buckets issue ``torch.distributed`` collectives, which SCOUT observes;
  the distributed optimizer's reduce-scatter and all-gather are bound at Megatron's import, so they are routed
  through ``torch.distributed`` at call time (:func:`observe_bucket_collectives`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from scout_core.adapter import discover_layers, torch_adapter
from scout_core.config import ScoutConfig
from scout_core.groups import gathered_groups
from scout_core.progress.hooks import late_bound
from scout_core.replay.rng import RngProvider
from scout_core.runtime import ScoutHandle, enable_with
from scout_core.wire import all_gather_data
from scout_megatron.moe import dense_parts, moe_binding, moe_metrics_kept

__all__ = ["attach", "mark_data", "observe_bucket_collectives", "peer_groups", "replica_groups", "rng_providers",
           "unwrap"]

log = logging.getLogger("scout_megatron")


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside Megatron's wrappers (DDP, FSDP, Float16Module)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)



def peer_groups() -> list[list[int]]:
    """SCOUT's peer groups from Megatron's parallel state: each rank's data-parallel group, without context
    parallelism (context-parallel ranks hold the same parameters but attend over their own part of the
    sequence: replayed on one source's input they would differ; they replay together, each in its own group).
    Every rank calls it (one gather of the groups' ranks)."""
    from megatron.core import parallel_state

    return gathered_groups(parallel_state.get_data_parallel_group(with_context_parallel=False))


def replica_groups(model_config: Any) -> list[list[int]] | None:
    """The ranks of each pipeline stage (and context-parallel position), where a hidden layer's replayed output is
    the same on all of them:
    tensor parallelism without sequence parallelism all-reduces a layer's output to every tensor-parallel
    partner, and the partners of one check replay their peer groups' sources, which are themselves partners.
    None where that does not hold (no tensor parallelism, sequence parallelism, expert parallelism). Every rank
    calls it (one gather)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    if tp <= 1 or ep > 1 or getattr(model_config, "sequence_parallel", False):
        return None
    # Tensor-parallel partners of the same pipeline stage and context-parallel position.
    stages = all_gather_data((parallel_state.get_pipeline_model_parallel_rank(),
                              parallel_state.get_context_parallel_rank()), what="pipeline stages")
    return [[r for r, s in enumerate(stages) if s == stage] for stage in sorted(set(stages))]


def tensor_parallel_copies(layer: nn.Module) -> list[torch.Tensor]:
    """A layer's parameters that every tensor-parallel partner holds a copy of (layer norms, row-parallel biases):
    Megatron marks the sharded ones ``tensor_model_parallel``. The replica comparison stands only while these
    copies are equal across partners."""
    return [p for p in layer.parameters() if not getattr(p, "tensor_model_parallel", False)]


def _distributed_optimizer(optimizer: Any) -> bool:
    """Whether each data-parallel rank's optimizer steps a different part of the state (Megatron's distributed
    optimizer, or its layer-wise distributed optimizer, a ChainedOptimizer of per-rank layers)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    sharded: tuple[type, ...] = (DistributedOptimizer,)
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

        sharded += (LayerWiseDistributedOptimizer,)
    except ImportError:  # pragma: no cover - older megatron-core
        pass
    inner = [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]
    return any(isinstance(o, sharded) for o in inner)


@contextlib.contextmanager
def _checking(chunks: list[nn.Module]) -> Iterator[None]:
    """What a check runs inside: Megatron's parameter-gather hooks off and its MoE metrics kept."""
    with param_gather_paused(chunks), moe_metrics_kept():
        yield


@contextlib.contextmanager
def param_gather_paused(chunks: list[nn.Module]) -> Iterator[None]:
    """Megatron's DDP under ``--overlap-param-gather`` gathers the updated parameters lazily, in the next
    forward's pre-hooks: at SCOUT's boundary each data-parallel rank holds its own updated shard and the others'
    old ones, and a replay that ran those hooks would mark buckets gathered that the next real forward then skips.
    While SCOUT checks, the hooks are off and the parameters synced, exactly as Megatron does around its own
    evaluation (``disable_forward_pre_hook()``: the same all-gather the next forward would have made)."""
    lazy = [c for c in chunks if getattr(c, "use_forward_hook", False)]
    paused: list[nn.Module] = []
    try:
        for chunk in lazy:
            if chunk.remove_forward_pre_hook_handles:
                chunk.disable_forward_pre_hook(param_sync=True)
                paused.append(chunk)
            else:  # Megatron keeps the hooks off for the first iteration: the sync alone, as its own call makes it
                with torch.no_grad():
                    chunk.start_param_sync(force_sync=True)
        yield
    finally:  # also when switching them off failed half-way: every chunk switched off gets its hooks back
        for chunk in paused:
            chunk.enable_forward_pre_hook()


def rng_providers() -> dict[str, RngProvider]:
    """Every stream of Megatron's tensor-parallel RNG tracker (as initialized: Megatron's own, or Transformer
    Engine's where ``--te-rng-tracker`` chose it), as replay RNG providers."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER  # what get_cuda_rng_tracker() returns, without initializing one
    if tracker is None or not tracker.is_initialized():
        return {}

    def provider(name: str) -> RngProvider:
        def get() -> torch.Tensor:
            return mrandom._CUDA_RNG_STATE_TRACKER.get_states()[name]

        def set_(state: torch.Tensor) -> None:
            live = mrandom._CUDA_RNG_STATE_TRACKER
            states = live.get_states()
            states[name] = state.clone()
            live.set_states(states)

        return get, set_

    return {f"megatron:{name}": provider(name) for name in tracker.get_states()}


_BUCKET_FUNCS = ("dist_all_gather_func", "dist_reduce_scatter_func", "_coalescing_manager")


def observe_bucket_collectives() -> bool:
    """Route Megatron's gradient-bucket reduce-scatter and parameter all-gather (the distributed optimizer's) and
    its buckets' ``_coalescing_manager`` through ``torch.distributed`` at call time, where SCOUT's collective hooks
    see them (a coalesced bucket stays in flight until its batch completes). Megatron binds them to module
    globals at import, before any hook exists. Idempotent; True if anything was rerouted."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    changed = False
    for attr in _BUCKET_FUNCS:
        late = late_bound(getattr(buffers, attr, None))  # None: Megatron's own (fp32-accumulating reduce-scatter)
        if late is not None:
            setattr(buffers, attr, late)
            changed = True
    return changed


class _MarkedFetches:
    """An iterator whose fetches are marked on SCOUT's hang path (the data phase while ``next`` waits); every other
    attribute is the iterator's own (a loader's ``save_state`` for ``--dataloader-save``)."""

    def __init__(self, inner: Any, tracker: Any) -> None:
        self._inner = inner
        self._tracker = tracker

    def __iter__(self) -> _MarkedFetches:
        return self

    def __next__(self) -> Any:
        from scout_core.progress.record import Phase

        self._tracker.mark(Phase.DATALOADER)
        try:
            return next(self._inner)
        finally:
            self._tracker.mark(Phase.COMPUTE)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_inner", "_tracker"):  # a copy or unpickling before __init__ ran
            raise AttributeError(name)
        return getattr(self._inner, name)


def mark_data(handle: ScoutHandle, iterators: Any) -> Any:
    """Megatron's training data iterator(s) (one, a list per virtual stage, or None on ranks that load no data:
    Megatron reads data on tensor-parallel rank 0 only), each fetch marked on SCOUT's hang path: a rank waiting for
    its data is named a data stall, judged by ``observer.io_silence_s``, not a hang in compute. Inside Megatron's
    ``RerunDataIterator`` only the iterator it reads from is wrapped, so its rewind and replay of saved microbatches
    are left as they are. Only marks: a fetch is not a point every rank reaches (TP partners receive the batch by
    broadcast, middle pipeline stages fetch nothing), so nothing that needs every rank runs there."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    tracker = handle.tracker
    if tracker is None:  # no observer: nothing watches the marks
        return iterators

    def marked(it: Any) -> Any:
        if it is None or isinstance(it, _MarkedFetches):
            return it
        if isinstance(it, RerunDataIterator):
            if it.iterable is not None and not isinstance(it.iterable, _MarkedFetches):
                it.iterable = _MarkedFetches(it.iterable, tracker)
            return it
        return _MarkedFetches(it, tracker)

    if isinstance(iterators, list):
        return [marked(it) for it in iterators]
    return marked(iterators)


def attach(model: nn.Module | list[nn.Module], optimizer: Any, *, config: ScoutConfig | None = None,
           opt_param_scheduler: Any = None, state: Mapping[str, Any] | None = None) -> ScoutHandle:
    """Install SCOUT on a Megatron-Core job whose model chunks and optimizer exist (every rank calls it, after
    ``megatron.core.parallel_state`` is initialized)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    inner = [unwrap(c) for c in chunks]
    layers, names = discover_layers(inner)  # GPTModel's decoder.layers (per virtual stage: chunk<i>.)
    embedding = getattr(inner[0], "embedding", None) if getattr(inner[0], "pre_process", True) else None
    output = getattr(inner[-1], "output_layer", None) if getattr(inner[-1], "post_process", True) else None
    kept = dict(state or {})
    if opt_param_scheduler is not None:
        kept.setdefault("opt_param_scheduler", opt_param_scheduler)
    observe_bucket_collectives()
    groups = peer_groups()
    blocks = layers
    moe = moe_binding(inner)
    layers, names = dense_parts(blocks, names, bound=moe is not None)  # MoE layers by their attention
    adapter = torch_adapter(chunks, optimizer, peer_groups=groups, layers=layers, embedding=embedding,
                            output=output, rng_providers=rng_providers(), state=kept or None, moe=moe)
    adapter.layer_names = names
    adapter.marked_layers = blocks  # hangs are placed by Megatron's layers, whatever part replay samples
    adapter.name = "megatron"
    from megatron.core.utils import get_model_config

    model_config = get_model_config(chunks[0])
    adapter.replica_groups = replica_groups(model_config)
    adapter.replicated_parameters = tensor_parallel_copies
    from megatron.core import parallel_state

    adapter.replay_pairs_across_groups = (parallel_state.get_tensor_model_parallel_world_size() > 1
                                          or parallel_state.get_context_parallel_world_size() > 1)
    # Each data-parallel rank's distributed optimizer steps its own shard of the state: nothing to compare.
    adapter.compare_optimizer_slices = False if _distributed_optimizer(optimizer) else None
    # Gradient-accumulation fusion adds weight gradients to main_grad inside the backward and hands autograd a
    # placeholder: only outputs and input gradients are comparable then.
    adapter.compare_param_grads = not getattr(model_config, "gradient_accumulation_fusion", False)
    # Transformer Engine's FP8 scaling state (its modules' extra state) is the same on the data-parallel replicas
    # only where Megatron reduces the amax over them (its default); --tp-only-amax-red reduces it within TP.
    adapter.compare_extra_state = not getattr(model_config, "tp_only_amax_red", False)
    adapter.replay_context = functools.partial(_checking, chunks)
    # SCOUT's boundary follows Megatron's own optimizer step: its distributed optimizer copies each rank's
    # updated shard into the model and gathers the others' after its inner optimizers stepped, so only then do
    # the data-parallel replicas hold the same parameters.
    adapter.step_owner = optimizer
    if config is not None and (config.topology.shape or config.topology.order != ScoutConfig().topology.order):
        log.warning("scout_megatron: --scout-topology-* is ignored: peer groups come from Megatron's parallel "
                    "state")
    handle = enable_with(adapter, config=config)
    if handle.rank == 0:
        from scout_megatron import transformer_engine_version

        log.info("scout_megatron: SCOUT attached to %d model chunk(s), %d optimizer(s), %d repeated layers, peer "
                 "groups %s; Transformer Engine: %s", len(chunks), len(adapter.optimizers), len(layers), groups,
                 transformer_engine_version() or "not importable")
    return handle
