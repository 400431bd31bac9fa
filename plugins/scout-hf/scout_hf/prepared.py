"""Attach SCOUT to what Accelerate prepared: a script's own ``accelerator.prepare`` output, or the Trainer's.

Everything comes from the objects Accelerate returned; scout_core's plain-PyTorch adapter does the rest:

* model: the prepared model (``DistributedDataParallel`` around the user's model, or the model itself under FSDP2,
  which keeps its class); its repeated blocks (GPT-2's ``transformer.h``, Llama's, Mistral's and Qwen's
  ``model.layers``, a BERT-style ``encoder.layer``), the token embedding and the head are found by structure, as
  scout_core finds them in any PyTorch model;
* optimizer: the torch optimizer inside Accelerate's ``AcceleratedOptimizer``. Accelerate calls it only where
  gradients were synchronized (the last micro-batch of an accumulation), so SCOUT's step boundary, its replay and
  its certification follow real optimizer steps under gradient accumulation too;
* peer groups: every rank (data parallelism, FSDP2: the replicas, or the shards replay makes whole);
* DeepSpeed through Accelerate: handed to ``scout-deepspeed``'s adapter with the engine Accelerate built.

Refused, on every rank, with the reason: FSDP1 (``fsdp_version: 1``), and tensor, context or sequence parallelism
through Accelerate's ``ParallelismConfig`` (a replayed block's collectives would span ranks replay does not pair).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from scout_core.adapter import torch_adapter
from scout_core.config import ConfigError, ScoutConfig, resolve
from scout_core.handle import close_at_exit
from scout_core.report import Incident
from scout_core.runtime import ScoutHandle, enable_with

__all__ = ["attach", "attach_prepared"]

log = logging.getLogger("scout_hf")


def attach(accelerator: Any, model: nn.Module, optimizer: Any, *,
           config: ScoutConfig | str | os.PathLike[str] | None = None, overrides: Sequence[str] = (),
           lr_scheduler: Any = None, state: Mapping[str, Any] | None = None,
           on_incident: Callable[[Incident], None] | str | None = None) -> ScoutHandle | None:
    """Install SCOUT on what ``accelerator.prepare`` returned (every rank calls it, once, after ``prepare``).
    ``config``: a :class:`ScoutConfig` or a YAML file (None: the shipped defaults), ``overrides`` dotted
    ``key=value`` on top; ``lr_scheduler`` and ``state`` (objects with ``state_dict``) are kept in SCOUT's
    snapshots where ``checkpoint.enabled``. None, with a warning, in a job of one process (nothing to compare)."""
    return attach_prepared(str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
                           model, optimizer, config=resolve(config, overrides), lr_scheduler=lr_scheduler,
                           state=state, on_incident=on_incident,
                           parallelism=getattr(accelerator, "parallelism_config", None))


def attach_prepared(distributed_type: str, model: nn.Module, optimizer: Any, *, config: ScoutConfig,
                    lr_scheduler: Any = None, state: Mapping[str, Any] | None = None,
                    on_incident: Callable[[Incident], None] | str | None = None,
                    parallelism: Any = None) -> ScoutHandle | None:
    """:func:`attach` once the configuration is read (the Trainer's callback calls this with the Trainer's
    accelerator's distributed type, its wrapped model and its optimizer)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        log.warning("scout_hf: SCOUT is not attached: this job runs one process (launch it with torchrun on two "
                    "or more ranks: SCOUT compares peers)")
        return None
    if ScoutHandle.is_open():
        log.warning("scout_hf: SCOUT already diagnoses another model in this process; this one is not attached")
        return None
    refused = _unsupported(distributed_type, model, parallelism)
    if refused is not None:
        raise ConfigError(f"scout_hf: SCOUT does not diagnose {refused} yet (a replayed block's collectives would "
                          "span ranks replay does not pair, or its state is laid out otherwise); remove the "
                          "callback or the attach call for this job")
    _warn_kv_cache(model)
    if distributed_type == "DEEPSPEED":
        try:
            from scout_deepspeed.adapter import attach as attach_deepspeed
        except ImportError as exc:
            raise ConfigError("scout_hf: this job trains with DeepSpeed, which SCOUT diagnoses through "
                              f"scout-deepspeed (plugins/scout-deepspeed/README.md); it cannot be imported here: "
                              f"{exc}") from exc
        if on_incident is not None or state:
            log.warning("scout_hf: on_incident and state are not handed to scout-deepspeed's adapter (its DeepSpeed "
                        "engine keeps the state); give them through its own attach to use them")
        handle = attach_deepspeed(model, config=config)
    else:
        kept = dict(state or {})
        if lr_scheduler is not None and hasattr(lr_scheduler, "state_dict"):
            kept.setdefault("lr_scheduler", lr_scheduler)
        adapter = torch_adapter(model, optimizer, state=kept or None)
        adapter.name = "hf"
        handle = enable_with(adapter, config=config, on_incident=on_incident)
    close_at_exit(handle)
    if handle.rank == 0:
        log.info("scout_hf: SCOUT attached (%s, %s, %d repeated layers)", distributed_type, type(model).__name__,
                 len(handle.parts.adapter.layers or []))
    return handle


def _warn_kv_cache(model: nn.Module) -> None:
    """transformers hands every block a KV cache object when the model's config has ``use_cache`` on (GPT-2's
    default, outside the Trainer, which turns it off): replay cannot ship such an object to the peers (it would also
    grow it), so every check would be skipped with a ``diagnosis_error`` record. Said once, at attach."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if getattr(config, "use_cache", False) and dist.get_rank() == 0:
        log.warning("scout_hf: %s.config.use_cache is on: transformers passes a KV cache object to every block, "
                    "which replay cannot ship to the peers, so every replay check will be skipped (recorded as "
                    "diagnosis_error). Set model.config.use_cache = False for training (the Trainer does)",
                    type(inner).__name__)


def _unsupported(distributed_type: str, model: nn.Module, parallelism: Any) -> str | None:
    """A layout SCOUT cannot diagnose through Accelerate (None: data parallelism, FSDP2, DeepSpeed)."""
    if distributed_type == "FSDP":
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return "FSDP1 (use fsdp_version 2: FSDP2)"
    if distributed_type not in ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_HPU", "MULTI_MLU",
                                "MULTI_SDAA", "MULTI_MUSA", "FSDP", "DEEPSPEED"):
        return f"Accelerate's distributed type {distributed_type}"
    for name in ("tp_size", "cp_size", "sp_size"):
        if int(getattr(parallelism, name, 1) or 1) > 1:
            return f"Accelerate's ParallelismConfig with {name}={getattr(parallelism, name)}"
    if int(getattr(parallelism, "dp_replicate_size", 1) or 1) > 1 and int(getattr(parallelism, "dp_shard_size", 1)
                                                                          or 1) > 1:
        return "HSDP through Accelerate's ParallelismConfig (dp_replicate_size and dp_shard_size both above 1)"
    return None
