"""What makes a replay check's evidence trustworthy before it becomes a verdict (paper sections 6.1 and 10.2).

* :func:`rotation`: which layer a check replays and which peer is its source. The two rotate independently,
  so every (layer, source) pair comes up within ``layers x peers`` checks, even when one count divides the
  other (one shared counter replayed each layer from the same source forever).
* :func:`vet_due`: the checks on which each rank replays the first variant twice (the first rotation over
  the layers, then every ``replay.determinism_every``-th). Replay compares bytes, so it assumes the replayed
  kernels are bitwise deterministic; a rank whose two runs differ cannot be evidence, and once one did,
  every later check is vetted.
* :func:`split_vetting`: takes the exchanged reproducibility out of a check's results and names the ranks
  whose replay was not reproducible; :func:`optimizer_misconfigured` recognises an optimizer self-check that
  fails on a strict majority (the replayed update does not model the live one: a configuration problem,
  not agreement and not SDC on the minority).
"""

from __future__ import annotations

from collections.abc import Sequence

from scout_core.consensus import C3Result

__all__ = ["REPRODUCIBLE_SURFACE", "SELF_CHECK_SURFACE", "optimizer_misconfigured", "rotation", "split_vetting",
           "vet_due"]

REPRODUCIBLE_SURFACE = "replay.reproducible"
SELF_CHECK_SURFACE = "optimizer.self_check"


def rotation(check: int, layers: int, peers: int) -> tuple[int, int]:
    """(layer index, source index) of check number ``check``: the layer advances every check, the source
    every ``layers`` checks, a bijection of ``[0, layers * peers)`` onto every pair."""
    if layers < 1 or peers < 1:
        raise ValueError(f"rotation needs at least one layer and one peer, got {layers} and {peers}")
    return check % layers, (check // layers) % peers


def vet_due(check: int, every: int, always: bool, layers: int = 1) -> bool:
    """Whether hidden check number ``check`` replays its first variant twice (identical on every peer): the
    whole first rotation (each layer's kernels are vetted before its first verdict; nondeterminism is a
    property of a kernel, present from the start), then every ``every``-th check (0: never again)."""
    return always or (every > 0 and (check < layers or check % every == 0))


def split_vetting(results: Sequence[C3Result]) -> tuple[list[C3Result], tuple[int, ...]]:
    """(the results without the reproducibility surface, the ranks whose two runs differed)."""
    kept, nondeterministic = [], ()
    for r in results:
        if r.surface == REPRODUCIBLE_SURFACE:
            nondeterministic = tuple(rank for rank, ok in zip(r.peer_ranks, r.evidence, strict=True) if ok is False)
        else:
            kept.append(r)
    return kept, nondeterministic


def optimizer_misconfigured(results: Sequence[C3Result]) -> C3Result | None:
    """The self-check result when a strict majority of peers failed it, else None."""
    for r in results:
        if r.surface == SELF_CHECK_SURFACE:
            failed = sum(1 for ok in r.evidence if ok is False)
            if 2 * failed > len(r.evidence):
                return r
    return None
