"""CPU try-out support: what TorchTitan 0.3 needs to run on a machine without CUDA, for ``scout try torchtitan``
(which hides CUDA from its job) and this project's tests; never imported on the GPU path.

* Triton: importing TorchTitan's models imports its async expert-parallel kernels
  (``torchtitan.distributed.minimal_async_ep.kernels``), which import ``triton``; the CPU build of torch
  comes without it (a 690 MB wheel that runs nothing on a CPU), and a stand-in for triton itself would make
  torch believe triton is there. :func:`stub_triton_kernels` stands in for that one TorchTitan module
  instead: its kernels exist and raise if launched (they need a GPU's symmetric memory anyway).
* Device type: TorchTitan picks its device type once, at import (``torchtitan.tools.utils``: the available
  accelerator, else ``"cuda"``), and several modules copy it. :func:`use_cpu` points them all at the host,
  with a device module that answers TorchTitan's memory and naming questions for the host.
* Grouped GEMM: TorchTitan's ``GroupedExperts`` runs every expert through ``torch._grouped_mm`` in bfloat16.
  On a CPU without bfloat16 instructions torch's fallback computes each group with a scalar bfloat16 dot
  product (measured: 73 % of an MoE cell's time). :func:`use_cpu` puts a host version in its place that
  computes each group's rows in float32 with the BLAS and rounds to the output dtype, as the fallback does (it
  accumulates in float32 too); anything but the 2-D x 3-D grouped form TorchTitan uses goes to torch's op.
* The job: :func:`on_cpu` turns a registered ``Trainer.Config`` into one that trains here: SDPA attention
  (FlexAttention has no CPU backward), SUM gradient reductions (gloo has no PREMUL_SUM), the
  ``partial_dtensor`` SPMD backend, :class:`SyntheticTokenizer` and :class:`SyntheticDataLoader` (the wheel
  ships no tokenizer or dataset), no validator, a short sequence.

Measured here: the debug model (6 layers, dim 256) on 4 gloo ranks, FSDP, 64 tokens x 2 per rank, trains
8 steps in about 10 s after a 2 s build.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

__all__ = ["SyntheticDataLoader", "SyntheticTokenizer", "on_cpu", "stub_triton_kernels", "use_cpu"]

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


def _host_device_module() -> Any:
    """``torch.cpu`` with the memory and naming calls TorchTitan's metrics make of a device module (the host
    keeps no allocator statistics: they read as absent, -1, as TorchTitan reads a missing one)."""
    module = types.SimpleNamespace(**{n: getattr(torch.cpu, n) for n in dir(torch.cpu) if not n.startswith("__")})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.get_device_name = lambda *_: "host CPU"
    module.get_device_properties = lambda *_: types.SimpleNamespace(total_memory=total, name="host CPU")
    module.memory_stats = lambda *_: {}
    module.reset_peak_memory_stats = lambda *_: None
    module.empty_cache = lambda: None
    module.current_device = lambda: 0  # an index, as TorchTitan passes it to barrier(device_ids=...)
    return module


def use_cpu() -> None:
    """Make TorchTitan build its meshes and models on the host (gloo): every module that copied the device
    type and module at import sees ``cpu``."""
    stub_triton_kernels()
    # TorchTitan's MoE router asks for a float32 autocast region, which the host's autocast does not support
    # (it warns once per process and runs in float32 anyway, which is what the router wants).
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported",
                            category=UserWarning)
    _quiet_host_notices()
    _use_host_grouped_mm()
    host = _host_device_module()
    for name in _DEVICE_TYPE_HOLDERS:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = host


HOST_NOTICES = (
    "Peak flops undefined for",  # no GPU model to look up: the MFU it logs is meaningless here anyway
    "Error running lspci",  # the GPU probe, on a host without PCI tools
    "initial_load_model_only=True has no effect without an initial_load_path",
    "model.safetensors.index.json not found at hf_assets_path",  # the synthetic tokenizer has no HF assets
    "torch.distributed is already initialized",  # the cells join gloo before TorchTitan's trainer does
)
"""TorchTitan's log lines about this host or the test jobs, not the training: :func:`use_cpu` drops them."""


class _DropHostNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(notice in message for notice in HOST_NOTICES)


