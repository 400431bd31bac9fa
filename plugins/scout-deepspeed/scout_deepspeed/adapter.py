"""Attach SCOUT to a DeepSpeed engine: its module, the torch optimizer inside its ZeRO wrapper, its groups and RNG.

Everything comes from what ``deepspeed.initialize`` built; scout_core's framework adapter and ``enable_with`` do
the rest:

* model: ``engine.module`` (the user's model; its repeated blocks, embedding and output found as scout_core finds
  them in any PyTorch model);
* optimizer: the torch optimizer inside DeepSpeed's wrapper (``DeepSpeedZeroOptimizer`` for ZeRO 1 and 2,
  ``DeepSpeedZeroOptimizer_Stage3``, or the client optimizer itself without ZeRO). SCOUT's boundary follows the
  wrapper's ``step()``, which DeepSpeed's engine calls only at a gradient-accumulation boundary, and which ends
  once the updated partitions are back in the model (ZeRO 1 and 2 gather them there): replay and snapshots run at
  real optimizer steps only, with the replicas holding the same parameters;
* peer groups: every rank's ``engine.data_parallel_group`` (the ranks holding the same dense parameters); under
  ZeRO each of them steps its own partition of the optimizer state, so optimizer updates are self-checked on each
  rank, not compared;
* ZeRO-3: a sampled layer's parameters are gathered for its replay only (``deepspeed.zero.GatheredParameters``,
  on every rank of its partition group at the same check, as FSDP2 replay unshards) and the layer is called with
  DeepSpeed's module hooks set aside, so its fetch, release and gradient reduction never touch the live
  partitioned state; replay's gradients are computed functionally and never reach the parameters' gradient hooks;
* RNG: every stream of DeepSpeed's activation-checkpointing RNG tracker is a replay RNG provider;
* MoE: ``deepspeed.moe.layer.MoE`` recognised and its experts bound to the expert recipe (:mod:`scout_deepspeed.moe`);
* the hang path: DeepSpeed's collectives (``deepspeed.comm``'s torch backend) call ``torch.distributed``, where
  SCOUT observes them; the all-gather and reduce-scatter the backend bound at its start-up (ZeRO's parameter
  gathers and gradient reduce-scatters) are rerouted through ``torch.distributed`` at call time
  (:func:`observe_backend_collectives`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from scout_core.adapter import find_inner_optimizers, torch_adapter
from scout_core.config import ConfigError, ScoutConfig
from scout_core.groups import gathered_groups
from scout_core.progress.hooks import late_bound
from scout_core.replay.rng import RngProvider
from scout_core.runtime import ScoutHandle, enable_with
from scout_deepspeed.moe import dense_parts, moe_binding, moe_layers
from scout_deepspeed.zero3 import gather_zero3, gathered_bytes

__all__ = ["attach", "observe_backend_collectives", "rng_providers"]

log = logging.getLogger("scout_deepspeed")


def rng_providers() -> dict[str, RngProvider]:
    """Every stream of DeepSpeed's activation-checkpointing RNG tracker (``deepspeed.checkpointing``'s, seeded by
    ``model_parallel_cuda_manual_seed``), as replay RNG providers; none where nothing was added to it."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    def tracker() -> Any:
        return checkpointing.get_cuda_rng_tracker()

    def provider(name: str) -> RngProvider:
        def get() -> torch.Tensor:
            return tracker().get_states()[name]

        def set_(state: torch.Tensor) -> None:
            live = tracker()
            states = live.get_states()
            states[name] = state.clone()
            live.set_states(states)

        return get, set_

    return {f"deepspeed:{name}": provider(name) for name in tracker().get_states()}


def observe_backend_collectives() -> bool:
    """Route the all-gather and reduce-scatter DeepSpeed's torch backend bound at its start-up (before SCOUT's
    collective hooks existed) through ``torch.distributed`` at call time, where SCOUT's hooks see them: ZeRO-3's
    parameter all-gathers and gradient reduce-scatters, ZeRO-1/2's gather of the updated partitions. A function of
    DeepSpeed's own (not torch.distributed's) is left alone. Idempotent; True if anything was rerouted."""
    from deepspeed.comm import comm

    backend = getattr(comm, "cdb", None)
    changed = False
    for attr in ("all_gather_function", "reduce_scatter_function"):
        late = late_bound(getattr(backend, attr, None))
        if late is not None:
            setattr(backend, attr, late)
            changed = True
    return changed


