"""A DeepSpeed training script as users write one, with the one-line change: ``deepspeed.add_config_arguments``,
``--deepspeed_config ds.json``, the optimizer built by DeepSpeed from the config, ``scout_deepspeed.initialize``.

Launched by ``torchrun`` in :mod:`test_deepspeed_launch` (on the CPU accelerator over gloo). ``--fault-rank R``
makes rank R's block 1 compute wrongly from ``--fault-from-step`` (inside its forward: in training and in replay).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fault-rank", type=int, default=None)
    parser.add_argument("--fault-from-step", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT build on this host
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    import scout_deepspeed
    from integrations_tests.zoo import LlamaLM, zoo_batches

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = LlamaLM()
    steps = {"n": 0}  # optimizer steps done (DeepSpeed's global step)
    if rank == args.fault_rank:
        block = model.layers[1]
        forward = block.forward

        def faulty(*a: object, **k: object) -> object:
            out = forward(*a, **k)
            if steps["n"] + 1 >= args.fault_from_step:
                with torch.no_grad():
                    out[0].view(-1)[5] *= 1024.0  # a faulty unit: wrong in training and in replay alike
            return out

        block.forward = faulty
    engine, _, _, _ = scout_deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    for ids, labels in zoo_batches(rank, args.steps * engine.gradient_accumulation_steps(), batch=2):
        steps["n"] = engine.global_steps
        loss = engine(ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
    handle = scout_deepspeed.handle_of(engine)
    checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps({"steps": engine.global_steps, "checks": checks}))
    engine.destroy()


if __name__ == "__main__":
    main()
