"""The ``scout`` section of a TorchTitan config: scout_core's own schema plus the switch.

:class:`ScoutSection` *is* :class:`scout_core.config.ScoutConfig` (a subclass, not a copy), so every key of
SCOUT's schema is a TorchTitan flag, ``--scout.<section>.<key>``, with scout_core's field docs as its help,
and nothing is written twice. Ranges and cross-field rules are checked by scout_core's ``validate`` when
TorchTitan builds the config (at argument parsing), so a bad value fails at start-up naming its key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scout_core.config import ConfigError, ScoutConfig, validate

__all__ = ["ScoutSection", "to_core"]


@dataclass(kw_only=True)
class ScoutSection(ScoutConfig):
    """SCOUT (hang, straggler and silent-corruption diagnosis, certified checkpoints); see
    scout_core's docs/configuration.md for every key."""

    enable: bool = False
    """Install SCOUT on this job. Off: nothing of SCOUT is installed and the Trainer runs unchanged."""

    def __post_init__(self) -> None:
        try:
            validate(self)
        except ConfigError as exc:
            raise ConfigError(f"--scout.{exc}") from None  # scout_core names the key: the flag


def to_core(section: ScoutSection) -> ScoutConfig:
    """The section as scout_core's config (without the switch)."""
    return ScoutConfig(**{f.name: getattr(section, f.name) for f in dataclasses.fields(ScoutConfig)})
