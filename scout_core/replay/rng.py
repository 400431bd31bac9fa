"""RNG alignment for replay (paper section 6.1.1, "Deterministic execution").

Replay installs the SOURCE peer's CPU, device and framework RNG states so that
every peer draws the same dropout masks, runs under deterministic algorithms,
and afterwards restores its own states: diagnosis never advances or perturbs
the training RNG streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["RngProvider", "capture_rng", "install_rng", "replay_rng_scope", "seeded_rng_scope"]

RngProvider = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]
"""(get, set) of an extra RNG a plugin registers, e.g. Megatron's tensor-parallel tracker."""


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_rng(providers: Mapping[str, RngProvider] | None = None) -> dict[str, torch.Tensor]:
    """Every RNG state this process uses, as byte tensors (cheap to broadcast and sign)."""
    states = {"cpu": torch.get_rng_state()}
    if _cuda_ready():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, (get, _) in (providers or {}).items():
        states[f"ext.{name}"] = get()
    return states


def install_rng(states: Mapping[str, torch.Tensor], providers: Mapping[str, RngProvider] | None = None) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and _cuda_ready():
        torch.cuda.set_rng_state(states["cuda"])
    for name, (_, setter) in (providers or {}).items():
        if f"ext.{name}" in states:
            setter(states[f"ext.{name}"])


@contextlib.contextmanager
def replay_rng_scope(
    states: Mapping[str, torch.Tensor],
    providers: Mapping[str, RngProvider] | None = None,
    *,
    deterministic: bool = True,
) -> Iterator[None]:
    """Run the body with the source's RNG states and deterministic kernels; restore everything."""
    saved = capture_rng(providers)
    det_was = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn_det, cudnn_bench = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    install_rng(states, providers)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        install_rng(saved, providers)
        torch.use_deterministic_algorithms(det_was, warn_only=det_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench


@contextlib.contextmanager
def seeded_rng_scope(seed: int, providers: Mapping[str, RngProvider] | None = None, *,
                     deterministic: bool = True, device: torch.device | None = None) -> Iterator[None]:
    """Run the body with torch's CPU RNG and ``device``'s (a CUDA device: made current for the body) seeded by
    ``seed`` (the same on every peer, no transfer) and deterministic kernels; every state, the providers'
    included, is put back afterwards. The providers' own RNGs are not seeded: a body drawing from them is not
    aligned across peers."""
    on_cuda = device is not None and device.type == "cuda"
    with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
        with replay_rng_scope(capture_rng(providers), providers, deterministic=deterministic):
            torch.set_rng_state(torch.Generator().manual_seed(seed).get_state())
            if _cuda_ready():
                torch.cuda.manual_seed(seed)
            yield


def rng_fingerprint(states: Mapping[str, Any]) -> tuple[Any, ...]:
    """Comparable evidence that two peers start from the same RNG state."""
    from scout_core.signature import sign_many

    names = sorted(states)
    return tuple(zip(names, (s.signature for s in sign_many([states[n] for n in names])), strict=True))
