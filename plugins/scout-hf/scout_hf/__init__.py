"""SCOUT for Hugging Face: ``transformers.Trainer`` through its callback API, and Accelerate in one call.

The one-line change for a ``Trainer`` job::

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[scout_hf.ScoutCallback("scout.yaml")])

and for a script of its own on Accelerate, after ``accelerator.prepare``::

    handle = scout_hf.attach(accelerator, model, optimizer, config="scout.yaml")

:class:`ScoutCallback` attaches SCOUT at the Trainer's train begin to what the Trainer built (the wrapped model, the
torch optimizer inside Accelerate's wrapper, the LR scheduler), labels the Trainer's own ``checkpoint-N`` folders
by SCOUT's certification, and at the Trainer's construction steers ``resume_from_checkpoint=True`` to the
checkpoint SCOUT's retrieval policy chose (:mod:`scout_hf.checkpoints`).

Importing the package checks that the installed transformers and accelerate are releases this plugin is tested
with and raises :class:`UnsupportedVersion`, naming them, if not. ``scout plugins`` finds it through the
``scout.plugins`` entry-point group (``plugin``).
"""

from __future__ import annotations

from typing import Any

from scout_core.plugin_support import UnsupportedVersion, VersionGate
from scout_core.restart_rendezvous import separate_restart_attempts

__all__ = ["SUPPORTED", "SUPPORTED_ACCELERATE", "ScoutCallback", "UnsupportedVersion", "attach", "plugin"]

SUPPORTED = (">=5.18", "<5.19")
"""The transformers versions this plugin is tested with (``pyproject.toml`` declares the same range)."""
SUPPORTED_ACCELERATE = (">=1.15", "<1.16")
"""The accelerate versions this plugin is tested with."""

_GATE = VersionGate(plugin="scout-hf", framework="transformers", supported=SUPPORTED,
                    missing_hint="see plugins/scout-hf/README.md: pip install -r plugins/scout-hf/requirements.txt "
                                 "with torch pinned")
_ACCELERATE_GATE = VersionGate(plugin="scout-hf", framework="accelerate", supported=SUPPORTED_ACCELERATE,
                               missing_hint="see plugins/scout-hf/README.md")

TRANSFORMERS_VERSION = _GATE.check()
ACCELERATE_VERSION = _ACCELERATE_GATE.check()

plugin = _GATE.describe(TRANSFORMERS_VERSION, name="hf", how=(
    'Trainer(..., callbacks=[scout_hf.ScoutCallback("scout.yaml")]); on Accelerate: '
    'scout_hf.attach(accelerator, model, optimizer, config="scout.yaml") after accelerator.prepare'),
    tryout="scout_hf.tryout")
"""What scout_core learns of this plugin through the entry point."""


def __getattr__(name: str) -> Any:
    # transformers is imported only when used: scout_core's plugin discovery reads ``plugin`` without paying for it.
    if name == "ScoutCallback":
        from scout_hf.callback import ScoutCallback

        return ScoutCallback
    if name == "attach":
        from scout_hf.prepared import attach

        return attach
    raise AttributeError(f"module 'scout_hf' has no attribute {name!r}")


# A torchrun worker: each restart attempt's process group rendezvous apart (scout_core/restart_rendezvous.py).
separate_restart_attempts()
