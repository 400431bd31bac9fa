"""What makes a replay check's evidence trustworthy before it becomes a verdict (paper sections 6.1 and 10.2).

* :func:`rotation`: which layer a check replays and which peer is its source. The two rotate independently,
  so every (layer, source) pair comes up within ``layers x peers`` checks, even when one count divides the
  other (one shared counter replayed each layer from the same source forever).
* :func:`vet_due`: the checks on which each rank replays the first variant twice (the first rotation over
  the layers, then every ``replay.determinism_every``-th). Replay compares bytes, so it assumes the replayed
  kernels are bitwise deterministic; a rank whose two runs differ cannot be evidence, and once one did,
  every later check is vetted.
* :func:`environment_fingerprint`: what decides a replay's bits besides its inputs (torch, CUDA and cuDNN
  versions, the device, the precision flags, the host's instruction set). Two ranks that
  are each reproducible but run different kernels (a rolling upgrade, another GPU model, a per-rank TF32
  flag) disagree without either being faulty; every check exchanges the fingerprint, and a rank whose
  fingerprint differs from its peers' majority is not evidence either.
* :func:`split_vetting`: takes the exchanged reproducibility and environment out of a check's results and
  names the ranks whose replay was not reproducible or ran in another environment;
* :func:`optimizer_misconfigured` recognises an optimizer self-check that fails on a strict majority (the
  replayed update does not model the live one: a configuration problem, not agreement and not SDC on the
  minority that passed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from scout_core.consensus import C3Result, C3Status

__all__ = ["ENVIRONMENT_SURFACE", "REPRODUCIBLE_SURFACE", "SELF_CHECK_SURFACE", "SOURCE_SURFACE",
           "environment_fingerprint", "optimizer_misconfigured", "rotation", "set_aside", "split_vetting", "vet_due"]

REPRODUCIBLE_SURFACE = "replay.reproducible"
ENVIRONMENT_SURFACE = "replay.environment"
SELF_CHECK_SURFACE = "optimizer.self_check"
SOURCE_SURFACE = "optimizer.source_replayed"
"""Every peer's replay of the check source's optimizer slice (``scout_core.replay.optimizer_source``)."""


def rotation(check: int, layers: int, peers: int) -> tuple[int, int]:
    """(layer index, source index) of check number ``check``: the layer advances every check, the source
    every ``layers`` checks, a bijection of ``[0, layers * peers)`` onto every pair."""
    if layers < 1 or peers < 1:
        raise ValueError(f"rotation needs at least one layer and one peer, got {layers} and {peers}")
    return check % layers, (check // layers) % peers


def vet_due(check: int, every: int, always: bool, layers: int = 1) -> bool:
    """Whether check number ``check`` replays its first variant twice (identical on every peer): whole
    rotations over the layers, the first one and every ``every``-th after it (0: never), so every layer's
    kernels are vetted before its first verdict and again at the same rate (nondeterminism is a property
    of a kernel)."""
    return always or (every > 0 and (check // max(1, layers)) % every == 0)


def environment_fingerprint(device: torch.device) -> str:
    """The software and hardware facts that decide a replay's bits on ``device``, as one string."""
    parts = [f"torch={torch.__version__}"]  # (host replays run on one thread: the thread count cannot matter)
    cpu = getattr(torch.backends.cpu, "get_cpu_capability", None)
    if cpu is not None:
        parts.append(f"cpu={cpu()}")
    parts.append(f"fp32_matmul={torch.get_float32_matmul_precision()}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts += [f"cuda={torch.version.cuda}", f"cudnn={torch.backends.cudnn.version()}",
                  f"device={props.name}/sm{props.major}{props.minor}/{props.multi_processor_count}",
                  f"tf32={torch.backends.cuda.matmul.allow_tf32}/{torch.backends.cudnn.allow_tf32}",
                  f"reduced={torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}/"
                  f"{torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}",
                  f"cublas_ws={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '')}"]
    return ";".join(parts)


def split_vetting(results: Sequence[C3Result]) -> tuple[list[C3Result], dict[int, str]]:
    """(the results without the vetting surfaces, the ranks that are not evidence with the reason:
    ``nondeterministic`` (its two runs differed) or ``environment`` (not its peers' majority fingerprint;
    every rank when there is no strict majority))."""
    kept, untrusted = [], {}
    for r in results:
        if r.surface == REPRODUCIBLE_SURFACE:
            untrusted.update({rank: "nondeterministic"
                              for rank, ok in zip(r.peer_ranks, r.evidence, strict=True) if ok is False})
        elif r.surface == ENVIRONMENT_SURFACE:
            odd = r.outlier_ranks if r.status is C3Status.ATTRIBUTED else (
                r.peer_ranks if r.status is C3Status.INCONCLUSIVE else ())
            untrusted.update({rank: "environment" for rank in odd if rank not in untrusted})
        else:
            kept.append(r)
    return kept, untrusted


def set_aside(results: Sequence[C3Result], untrusted: Mapping[int, str]) -> tuple[list[C3Result], list[C3Result]]:
    """(kept, set aside): every disagreement a rank that is not evidence (``untrusted``, found now or at any
    earlier check: intermittent nondeterminism may happen to agree with itself today) takes part in is set
    aside, never SDC; so is a disagreement without a strict majority while any rank is untrusted."""
    if not untrusted:
        return list(results), []
    bad = set(untrusted)
    unreliable = [r for r in results if r.status is C3Status.INCONCLUSIVE
                  or (r.status is C3Status.ATTRIBUTED and bad & set(r.outlier_ranks))]
    return [r for r in results if r not in unreliable], unreliable


def optimizer_misconfigured(results: Sequence[C3Result]) -> C3Result | None:
    """The self-check result when a strict majority of peers failed it, else None."""
    for r in results:
        if r.surface == SELF_CHECK_SURFACE:
            failed = sum(1 for ok in r.evidence if ok is False)
            if 2 * failed > len(r.evidence):
                return r
    return None
