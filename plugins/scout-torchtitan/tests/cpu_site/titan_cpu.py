"""Test machinery only: ``--module titan_cpu`` is ``--module scout_torchtitan`` (and ``--module llama3``, for
the ``--override.imports`` form) for TorchTitan's llama3 debug model, made to train on this CPU machine by
scout_torchtitan.cpu: the same registry functions, the same flags."""

import dataclasses
import os

import torch
from torchtitan.models.llama3 import config_registry as llama3

from scout_torchtitan.config_registry import with_scout
from scout_torchtitan.cpu import on_cpu


def _flipping(parallelize_fn):
    """``TITAN_CPU_FLIP=1``: rank 1's block 2 flips an exponent bit of its feed-forward output, every step."""

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        if os.environ.get("TITAN_CPU_FLIP") == "1" and int(os.environ["RANK"]) == 1:
            block = model.layers["2"]
            block = getattr(block, "_checkpoint_wrapped_module", block)

            def flip(_m, _a, out):
                with torch.no_grad():
                    out.view(-1)[5:6].view(torch.int16).bitwise_xor_(1 << 10)

            block.feed_forward.register_forward_hook(flip)
        return model

    return parallelize


def llama3_debugmodel_plain():
    """TorchTitan's own config (the ``--override.imports`` form)."""
    cfg = on_cpu(llama3.llama3_debugmodel(), steps=6)
    cfg.model_spec = dataclasses.replace(cfg.model_spec, parallelize_fn=_flipping(cfg.model_spec.parallelize_fn))
    return cfg


llama3_debugmodel = with_scout(llama3_debugmodel_plain)
"""The plugin's registry entry (the ``--module scout_torchtitan --scout.enable`` form)."""
