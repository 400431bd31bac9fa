"""CPU try-out support: a small Lightning job with SCOUT on, for ``scout try lightning`` (under ``torchrun``).

Not for training jobs: it trains on CPU ranks over gloo. Lightning's own demo model (``lightning.pytorch.demos.
LightningTransformer``: token embedding, ``nn.Transformer`` with two encoder and two decoder layers, SGD) trains on
random tokens (nothing is downloaded) with the DDP strategy, SCOUT switched on by ``callbacks=[ScoutCallback(...)]``:
the one-line change of the plugin's README. ``ModelCheckpoint`` saves every 20 steps (and ``last.ckpt``); SCOUT
labels the files.

Faults (``--fault``): ``sdc``: rank ``--fault-rank``'s encoder layer 1 computes one value of its feed-forward output
wrong from step 3, in training and in replay alike (a defective unit); ``hang``: that rank stops in Python code at
step 4. ``--fsdp``: FSDP2 through ModelParallelStrategy (``configure_model`` shards each layer) instead of DDP.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from scout_core.tryout import tryout_arguments

__all__ = ["RandomPairs", "blocks", "build_module", "main", "trainer"]


class RandomPairs(torch.utils.data.Dataset):
    """Random (input, next-token target) sequences, the same for a given index on every rank and in every run."""

    def __init__(self, size: int = 100_000, length: int = 16, vocab: int = 256) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.length + 1,), generator=torch.Generator().manual_seed(index))
        return tokens[:-1], tokens[1:]


def build_module(*, fsdp: bool = False) -> Any:
    """Lightning's demo LightningTransformer on a 256-token vocabulary, its data random tokens (initialized from seed
    0: the same on every rank); ``fsdp``: its ``configure_model`` shards each encoder and decoder layer and the model
    with FSDP2 over the strategy's data-parallel mesh (what ModelParallelStrategy asks of a LightningModule)."""
    from lightning.pytorch.demos import LightningTransformer

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2 here
            pass

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(RandomPairs(), batch_size=4)

    class ShardedDemo(Demo):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            transformer = self.model.transformer
            for layer in [*transformer.encoder.layers, *transformer.decoder.layers]:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    torch.manual_seed(0)
    return (ShardedDemo if fsdp else Demo)(vocab_size=256)


def blocks(module: Any) -> torch.nn.ModuleList:
    """The demo's encoder layers (where the try-out's and the cells' faults act)."""
    return module.model.transformer.encoder.layers


def trainer(out: Path, steps: int, callbacks: list[Any], *, save_every: int = 20, accumulation: int = 1,
            fsdp: bool = False) -> Any:
    """A Lightning Trainer of the try-out (and of the plugin's cells): CPU ranks, DDP (``fsdp``: FSDP2 through
    ModelParallelStrategy, data parallel, whole checkpoints), no logger, a ``ModelCheckpoint`` in ``out/checkpoints``
    every ``save_every`` steps (0: none) with ``last.ckpt``."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    strategy: Any = "ddp"
    if fsdp:
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                         save_distributed_checkpoint=False)

    if save_every:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=str(out / "checkpoints"), every_n_train_steps=save_every,
                                                 save_top_k=-1, save_last=True)]
    return lightning.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                             max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=bool(save_every),
                             accumulate_grad_batches=accumulation, default_root_dir=str(out), deterministic=False)


def fault_callback(fault: str, rank: int, fault_rank: int, module: Any, *, onset: int = 3) -> Any:
    """The try-out's fault, driven by Lightning's own batch events (see the module's docstring)."""
    from lightning.pytorch import Callback

    step = {"n": 0}
    if fault == "sdc" and rank == fault_rank:
        part = blocks(module)[1].linear2  # the layer's feed-forward output, which it adds to its residual
        forward = part.forward

        def defective(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            if step["n"] >= onset:
                with torch.no_grad():
                    out.view(-1)[5] *= 1.001  # one value a little wrong, in training and in replay alike
            return out

        part.forward = defective

    class Fault(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step["n"] = trainer.global_step + 1
            if fault == "hang" and rank == fault_rank and step["n"] == 4:
                time.sleep(3600)  # stuck in Python code, outside any collective, while the peers wait

    return Fault()


def main() -> None:
    parser = tryout_arguments(__doc__.splitlines()[0])
    parser.add_argument("--gradient-accumulation", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 through ModelParallelStrategy instead of DDP")
    args = parser.parse_args()
    import scout_lightning

    rank = int(os.environ.get("RANK", "0"))
    module = build_module(fsdp=args.fsdp)
    scout = scout_lightning.ScoutCallback(overrides=[f"report.jsonl_path={args.out / 'incidents.jsonl'}",
                                                     f"actions.on_verdict={'log' if args.fault == 'none' else 'stop'}"])
    run = trainer(args.out, args.steps, [scout, fault_callback(args.fault, rank, args.fault_rank, module)],
                  accumulation=args.gradient_accumulation, fsdp=args.fsdp)
    run.fit(module)


if __name__ == "__main__":
    main()
