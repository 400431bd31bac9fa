"""SCOUT for Megatron-Core: ``--scout`` (and ``--scout-<section>-<key>`` flags) on a ``pretrain_*.py`` launch.

The one-line change in a Megatron training script::

    from scout_megatron import parse_and_validate_args, pretrain   # instead of megatron.training's

``parse_and_validate_args`` adds SCOUT's flags to Megatron's parser through its own ``extra_args_provider``
(composed with the script's), and ``pretrain`` attaches SCOUT once Megatron has built the model chunks and the
optimizer. Without ``--scout`` nothing of SCOUT is installed. Scripts that build their own loop from
megatron.core call :func:`scout_megatron.attach.attach` after their model and optimizer exist.

Importing the package checks that the installed megatron-core is one this plugin is tested with and raises
:class:`UnsupportedVersion`, naming both, if it is not. ``scout plugins`` finds it through the ``scout.plugins``
entry-point group (``plugin``) and shows its framework version and how to turn it on.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

__all__ = ["SUPPORTED", "UnsupportedVersion", "attach", "parse_and_validate_args", "plugin", "pretrain",
           "transformer_engine_version"]

SUPPORTED = (">=0.19", "<0.20")
"""The megatron-core versions this plugin is tested with (``pyproject.toml`` declares the same range)."""


class UnsupportedVersion(ImportError):
    """The installed megatron-core is outside :data:`SUPPORTED`."""


def check_version(installed: str | None = None) -> str:
    """The installed megatron-core version, or :class:`UnsupportedVersion` naming it and the tested range."""
    if installed is None:
        try:
            installed = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            raise UnsupportedVersion("scout-megatron needs megatron-core >=0.19,<0.20, and none is installed "
                                     "(pip install --no-deps --ignore-requires-python 'megatron-core>=0.19,<0.20')"
                                     ) from None
    major_minor = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if not (0, 19) <= major_minor < (0, 20):
        raise UnsupportedVersion(f"scout-megatron supports megatron-core >=0.19,<0.20; megatron-core {installed} "
                                 "is installed (install a megatron-core in that range, or a scout-megatron for "
                                 "yours)")
    return installed


MEGATRON_CORE_VERSION = check_version()


class _Plugin:
    """What scout_core learns of this plugin through the entry point."""

    name = "megatron"
    framework = "megatron-core"
    framework_version = MEGATRON_CORE_VERSION
    supported = ",".join(SUPPORTED)
    how = ("from scout_megatron import parse_and_validate_args, pretrain; launch with --scout "
           "[--scout-config PATH] [--scout-<section>-<key> VALUE ...]")


plugin = _Plugin()


def transformer_engine_version() -> str | None:
    """Transformer Engine's version where it imports, else None. Only called once Megatron runs (TE's import
    initializes CUDA); without CUDA it raises RuntimeError, not ImportError, so any failure means "not here"."""
    try:
        import transformer_engine
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError where CUDA is missing
        return None
    return str(getattr(transformer_engine, "__version__", "unknown"))


def __getattr__(name: str) -> Any:
    # The entry points import megatron.core (and megatron.training) only when used: scout_core's plugin
    # discovery reads ``plugin`` without paying for Megatron's imports.
    if name == "attach":
        from scout_megatron.attach import attach

        return attach
    if name in ("parse_and_validate_args", "pretrain"):
        from scout_megatron import entry

        return getattr(entry, name)
    raise AttributeError(f"module 'scout_megatron' has no attribute {name!r}")
