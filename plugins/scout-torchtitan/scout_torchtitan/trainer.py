"""``ScoutTrainer``: TorchTitan's ``Trainer`` with a ``scout`` config section.

With ``--scout.enable`` off it is TorchTitan's Trainer: nothing of SCOUT is installed. On, SCOUT is attached
once the Trainer has built its model parts, optimizers and meshes (:func:`scout_torchtitan.attach.attach`),
and closed before the Trainer closes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torchtitan.trainer import Trainer

from scout_torchtitan.config import ScoutSection

__all__ = ["ScoutTrainer"]

log = logging.getLogger("scout_torchtitan")


class ScoutTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        scout: ScoutSection = field(default_factory=ScoutSection)
        """SCOUT: ``--scout.enable`` switches it on; every other key is scout_core's schema."""

    def __init__(self, config: Config) -> None:
        self.scout: Any = None
        if config.scout.enable and not config.training.disable_cuda_graphs:
            # A captured CUDA graph replays kernels without running Python: module hooks (SCOUT's capture of
            # the sampled layer's inputs, its progress marks) would be silent after the capture.
            log.warning("scout_torchtitan: CUDA-graph capture of forward and backward is disabled "
                        "(--training.disable_cuda_graphs): SCOUT observes modules through hooks")
            config.training.disable_cuda_graphs = True
        super().__init__(config)
        if config.scout.enable:
            from scout_torchtitan.attach import attach

            self.scout = attach(self)

    def close(self) -> None:
        if self.scout is not None:
            self.scout.close()
            self.scout = None
        super().close()
