"""SCOUT core: localize hangs, stragglers and silent data corruption by strict-majority consensus.

``scout_core.enable(model, optimizer, config=...)`` attaches SCOUT to a running job; the
submodules (consensus, signature, topology, config, report, inject) are usable on their own.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "enable", "ScoutHandle"]


def __getattr__(name: str) -> Any:
    # Lazy: `import scout_core` stays cheap (the CLI and the report reader need no torch).
    if name in ("enable", "ScoutHandle"):
        from scout_core import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'scout_core' has no attribute {name!r}")