def _wrapper_steps(engine: Any, inner: list[torch.optim.Optimizer]) -> Any:
    """DeepSpeed's optimizer wrapper whose ``step()`` ends the training step (None: the engine steps the torch
    optimizer itself, whose own step is the boundary)."""
    wrapper = engine.optimizer
    if wrapper is None or any(wrapper is o for o in inner):
        return None
    return wrapper


_REPLAYED_OPTIMIZERS = frozenset({
    *(f"torch.optim.{n}" for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                                   "Adadelta", "Rprop", "ASGD")),
    "deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.lion.fused_lion.FusedLion"})
"""The optimizers whose update optimizer replay reproduces on a slice: elementwise, every state a tensor of the
parameter's shape or a count a fresh instance is given (torch's elementwise ones; DeepSpeed's fused Adam and
Lion)."""


def _unreplayable(opt: torch.optim.Optimizer) -> str | None:
    """Why optimizer replay cannot check ``opt`` (None: it can). Replay steps a fresh instance of the optimizer's
    class on a slice, so only the optimizers in ``_REPLAYED_OPTIMIZERS`` pass: DeepSpeed's CPU optimizers
    (offload) keep their step count in C++ and compute the bias correction otherwise than a fresh instance does
    (and start a subprocess in every constructor); LAMB's trust ratio and Adafactor's update scale span the whole
    tensor; Muon orthogonalizes whole matrices (a slice makes it raise); the 1-bit optimizers communicate inside
    their step; LBFGS needs a closure. A subclass is not the class it extends: it may change the update."""
    cls = type(opt)
    names = {f"{cls.__module__}.{cls.__qualname__}", f"torch.optim.{cls.__qualname__}"
             if cls.__module__.startswith("torch.optim.") and getattr(torch.optim, cls.__qualname__, None) is cls
             else ""}
    if names & _REPLAYED_OPTIMIZERS:
        return None
    return f"{cls.__qualname__} ({cls.__module__})"


def _unsupported_layout(engine: Any) -> str | None:
    """A parallel layout the adapter cannot diagnose safely (None: data parallelism, ZeRO, MoE). Under tensor
    (an ``mpu``, AutoTP), sequence (Ulysses) or pipeline parallelism a replayed block runs collectives with
    ranks in other peer groups, which replay here does not pair: the replay could leave them waiting."""
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:  # pragma: no cover - another deepspeed layout
        PipelineEngine = ()  # noqa: N806
    if isinstance(engine, PipelineEngine):
        return "pipeline parallelism (PipelineEngine)"
    if int(getattr(engine, "mp_world_size", 1) or 1) > 1:
        return f"tensor parallelism (model-parallel size {engine.mp_world_size}: an mpu, or AutoTP)"
    if int(getattr(engine, "sequence_parallel_size", 1) or 1) > 1:
        return f"sequence parallelism (Ulysses, size {engine.sequence_parallel_size})"
    return None


def snapshots_refused(keeper: str) -> ConfigError:
    """The error for ``checkpoint.enabled`` where DeepSpeed keeps master weights SCOUT's snapshots do not hold."""
    return ConfigError('DeepSpeed config "scout.checkpoint.enabled": SCOUT\'s in-memory snapshots keep the model '
                       f"and the torch optimizer's state, not the master weights {keeper} keeps beside them: "
                       "certification labels DeepSpeed's own checkpoints (engine.save_checkpoint) and the restart "
                       "loads the one it chose; set it to false")


def master_weights_keeper(ds_config: Any) -> str | None:
    """What keeps master weights beside the model, read from the DeepSpeed config before the engine exists
    (ZeRO stage 1-3, bf16 or fp16), or None."""
    if not isinstance(ds_config, Mapping):
        return None
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if isinstance(stage, int) and stage > 0:
        return f"ZeRO stage {stage}"
    for dtype in ("bf16", "bfloat16", "fp16"):
        section = ds_config.get(dtype)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return dtype
    return None


