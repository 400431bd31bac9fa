"""CPU try-out support: Megatron-Core on a machine without CUDA, for ``scout try megatron`` and this project's
tests; never imported by the plugin's training path or by scout_core.

:func:`on_host` refuses to run where CUDA is there (it patches ``torch.cuda`` for the whole process).

Megatron-Core's model code is device-agnostic in its math but asks CUDA directly in a few places. What this shim
stands in for, each measured on megatron-core 0.19.2 with the CPU build of torch 2.13:

* **Triton.** ``megatron.core.transformer.moe.ops.paged_stash`` imports triton at module level, and the pipeline
  schedules import it; the CPU torch comes without triton (a 690 MB wheel that runs nothing here). The module is
  replaced by one whose kernels raise if launched (paged stashing is a GPU-memory feature, off by default).
* **The current device.** Megatron allocates its DDP buffers and optimizer scalars with
  ``device=torch.cuda.current_device()`` or ``device='cuda'``. :class:`OnHost`, a ``TorchFunctionMode``, turns
  every CUDA device argument of a torch call into the host (and ``Tensor.cuda()`` into a no-op), and
  ``torch.cuda.current_device`` answers the host; ``Tensor.type()`` names the CUDA type (gradient clipping
  asserts it).
* **The CUDA RNG.** Megatron's tensor-parallel RNG tracker forks the CUDA generator; here the host's default
  generator plays it (``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and the tracker's
  private getters and setters).
* **Python 3.11.** megatron-core 0.19 declares Python >= 3.12; ``megatron.training`` needs ``typing.override``
  (:func:`allow_python_311` takes it from ``typing_extensions``).
* **Device count and properties.** Megatron's ``initialize_megatron`` builds its parallel groups only where
  ``torch.cuda.device_count()`` is positive, and argument validation reads the device's architecture: one host
  "device" of architecture 9.0 answers both (``set_device`` is a no-op).
* **Dataset helpers.** ``initialize_megatron`` compiles the C++ helpers of Megatron's indexed datasets on
  rank 0 (``make``, pybind11); the cells feed synthetic batches and never use them, so the build is skipped.
* **Streams and events.** ``torch.cuda.current_stream``, ``Stream``, ``Event`` and ``synchronize`` become no-ops
  (everything on the host is already in order).

:func:`on_host` applies it all in the calling process; the mode is per thread, so call it in each rank after the
fork (the cells do).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import sys
import types
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OnHost", "allow_python_311", "on_host", "quiet_host_notices", "stub_triton_ops"]

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def stub_triton_ops() -> bool:
    """Stand in for Megatron's one triton module that is imported at start-up, unless triton is importable."""
    if _PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    module = types.ModuleType(_PAGED_STASH, "scout_megatron.cpu: Megatron's paged-stash kernels")

    def needs_gpu(*_: Any, **__: Any) -> None:
        raise RuntimeError(f"{_PAGED_STASH} needs triton and a GPU (scout_megatron.cpu stands in)")

    module.GLOBAL_BLOCK_SIZE = 1024
    module.paged_stash_copy_kernel = module.paged_stash_pop_kernel = needs_gpu
    module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH] = module
    return True


def allow_python_311() -> None:
    """megatron-core 0.19 declares Python >= 3.12 and its bundled ``megatron.training`` imports
    ``typing.override`` (new in 3.12); this machine runs 3.11, where ``typing_extensions`` has the same
    decorator."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _host(device: Any) -> Any:
    if device is None or isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class OnHost(TorchFunctionMode):
    """Every CUDA device argument of a torch call means the host."""

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's gradient clipping asserts CUDA tensor types ('torch.cuda.FloatTensor'): the host's
            # tensors stand for device tensors here.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], _host(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def wait_event(self, *_: Any) -> None:
        pass

    def record_event(self, *_: Any) -> _NoEvent:
        return _NoEvent()

    def synchronize(self) -> None:
        pass


class _NoEvent(_NoStream):
    def record(self, *_: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, *_: Any) -> float:
        return 0.0


_APPLIED = False

HOST_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed", "GPTModel IS DEPRECATED",
                "It is recommended to use a ModelConfig", "MimoModelConfig is experimental",
                "Only transformer-engine>=1.7.0 supports MoE experts")
"""Megatron-Core's warnings about this host (no Transformer Engine or Apex: it falls back to torch, which the CPU
cells use on purpose) and about the cells' own model-provider style: dropped by :func:`quiet_host_notices`."""


def quiet_host_notices() -> None:
    """Drop ``HOST_NOTICES`` (several raised while Megatron imports: call this before) and the deprecation notices
    of torch's renamed collectives that Megatron calls."""
    for notice in HOST_NOTICES:  # (?s): some messages start with a newline, which a bare ".*" does not cross
        warnings.filterwarnings("ignore", message=f"(?s).*{re.escape(notice)}")
    # torch 2.13 deprecates the names Megatron calls (expert-parallel token counts, distributed-optimizer buckets);
    # the calls work.
    warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor). is deprecated",
                            category=FutureWarning)


def on_host() -> None:
    """Make this process run Megatron-Core on the host (idempotent for the module patches; enters the device
    mode for the calling thread each time)."""
    global _APPLIED
    if torch.cuda.is_available() and not _APPLIED:
        raise RuntimeError("scout_megatron.cpu.on_host() is CPU try-out support: this machine has CUDA, use it")
    stub_triton_ops()
    OnHost().__enter__()  # left entered for the life of the rank
    if _APPLIED:
        return
    _APPLIED = True
    quiet_host_notices()
    # The host generator plays the CUDA one, so Megatron's check that a tracker fork left the CPU stream alone
    # cannot hold here: its warning says nothing about the job.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    # Megatron's initialize sets up its model-parallel groups only where it counts a device, and reads the
    # device's architecture while validating arguments: one host "device" of a recent architecture.
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *_a, **_k: None
    cuda.get_device_properties = lambda *_a, **_k: types.SimpleNamespace(major=9, minor=0, name="host CPU",
                                                                          total_memory=1 << 34)
    cuda.get_device_capability = lambda *_a, **_k: (9, 0)
    cuda.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    cuda.manual_seed = torch.manual_seed
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.current_stream = cuda.default_stream = lambda *_a, **_k: _NoStream()
    cuda.Stream = _NoStream
    cuda.Event = _NoEvent
    cuda.synchronize = lambda *_a, **_k: None
    cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.tensor_parallel import random as mrandom

    dataset_utils.compile_helpers = lambda: None  # the cells feed synthetic batches, not Megatron's datasets
    # The AllToAll dispatcher copies its split sizes to the host as numpy arrays, but only tensors on a GPU: on
    # the host they would stay tensors, which torch's all_to_all_single refuses as split sizes.
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    mrandom._get_cuda_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
