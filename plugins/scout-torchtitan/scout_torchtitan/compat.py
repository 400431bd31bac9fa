"""Where TorchTitan 0.3 expects a newer torch than the one installed, on every device.

TorchTitan 0.3.0 shortens its process groups' timeouts after the first step with
``torch.distributed.set_timeout``, a public name torch 2.13 does not have yet (it has the same function as
``distributed_c10d._set_pg_timeout``): without it every TorchTitan job stops at the end of step 1, with or
without SCOUT. :func:`ensure_set_timeout` supplies the name when it is missing and nothing else.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

__all__ = ["ensure_set_timeout"]

log = logging.getLogger("scout_torchtitan")


def ensure_set_timeout() -> bool:
    """Give ``torch.distributed`` the ``set_timeout`` TorchTitan 0.3 calls; True if it was missing."""
    if hasattr(dist, "set_timeout"):
        return False
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = _set_pg_timeout
    log.info("scout_torchtitan: torch.distributed.set_timeout (called by TorchTitan 0.3) is torch's "
             "_set_pg_timeout on this torch %s", torch.__version__)
    return True
