"""SCOUT core: localize hangs, stragglers and silent data corruption by strict-majority consensus.

``scout_core.enable(model, optimizer, config=...)`` attaches SCOUT to a running job; the
submodules (consensus, signature, topology, config, report) are usable on their own; ``scout_core.testing``
holds the test machinery (launcher, cells, fault injector).
"""

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
