"""Each restart attempt of a ``torchrun --max-restarts`` job meets in a store namespace of its own.

Under torchelastic the workers' ``env://`` rendezvous reuses the agent's store (``TORCHELASTIC_USE_AGENT_STORE``)
without a per-attempt prefix (torch 2.13's ``_create_c10d_store`` assumes a new store per attempt, which the c10d
rendezvous backend does not make). A restarted attempt then reads the previous attempt's keys: gloo connects to
the dead ranks' addresses ("Gloo connectFullMesh failed ... Connection refused"), with or without SCOUT, so a stop
on a verdict could never be followed by the restart it exists for. Wrapping torch's ``env://`` handler so that the
store it hands to ``init_process_group`` is prefixed with the attempt number keeps attempts apart; every worker of
one attempt uses the same prefix.

Applied when ``scout_core`` is imported in a torchelastic worker that has imported torch already (a training
script imports torch first; nothing else in the import of ``scout_core`` touches torch), and when a plugin is
imported. Nothing changes outside torchelastic, or where the process group already exists (``enable()`` comes
too late for it).

One machine only (``GROUP_WORLD_SIZE`` 1, e.g. ``--standalone``): the attempt number is each agent's own count of
restarts, and agents of several machines can count differently (an agent whose workers were healthy restarts them
without counting a failure) or keep the count across a membership change; with several machines the handler is left
as torch has it, and the restart problem with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

__all__ = ["ATTEMPT_PREFIX", "separate_restart_attempts"]

ATTEMPT_PREFIX = "scout-attempt-"


def separate_restart_attempts() -> bool:
    """Wrap torch's ``env://`` rendezvous handler once (idempotent); whether it is wrapped now."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("GROUP_WORLD_SIZE") != "1":
        return False
    import importlib

    import torch.distributed as dist

    if not dist.is_available():
        return False

    # By name: ``torch.distributed.rendezvous`` as an attribute is the function of that name, not the module.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    inner = handlers.get("env") if isinstance(handlers, dict) else None
    if inner is None:
        return False  # a torch without the registry this was written against: left as it is
    if getattr(inner, "scout_per_attempt", False):
        return True

    def env_per_attempt(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        attempts = inner(url, **kwargs)
        store, rank, world_size = next(attempts)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        yield dist.PrefixStore(f"{ATTEMPT_PREFIX}{attempt}", store), rank, world_size
        yield from attempts  # torch's handler raises here: env:// cannot re-rendezvous

    env_per_attempt.scout_per_attempt = True  # type: ignore[attr-defined]
    handlers["env"] = env_per_attempt
    return True
