"""SCOUT for TorchTitan: ``--module scout_torchtitan --config <any registered config> --scout.enable``.

Importing the package checks that the installed TorchTitan is one this plugin is tested with and raises
:class:`UnsupportedVersion`, naming both, if it is not. ``scout plugins`` finds it through the
``scout.plugins`` entry-point group (``plugin``); it imports torchtitan and scout_core only.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["SUPPORTED", "UnsupportedVersion", "plugin"]

SUPPORTED = (">=0.3", "<0.4")
"""The torchtitan versions this plugin is tested with (``pyproject.toml`` declares the same range)."""


class UnsupportedVersion(ImportError):
    """The installed torchtitan is outside :data:`SUPPORTED`."""


def _check_version() -> str:
    try:
        installed = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        raise UnsupportedVersion("scout-torchtitan needs torchtitan >=0.3,<0.4, and none is installed") from None
    major_minor = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if not (0, 3) <= major_minor < (0, 4):
        raise UnsupportedVersion(f"scout-torchtitan supports torchtitan >=0.3,<0.4; torchtitan {installed} is "
                                 "installed (pip install 'torchtitan>=0.3,<0.4', or a scout-torchtitan for it)")
    return installed


TORCHTITAN_VERSION = _check_version()


class _Plugin:
    """What scout_core learns of this plugin through the entry point."""

    name = "torchtitan"
    framework = "torchtitan"
    framework_version = TORCHTITAN_VERSION
    supported = ",".join(SUPPORTED)
    how = "--module scout_torchtitan --config <config> --scout.enable [--scout.<section>.<key> VALUE ...]"


plugin = _Plugin()
