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

from typing import Any

from scout_core.plugin_support import UnsupportedVersion, VersionGate
from scout_core.restart_rendezvous import separate_restart_attempts

__all__ = ["SUPPORTED", "UnsupportedVersion", "attach", "parse_and_validate_args", "plugin", "pretrain",
           "transformer_engine_version"]

SUPPORTED = (">=0.19", "<0.20")
"""The megatron-core versions this plugin is tested with (``pyproject.toml`` declares the same range)."""

_GATE = VersionGate(plugin="scout-megatron", framework="megatron-core", supported=SUPPORTED,
                    missing_hint="pip install --no-deps --ignore-requires-python 'megatron-core>=0.19,<0.20'")
check_version = _GATE.check
"""The installed megatron-core version, or :class:`UnsupportedVersion` naming it and the tested range."""

MEGATRON_CORE_VERSION = check_version()

plugin = _GATE.describe(MEGATRON_CORE_VERSION, name="megatron", how=(
    "from scout_megatron import parse_and_validate_args, pretrain; launch with --scout "
    "[--scout-config PATH] [--scout-<section>-<key> VALUE ...]"), tryout="scout_megatron.tryout")
"""What scout_core learns of this plugin through the entry point."""


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


# A torchrun worker: each restart attempt's process group rendezvous apart (scout_core/restart_rendezvous.py), also
# where the script imports this plugin before torch.
separate_restart_attempts()
