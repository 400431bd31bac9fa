"""What TorchTitan 0.3 needs to run on a machine without CUDA (this project's CI): for tests and the demo
only, never imported on the GPU path.

* Triton: importing TorchTitan's models imports its async expert-parallel kernels
  (``torchtitan.distributed.minimal_async_ep.kernels``), which import ``triton``; the CPU build of torch
  comes without it (a 690 MB wheel that runs nothing on a CPU), and a stand-in for triton itself would make
  torch believe triton is there. :func:`stub_triton_kernels` stands in for that one TorchTitan module
  instead: its kernels exist and raise if launched (they need a GPU's symmetric memory anyway).
* Device type: TorchTitan picks its device type once, at import (``torchtitan.tools.utils``: the available
  accelerator, else ``"cuda"``), and several modules copy it. :func:`use_cpu` points them all at the host.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

__all__ = ["stub_triton_kernels", "use_cpu"]

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
          "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
          "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def _needs_gpu(name: str) -> Any:
    def kernel(*_: Any, **__: Any) -> None:
        raise RuntimeError(f"{KERNELS}.{name} needs triton and a GPU (scout_torchtitan.cpu stands in for it)")
    kernel.__name__ = name
    return kernel


def stub_triton_kernels() -> bool:
    """Stand in for TorchTitan's triton kernel module unless triton is importable; True if it did."""
    if KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    module = types.ModuleType(KERNELS, "scout_torchtitan.cpu: TorchTitan's triton kernels, on a machine without")
    for name in _NAMES:
        setattr(module, name, _needs_gpu(name))
    sys.modules[KERNELS] = module
    return True


_DEVICE_TYPE_HOLDERS = ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                        "torchtitan.distributed.utils", "torchtitan.components.metrics", "torchtitan.tools.profiler",
                        "torchtitan.models.common.token_dispatcher")


def use_cpu() -> None:
    """Make TorchTitan build its meshes and models on the host (gloo): every module that copied the device
    type and module at import sees ``cpu``."""
    import importlib

    import torch

    for name in _DEVICE_TYPE_HOLDERS:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu
