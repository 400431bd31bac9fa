"""SCOUT for PyTorch Lightning: one callback.

The one-line change::

    trainer = lightning.Trainer(..., callbacks=[scout_lightning.ScoutCallback("scout.yaml")])

:class:`ScoutCallback` attaches SCOUT at train start to what Lightning built (the LightningModule's model, its torch
optimizers), labels the checkpoints Lightning's ``ModelCheckpoint`` writes by SCOUT's certification, and at the
trainer's setup makes ``ckpt_path="last"`` load the checkpoint SCOUT's retrieval policy chose
(:mod:`scout_lightning.checkpoints`).

Importing the package checks that the installed lightning is a release this plugin is tested with and raises
:class:`UnsupportedVersion`, naming it, if not. ``scout plugins`` finds it through the ``scout.plugins`` entry-point
group (``plugin``).
"""

from __future__ import annotations

from typing import Any

from scout_core.plugin_support import UnsupportedVersion, VersionGate
from scout_core.restart_rendezvous import separate_restart_attempts

__all__ = ["SUPPORTED", "ScoutCallback", "UnsupportedVersion", "plugin"]

SUPPORTED = (">=2.6", "<2.7")
"""The lightning versions this plugin is tested with (``pyproject.toml`` declares the same range)."""

_GATE = VersionGate(plugin="scout-lightning", framework="lightning", supported=SUPPORTED,
                    missing_hint="see plugins/scout-lightning/README.md: pip install -r "
                                 "plugins/scout-lightning/requirements.txt with torch pinned")

LIGHTNING_VERSION = _GATE.check()

plugin = _GATE.describe(LIGHTNING_VERSION, name="lightning", how=(
    'lightning.Trainer(..., callbacks=[scout_lightning.ScoutCallback("scout.yaml")])'),
    tryout="scout_lightning.tryout")
"""What scout_core learns of this plugin through the entry point."""


def __getattr__(name: str) -> Any:
    # lightning is imported only when used: scout_core's plugin discovery reads ``plugin`` without paying for it.
    if name == "ScoutCallback":
        from scout_lightning.callback import ScoutCallback

        return ScoutCallback
    raise AttributeError(f"module 'scout_lightning' has no attribute {name!r}")


# A torchrun worker: each restart attempt's process group rendezvous apart (scout_core/restart_rendezvous.py).
separate_restart_attempts()
