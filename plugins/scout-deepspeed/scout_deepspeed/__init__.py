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

from importlib import metadata
from typing import Any

__all__ = ["SUPPORTED", "UnsupportedVersion", "attach", "handle_of", "initialize", "plugin"]

SUPPORTED = (">=0.19", "<0.20")
"""The deepspeed versions this plugin is tested with (``pyproject.toml`` declares the same range)."""


class UnsupportedVersion(ImportError):
    """The installed deepspeed is outside :data:`SUPPORTED`."""


def check_version(installed: str | None = None) -> str:
    """The installed deepspeed version, or :class:`UnsupportedVersion` naming it and the tested range."""
    if installed is None:
        try:
            installed = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            raise UnsupportedVersion("scout-deepspeed needs deepspeed >=0.19,<0.20, and none is installed (see "
                                     "plugins/scout-deepspeed/README.md: pip install --no-build-isolation "
                                     "'deepspeed>=0.19,<0.20' with torch pinned)") from None
    major_minor = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if not (0, 19) <= major_minor < (0, 20):
        raise UnsupportedVersion(f"scout-deepspeed supports deepspeed >=0.19,<0.20; deepspeed {installed} is "
                                 "installed (install a deepspeed in that range, or a scout-deepspeed for yours)")
    return installed


DEEPSPEED_VERSION = check_version()


class _Plugin:
    """What scout_core learns of this plugin through the entry point."""

    name = "deepspeed"
    framework = "deepspeed"
    framework_version = DEEPSPEED_VERSION
    supported = ",".join(SUPPORTED)
    how = ('add "scout": {"enabled": true, ...} to the DeepSpeed config and call scout_deepspeed.initialize(...) '
           "instead of deepspeed.initialize(...)")


plugin = _Plugin()


def __getattr__(name: str) -> Any:
    # deepspeed is imported only when used: scout_core's plugin discovery reads ``plugin`` without paying for it.
    if name in ("initialize", "handle_of", "attach"):
        from scout_deepspeed import entry

        return getattr(entry, name)
    raise AttributeError(f"module 'scout_deepspeed' has no attribute {name!r}")
