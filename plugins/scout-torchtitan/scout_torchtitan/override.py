"""SCOUT for an unchanged ``--module``/``--config``, through TorchTitan's override mechanism::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --override.imports 'scout_torchtitan.override.scout={"replay.cadence.hidden": 20}'

TorchTitan 0.3 applies ``--override.imports`` to the config tree before it builds anything. The override
:func:`scout` replaces the job's checkpoint config with :class:`~scout_torchtitan.checkpointer.
ScoutCheckpointManager`'s, which TorchTitan then builds with the Trainer in hand and which attaches SCOUT: the
same path as ``--module scout_torchtitan ... --scout.enable``. Its keyword arguments (the JSON object after
``=``) are SCOUT's keys, dotted as in ``configs/scout.yaml``, plus ``config`` for a SCOUT YAML file; a bad key
or value fails at start-up naming it. Without the override nothing of SCOUT is imported.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.config import override

from scout_core.config import ConfigError, ScoutConfig, load
from scout_torchtitan.checkpointer import ScoutCheckpointManager, with_scout_checkpointer
from scout_torchtitan.compat import ensure_set_timeout
from scout_torchtitan.config import ScoutSection

__all__ = ["scout", "section_from"]


def section_from(keys: dict[str, Any]) -> ScoutSection:
    """A switched-on ``scout`` section from the override's keyword arguments."""
    keys = dict(keys)
    path = keys.pop("config", None)
    dotlist = [f"{k}={json.dumps(v)}" for k, v in keys.items()]
    try:
        core = load(path, dotlist)
    except ConfigError as exc:
        raise ConfigError(f"--override.imports scout_torchtitan.override.scout: {exc}") from None
    return ScoutSection(enable=True, **{f.name: getattr(core, f.name) for f in fields(ScoutConfig)})


@override(target=BaseCheckpointManager.Config,
          description="SCOUT: hang, straggler and silent-corruption diagnosis, certified checkpoints")
def scout(cfg: BaseCheckpointManager.Config, **keys: Any) -> ScoutCheckpointManager.Config:
    """Claims every checkpoint config, so that a manager SCOUT cannot carry fails at start-up naming it
    (:func:`~scout_torchtitan.checkpointer.with_scout_checkpointer`) instead of leaving SCOUT silently off."""
    ensure_set_timeout()  # TorchTitan 0.3 on torch 2.13 stops after step 1 without it (compat.py)
    return with_scout_checkpointer(cfg, section_from(keys))
