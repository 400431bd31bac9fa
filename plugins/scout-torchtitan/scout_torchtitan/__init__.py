"""SCOUT for TorchTitan: ``--module scout_torchtitan --config <any registered config> --scout.enable``.

Importing the package checks that the installed TorchTitan is one this plugin is tested with and raises
:class:`UnsupportedVersion`, naming both, if it is not. ``scout plugins`` finds it through the
``scout.plugins`` entry-point group (``plugin``); it imports torchtitan and scout_core only.
"""

from __future__ import annotations

from scout_core.plugin_support import UnsupportedVersion, VersionGate
from scout_core.restart_rendezvous import separate_restart_attempts

__all__ = ["SUPPORTED", "UnsupportedVersion", "plugin"]

SUPPORTED = (">=0.3", "<0.4")
"""The torchtitan versions this plugin is tested with (``pyproject.toml`` declares the same range)."""

_GATE = VersionGate(plugin="scout-torchtitan", framework="torchtitan", supported=SUPPORTED,
                    outside_hint="pip install 'torchtitan>=0.3,<0.4', or a scout-torchtitan for it")

TORCHTITAN_VERSION = _GATE.check()

plugin = _GATE.describe(TORCHTITAN_VERSION, name="torchtitan", how=(
    "--module scout_torchtitan --config <config> --scout.enable [--scout.<section>.<key> VALUE ...]"),
    tryout="scout_torchtitan.tryout")
"""What scout_core learns of this plugin through the entry point."""


# A torchrun worker: each restart attempt's process group rendezvous apart (scout_core/restart_rendezvous.py), also
# where the script imports this plugin before torch.
separate_restart_attempts()