def _quiet_host_notices() -> None:
    """TorchTitan's warnings about running on a CPU mesh (DTensor's RNG, torchdata's deprecated vital signs) and
    its log lines in ``HOST_NOTICES`` say nothing about a test job's training: each printed once per rank, they
    buried a cell's own output."""
    for message in ("DTensor random operators may not have complete support on cpu device mesh",
                    r"DTensor manual_seed\(\) may not have complete support on cpu device mesh",
                    "'set_vital' is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    from torchtitan.tools.logging import logger

    if not any(isinstance(f, _DropHostNotices) for f in logger.filters):
        logger.addFilter(_DropHostNotices())


def _use_host_grouped_mm() -> None:
    real = torch._grouped_mm
    if getattr(real, "scout_host_version", False):
        return

    def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if mat_a.device.type != "cpu" or mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None or bias is not None:
            return real(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        dtype = out_dtype or mat_a.dtype
        parts, start = [], 0
        for group, end in enumerate(offs.tolist()):
            parts.append((mat_a[start:end].float() @ mat_b[group].float()).to(dtype))
            start = end
        if start < mat_a.shape[0]:  # rows past the last offset belong to no group: torch leaves them unset; zeros
            parts.append(mat_a.new_zeros(mat_a.shape[0] - start, mat_b.shape[-1], dtype=dtype))
        return torch.cat(parts)

    grouped_mm.scout_host_version = True  # type: ignore[attr-defined]
    torch._grouped_mm = grouped_mm


# -- A TorchTitan job on the host: tokenizer and data without downloaded assets, gloo-friendly reductions -----


class SyntheticTokenizer(BaseTokenizer):
    """Token ids are the bytes of the text (the wheel ships no tokenizer files); the vocabulary is the
    model's, so any id the data loader draws is valid."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048
        """Size of the vocabulary (the model's ``vocab_size``)."""

    def __init__(self, config: Config, *, tokenizer_path: str = "") -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, text: str, *_: Any, **__: Any) -> list[int]:
        return [b % self.vocab_size for b in text.encode()]

    def decode(self, ids: Any, *_: Any, **__: Any) -> str:
        return bytes(int(i) % 256 for i in ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _Tokens(IterableDataset):
    """Endless random token sequences, the same for a data-parallel rank on every run (seeded by its rank),
    different between ranks; the sample index is the state a restore resumes from."""

    def __init__(self, *, vocab: int, seq_len: int, dp_rank: int, seed: int) -> None:
        self.vocab, self.seq_len, self.dp_rank, self.seed = vocab, seq_len, dp_rank, seed
        self.sample = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.dp_rank * 10_007 + self.sample)
            tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
            self.sample += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, int]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample = int(state["sample"])


class SyntheticDataLoader(ParallelAwareDataloader):
    """TorchTitan's parallel-aware stateful data loader over :class:`_Tokens`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        vocab_size: int = 2048
        """Token ids are drawn below this (the model's ``vocab_size``)."""

        seed: int = 0
        """Seed of the token stream (with the data-parallel rank and the sample index)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **_: Any) -> None:
        tokens = _Tokens(vocab=config.vocab_size, seq_len=seq_len, dp_rank=dp_rank, seed=config.seed)
        super().__init__(tokens, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def _sum_reductions(parallelize_fn: Any) -> Any:
    """``parallelize_fn`` whose FSDP2 modules reduce gradients with SUM (gloo has no PREMUL_SUM; TorchTitan
    turns FSDP's own division off and scales by the global token count itself, so the sum is what it wants)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def on_cpu(config: Any, *, steps: int = 10, seq_len: int = 64, local_batch_size: int = 2, seed: int = 0) -> Any:
    """``config`` (a TorchTitan ``Trainer.Config``) made runnable on this host: attention through SDPA
    (FlexAttention has no CPU backward), SUM gradient reductions, synthetic tokenizer and data (the wheel ships
    no assets), no validation, no CUDA graphs, float32 compute, a short sequence and run. Call :func:`use_cpu` first."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    spec = config.model_spec
    model = spec.model
    for _fqn, _cfg, parent, attr in list(model.traverse((FlexAttention.Config, VarlenAttention.Config))):
        if parent is not None:
            if isinstance(parent, list):
                parent[attr] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, attr, ScaledDotProductAttention.Config())
    config.model_spec = dataclasses.replace(spec, parallelize_fn=_sum_reductions(spec.parallelize_fn))
    vocab = int(getattr(model, "vocab_size", 2048))
    config.tokenizer = SyntheticTokenizer.Config(vocab_size=vocab)
    config.dataloader = SyntheticDataLoader.Config(vocab_size=vocab, seed=seed)
    # TorchTitan's default SPMD backend (spmd_types) asks FSDP for DTensor parameters on the full mesh, which
    # its host path does not produce; the DTensor-for-model-parallel-axes backend runs here.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.training.disable_cuda_graphs = True
    # FSDP's bfloat16 parameters would run every matmul through torch's scalar bfloat16 GEMM on a CPU without
    # bfloat16 units (an AVX2 host: 10x slower than float32, and how much slower depends on the host's CPU);
    # the job computes in float32 here. TorchTitan's grouped experts still cast to bfloat16 themselves.
    config.training.mixed_precision_param = "float32"
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.metrics.enable_tensorboard = False
    return config
