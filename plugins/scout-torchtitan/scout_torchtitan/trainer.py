"""``ScoutTrainer``: TorchTitan's ``Trainer`` with a ``scout`` config section.

With ``--scout.enable`` off it is TorchTitan's Trainer: nothing of SCOUT is imported into the run or
installed. Attaching SCOUT to the built Trainer (model parts, optimizers, meshes) is the adapter's job
(issue 12, in progress: see the plugin README for what works today).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.trainer import Trainer

from scout_torchtitan.config import ScoutSection

__all__ = ["ScoutTrainer"]


class ScoutTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        scout: ScoutSection = field(default_factory=ScoutSection)
        """SCOUT: ``--scout.enable`` switches it on; every other key is scout_core's schema."""
