"""``--module scout_torchtitan``: every config TorchTitan registers, with a ``scout`` section.

TorchTitan 0.3 resolves ``--module M`` to ``M.config_registry`` and ``--config F`` to the function ``F`` in
it. This module answers any name that one of TorchTitan's model registries defines (``llama3_debugmodel``,
``deepseek_v3_16b``, ...) with that function, its ``Trainer.Config`` turned into a
:class:`~scout_torchtitan.trainer.ScoutTrainer` config; :func:`with_scout` does the same for a registry
function of the user's own::

    torchrun ... -m torchtitan.train --module scout_torchtitan --config llama3_debugmodel \\
        --scout.enable --scout.replay.cadence.hidden 20
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType

from torchtitan.models import _supported_models
from torchtitan.trainer import Trainer

from scout_torchtitan.trainer import ScoutTrainer

__all__ = ["scout_config", "with_scout"]


def scout_config(base: Trainer.Config) -> ScoutTrainer.Config:
    """``base`` as a ScoutTrainer config with the default (switched off) ``scout`` section."""
    if isinstance(base, ScoutTrainer.Config):
        return base
    if type(base) is not Trainer.Config:
        raise TypeError(f"{type(base).__qualname__} is a Trainer.Config of its own: derive it from "
                        "scout_torchtitan.ScoutTrainer.Config instead, which adds the scout section")
    return ScoutTrainer.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})


def with_scout(fn: Callable[[], Trainer.Config]) -> Callable[[], ScoutTrainer.Config]:
    """A registry function of your own, SCOUT-enabled: ``my_config = with_scout(my_config)``."""

    @functools.wraps(fn)
    def scout_enabled() -> ScoutTrainer.Config:
        return scout_config(fn())

    return scout_enabled


def _registries(config: str = "") -> Iterator[ModuleType]:
    """TorchTitan's model registries, the one of the model that ``config`` is named after first (``llama3`` for
    ``llama3_8b``): importing a registry imports its model, and some cost seconds on every rank (flux's imports
    transformers), so a lookup of a config named after its model imports no other model."""
    for name in sorted(_supported_models, key=lambda model: (not config.startswith(f"{model}_"), model)):
        try:
            yield importlib.import_module(f"torchtitan.models.{name}.config_registry")
        except ImportError:  # a model whose optional dependencies are missing offers no configs
            continue


def _registered(module: ModuleType) -> dict[str, Callable[[], Trainer.Config]]:
    """The config functions a registry defines (not the ones it imports)."""
    return {n: f for n, f in vars(module).items()
            if callable(f) and not n.startswith("_") and getattr(f, "__module__", None) == module.__name__
            and n[0].islower()}


def __getattr__(name: str) -> Callable[[], ScoutTrainer.Config]:
    if not name.startswith("_"):
        for module in _registries(name):
            fn = _registered(module).get(name)
            if fn is not None:
                return with_scout(fn)
    raise AttributeError(f"module {__name__!r} has no config {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *(n for m in _registries() for n in _registered(m))})
