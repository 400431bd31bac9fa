"""SCOUT for DeepSpeed: a ``"scout"`` section of the DeepSpeed JSON config.

The one-line change in a DeepSpeed training script::

    engine, optimizer, _, _ = scout_deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

:func:`initialize` is ``deepspeed.initialize`` (same arguments, same result); where the config has
``"scout": {"enabled": true, ...}`` it validates the section before DeepSpeed builds anything and attaches SCOUT to
the engine it returns (scripts that keep calling ``deepspeed.initialize`` call :func:`scout_deepspeed.attach` on
their engine instead). Without the section, or with ``"enabled": false``, nothing of SCOUT is
installed.

Importing the package checks that the installed deepspeed is one this plugin is tested with and raises
:class:`UnsupportedVersion`, naming both, if it is not. ``scout plugins`` finds it through the ``scout.plugins``
entry-point group (``plugin``) and shows its framework version and how to turn it on.
"""

from __future__ import annotations

from typing import Any

from scout_core.plugin_support import UnsupportedVersion, VersionGate
from scout_core.restart_rendezvous import separate_restart_attempts

__all__ = ["SUPPORTED", "UnsupportedVersion", "attach", "handle_of", "initialize", "plugin"]

SUPPORTED = (">=0.19", "<0.20")
"""The deepspeed versions this plugin is tested with (``pyproject.toml`` declares the same range)."""

_GATE = VersionGate(plugin="scout-deepspeed", framework="deepspeed", supported=SUPPORTED,
                    missing_hint="see plugins/scout-deepspeed/README.md: pip install --no-build-isolation "
                                 "'deepspeed>=0.19,<0.20' with torch pinned")
check_version = _GATE.check
"""The installed deepspeed version, or :class:`UnsupportedVersion` naming it and the tested range."""

DEEPSPEED_VERSION = check_version()

plugin = _GATE.describe(DEEPSPEED_VERSION, name="deepspeed", how=(
    'add "scout": {"enabled": true, ...} to the DeepSpeed config and call scout_deepspeed.initialize(...) '
    "instead of deepspeed.initialize(...)"), tryout="scout_deepspeed.tryout")
"""What scout_core learns of this plugin through the entry point."""


def __getattr__(name: str) -> Any:
    # deepspeed is imported only when used: scout_core's plugin discovery reads ``plugin`` without paying for it.
    if name in ("initialize", "handle_of", "attach"):
        from scout_deepspeed import entry

        return getattr(entry, name)
    raise AttributeError(f"module 'scout_deepspeed' has no attribute {name!r}")


# A torchrun worker: each restart attempt's process group rendezvous apart (scout_core/restart_rendezvous.py), also
# where the script imports this plugin before torch.
separate_restart_attempts()
