"""SCOUT core: localize hangs, stragglers and silent data corruption by strict-majority consensus.

``scout_core.enable(model, optimizer, config=...)`` attaches SCOUT to a running job; the
submodules (consensus, signature, topology, config, report) are usable on their own; ``scout_core.testing``
holds the test machinery (launcher, cells, fault injector).
"""

import os as _os
import sys as _sys
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "allow_call_packages", "enable", "enable_with", "FrameworkAdapter", "ScoutHandle",
           "ScoutStop"]

_LAZY = {"enable": "scout_core.runtime", "enable_with": "scout_core.runtime", "ScoutHandle": "scout_core.handle",
         "FrameworkAdapter": "scout_core.adapter", "ScoutStop": "scout_core.actions",
         "allow_call_packages": "scout_core.replay.spec_codec"}


def __getattr__(name: str) -> Any:
    # Lazy: `import scout_core` stays cheap (the CLI and the report reader need no torch).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'scout_core' has no attribute {name!r}")


# A torchrun worker that imported torch before SCOUT: its restart attempts rendezvous apart
# (scout_core/restart_rendezvous.py). Elsewhere `import scout_core` touches nothing, and imports no torch.
if _os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "torch" in _sys.modules:
    from scout_core.restart_rendezvous import separate_restart_attempts as _separate

    try:
        _separate()
    except Exception:  # noqa: BLE001 - an import never fails on account of it (the restart may still fail)
        pass
