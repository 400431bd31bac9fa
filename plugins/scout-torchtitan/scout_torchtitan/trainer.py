"""``ScoutTrainer``: TorchTitan's ``Trainer`` with a ``scout`` config section.

With ``--scout.enable`` off it is TorchTitan's Trainer: nothing of SCOUT is installed. On, its checkpoint manager
becomes :class:`~scout_torchtitan.checkpointer.ScoutCheckpointManager`, which TorchTitan builds once the model
parts, optimizers and meshes exist, and which attaches SCOUT, marks the data loader and checkpoint I/O, labels
TorchTitan's checkpoints by certification and closes SCOUT before itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchtitan.trainer import Trainer

from scout_torchtitan.checkpointer import with_scout_checkpointer
from scout_torchtitan.compat import ensure_set_timeout
from scout_torchtitan.config import ScoutSection

__all__ = ["ScoutTrainer"]


class ScoutTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        scout: ScoutSection = field(default_factory=ScoutSection)
        """SCOUT: ``--scout.enable`` switches it on; every other key is scout_core's schema."""

    def __init__(self, config: Config) -> None:
        ensure_set_timeout()  # TorchTitan 0.3 on torch 2.13 stops after step 1 without it (compat.py)
        if config.scout.enable:
            config.checkpoint = with_scout_checkpointer(config.checkpoint, config.scout)
        super().__init__(config)

    @property
    def scout(self) -> Any:
        """SCOUT's handle on this rank, or None when ``--scout.enable`` is off."""
        return getattr(getattr(self, "checkpointer", None), "scout", None)
