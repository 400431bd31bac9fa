"""CPU try-out support: TorchTitan's llama3 debug model trained with SCOUT on, for ``scout try torchtitan`` (run
under ``torchrun``).

Not for training jobs: it points TorchTitan at the host (:mod:`scout_torchtitan.cpu`: a stand-in for its Triton
kernels, the CPU device, SDPA attention, synthetic tokens) and runs gloo. The job is the plugin's registry entry
``llama3_debugmodel`` (what ``--module scout_torchtitan --config llama3_debugmodel`` builds) with FSDP over every
rank, SCOUT's section switched on (``--scout.enable``) at its shipped settings, and ``--debug.seed 0``.

Faults (``--fault``): ``sdc``: rank ``--fault-rank``'s block 1 feed-forward computes one output value wrong from step
3, in training and in replay alike (a defective unit); ``hang``: that rank stops in Python code in block 2's forward
at step 4.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from scout_core.tryout import tryout_arguments

__all__ = ["main"]


def _install_fault(trainer: Any, fault: str, rank: int, fault_rank: int) -> None:
    if fault == "none" or rank != fault_rank:
        return
    blocks = trainer.model_parts[0].layers
    if fault == "sdc":
        def defective(_m: Any, _a: Any, out: torch.Tensor) -> None:
            if trainer.step >= 3:
                with torch.no_grad():
                    out.view(-1)[5] *= 1.001  # one value a little wrong, in training and in replay alike

        ffn = getattr(blocks["1"], "_checkpoint_wrapped_module", blocks["1"]).feed_forward
        ffn.register_forward_hook(defective)
    else:
        def stuck(_m: Any, _a: Any) -> None:
            if trainer.step == 4:
                time.sleep(3600)  # stuck in Python code, outside any collective, while the peers wait

        blocks["2"].register_forward_pre_hook(stuck)


def main() -> None:
    parser = tryout_arguments(__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama3_debugmodel",
                        help="a config of the plugin's registry (e.g. deepseek_v3_debugmodel)")
    args = parser.parse_args()

    from scout_torchtitan import cpu

    cpu.stub_triton_kernels()
    cpu.use_cpu()
    dist.init_process_group("gloo")  # TorchTitan keeps a process group that exists
    from scout_torchtitan import config_registry
    from scout_torchtitan.override import section_from

    cfg = getattr(config_registry, args.config)()
    cfg.scout = section_from({"report.jsonl_path": str(args.out / "incidents.jsonl"),
                              "actions.on_verdict": "stop" if args.fault != "none" else "log"})
    cpu.on_cpu(cfg, steps=args.steps, seq_len=64, local_batch_size=2, seed=0)
    cfg.dump_folder = str(args.out / "titan")
    cfg.debug.seed = 0
    cfg.metrics.log_freq = 10
    cfg.checkpoint.enable = False
    cfg.parallelism.data_parallel_shard_degree = -1
    trainer = cfg.build()
    _install_fault(trainer, args.fault, dist.get_rank(), args.fault_rank)
    try:
        trainer.train()
    finally:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