def _partitions(wrapper: Any) -> bool:
    """Whether a stage-0 wrapper partitions the optimizer state over the data-parallel ranks (BF16_Optimizer)."""
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError:  # pragma: no cover - another deepspeed layout
        return False
    return isinstance(wrapper, BF16_Optimizer)


def attach(engine: Any, *, config: ScoutConfig | None = None, state: Mapping[str, Any] | None = None) -> ScoutHandle:
    """Install SCOUT on the engine ``deepspeed.initialize`` returned (every rank calls it). ``config``: SCOUT's
    configuration (default: the engine config's ``"scout"`` section; an engine whose section is absent or
    disabled still gets SCOUT when this is called with a config). ``state``: more objects with ``state_dict`` for
    SCOUT's snapshots (the engine's LR scheduler is kept already)."""
    from scout_deepspeed.section import config_from_deepspeed

    if config is None:
        config = config_from_deepspeed(getattr(engine, "config", None)) or ScoutConfig()
    layout = _unsupported_layout(engine)
    if layout is not None:
        raise ConfigError(f'DeepSpeed config "scout.enabled": SCOUT does not diagnose {layout} under DeepSpeed yet '
                          "(a replayed block's collectives would span ranks it does not pair); set it to false")
    stage = int(engine.zero_optimization_stage())
    model: nn.Module = engine.module
    inner = find_inner_optimizers(engine.optimizer) if engine.optimizer is not None else []
    if not inner:
        raise RuntimeError("scout_deepspeed: the engine has no optimizer (an inference engine?): SCOUT's boundary is "
                           "the optimizer step")
    wrapper = _wrapper_steps(engine, inner)
    unreplayable = _unreplayable(inner[0])
    if unreplayable is not None and config.replay.cadence.optimizer > 0:
        log.warning("scout_deepspeed: the optimizer check is off: optimizer replay cannot reproduce the update of %s "
                    "on a slice (replay, the hang and straggler paths and certification go on)", unreplayable)
        config = copy.deepcopy(config)
        config.replay.cadence.optimizer = 0
    if config.checkpoint.enabled and wrapper is not None:
        raise snapshots_refused(f"{type(wrapper).__name__} (ZeRO stage {stage}, or bf16/fp16)")
    kept = dict(state or {})
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "state_dict"):
        kept.setdefault("lr_scheduler", scheduler)
    observe_backend_collectives()
    groups = gathered_groups(engine.data_parallel_group)
    moe = moe_binding(model)
    adapter = torch_adapter(model, inner, peer_groups=groups, rng_providers=rng_providers(), state=kept or None,
                            moe=moe)
    if moe_layers(model)[0]:
        adapter.marked_layers = adapter.layers  # hangs are placed by the model's blocks, whatever replay samples
        adapter.layers, adapter.layer_names = dense_parts(adapter.layers or [], adapter.layer_names or [],
                                                          bound=moe is not None)
    adapter.name = "deepspeed"
    if unreplayable is not None:  # not back on with `scout ctl set` either
        adapter.pinned["replay.cadence.optimizer"] = f"off: optimizer replay cannot reproduce {unreplayable}"
    # ZeRO (stages 1-3) and BF16_Optimizer (under a pipeline engine) give each data-parallel rank its own partition
    # of the master weights and optimizer state: nothing to compare among peers. Elsewhere (the torch optimizer
    # itself, FP16_Optimizer) the replicas hold the same state and are compared.
    adapter.compare_optimizer_slices = False if stage > 0 or _partitions(wrapper) else None
    if stage == 3:
        adapter.gather_layer, adapter.gather_bytes = gather_zero3, gathered_bytes
    adapter.step_owner = wrapper
    if config.topology.shape or config.topology.order != ScoutConfig().topology.order:
        log.warning('scout_deepspeed: "scout.topology" is ignored: peer groups come from the engine\'s '
                    "data-parallel group")
    handle = enable_with(adapter, config=config)
    if handle.rank == 0:
        log.info("scout_deepspeed: SCOUT attached to a ZeRO stage %d engine (%s -> %s), %d repeated layers, peer "
                 "groups %s%s", stage, type(engine.optimizer).__name__, type(inner[0]).__name__,
                 len(adapter.layers or []), groups, f", {len(moe.layers)} MoE layer(s)" if moe is not None else "")
    return handle
