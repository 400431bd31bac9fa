"""CPU try-out support: Accelerate's FSDP path on CPU ranks (gloo), for ``scout try hf -- --fsdp`` and the cells.

Not for training jobs. Accelerate turns FSDP on only for accelerator devices (``AcceleratorState`` leaves a
multi-process CPU job at ``MULTI_CPU`` and drops the FSDP plugin it was given), while torch's FSDP2
(``fully_shard``) runs on CPU over gloo. :func:`fsdp_on_cpu` makes ``AcceleratorState`` keep the plugin for such a
job, so the Trainer's and Accelerate's own FSDP2 code paths (``fsdp2_prepare_model``, the sharded optimizer, their
saves) run here as they run on GPUs.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["fsdp_on_cpu"]


def fsdp_on_cpu() -> None:
    """Make a multi-process CPU ``AcceleratorState`` given an FSDP plugin (``Accelerator(fsdp_plugin=...)``, the
    Trainer's ``fsdp_config``) take Accelerate's FSDP path. Idempotent; a job on accelerator devices is left as
    Accelerate makes it (only a state Accelerate left at ``MULTI_CPU`` changes)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "_scout_cpu", False):
        return

    @functools.wraps(init)
    def keep_fsdp(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    keep_fsdp._scout_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = keep_fsdp  # type: ignore[method-assign]
