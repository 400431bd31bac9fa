"""``scout_deepspeed.initialize``: ``deepspeed.initialize`` with SCOUT attached where the config's ``"scout"`` section
enables it (the one-line change), and the life of that SCOUT beside the engine.

* The section is read from the config DeepSpeed will use (``config``, ``config_params`` or
  ``args.deepspeed_config``) and validated before DeepSpeed builds anything: a bad key fails the launch there,
  naming its JSON path.
* After ``deepspeed.initialize`` returned, SCOUT is attached to the engine (:func:`scout_deepspeed.adapter.attach`)
  and the engine's ``save_checkpoint`` / ``load_checkpoint`` are wrapped (:mod:`scout_deepspeed.checkpoints`).
* SCOUT closes with the engine (``engine.destroy()``: a normal end) or, at the latest, when the process exits
  (not known to be a normal end: see :func:`scout_core.handle.close_at_exit`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Mapping
from typing import Any

from scout_core.config import ScoutConfig
from scout_core.handle import close_at_exit
from scout_core.runtime import ScoutHandle
from scout_deepspeed.section import config_from_deepspeed, user_config

__all__ = ["attach", "handle_of", "initialize"]

log = logging.getLogger("scout_deepspeed")

_HANDLE_ATTR = "_scout_handle"


def handle_of(engine: Any) -> ScoutHandle | None:
    """The SCOUT handle attached to ``engine`` (its replay history, incidents, ``close()``), or None."""
    return getattr(engine, _HANDLE_ATTR, None)


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize`` (same arguments, same result), with SCOUT attached to the engine where the
    DeepSpeed config has ``"scout": {"enabled": true, ...}``."""
    import deepspeed

    from scout_deepspeed.adapter import master_weights_keeper, snapshots_refused

    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    given = bound.arguments
    ds_config = user_config(given.get("config"), given.get("config_params"), given.get("args"))
    config = config_from_deepspeed(ds_config)
    keeper = master_weights_keeper(ds_config)
    trains = given.get("optimizer") is not None or (isinstance(ds_config, Mapping) and "optimizer" in ds_config)
    if config is not None and config.checkpoint.enabled and keeper is not None and trains:  # before DeepSpeed builds
        raise snapshots_refused(keeper)
    out = deepspeed.initialize(*args, **kwargs)
    if config is not None:
        attach(out[0], config)
    return out


def attach(engine: Any, config: ScoutConfig | None = None) -> ScoutHandle | None:
    """Attach SCOUT to an engine ``deepspeed.initialize`` built (every rank calls it), for scripts that keep calling
    ``deepspeed.initialize``: the adapter (:func:`scout_deepspeed.adapter.attach`), the checkpoint labels, and SCOUT's
    life tied to the engine's. ``config``: default, the engine config's ``"scout"`` section; where that section is
    absent or disabled nothing is installed and None is returned (as ``initialize`` does). Also None, with a
    warning, for an engine without an optimizer (a reference or inference model) and for a second engine in the
    process (SCOUT diagnoses one training engine per process: the actor of an RLHF job, say). Idempotent."""
    from scout_deepspeed.adapter import attach as attach_adapter
    from scout_deepspeed.checkpoints import install as label_checkpoints

    handle = handle_of(engine)
    if handle is not None:
        return handle
    if config is None:
        config = config_from_deepspeed(getattr(engine, "config", None))
        if config is None:
            return None
    if getattr(engine, "optimizer", None) is None:
        log.warning("scout_deepspeed: this engine has no optimizer (a reference or inference model): SCOUT is not "
                    "attached to it (its boundary is the optimizer step)")
        return None
    if ScoutHandle.is_open():
        log.warning("scout_deepspeed: SCOUT already diagnoses another engine in this process; this one is not "
                    "attached (one training engine per process)")
        return None
    handle = attach_adapter(engine, config=config)
    restore_checkpoints = label_checkpoints(handle, engine)
    setattr(engine, _HANDLE_ATTR, handle)
    destroy = engine.destroy

    @functools.wraps(destroy)
    def destroy_then_close(*a: Any, **k: Any) -> Any:
        # DeepSpeed's engine calls destroy() from its __del__ too, whenever the collector frees it (after main()
        # returned an error status, say): only a call of the script's own is a normal end.
        collected = sys._getframe(1).f_code.co_name == "__del__"
        try:
            handle.close(failed=True if collected else None)
        finally:
            restore_checkpoints()
            engine.destroy = destroy
        return destroy(*a, **k)

    engine.destroy = destroy_then_close
    close_at_exit(handle)
    return handle
