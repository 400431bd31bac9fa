"""CPU try-out support: a small ``transformers.Trainer`` job with SCOUT on, for ``scout try hf`` (under ``torchrun``).

Not for training jobs: it trains on CPU ranks over gloo (``use_cpu``). A GPT-2 (or, with ``--model llama``, a Llama)
of transformers' own classes, built from a small config (nothing is downloaded), trains on random tokens with the
Trainer's DDP path (``--fsdp``: its FSDP2 path), with SCOUT switched on by ``callbacks=[ScoutCallback(...)]``: the
one-line change of the plugin's README. The Trainer saves a checkpoint every 20 steps, which SCOUT labels (not with
``--fsdp``: see :func:`main`). With ``--fsdp``, Accelerate's FSDP path is made to run on CPU ranks
(:mod:`scout_hf.cpu`).

Faults (``--fault``): ``sdc``: rank ``--fault-rank``'s block 1 computes one value of its feed-forward wrong from
step 3, in training and in replay alike (a defective unit); ``hang``: that rank stops in Python code at step 4.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from scout_core.tryout import tryout_arguments

__all__ = ["RandomTokens", "blocks", "build_model", "feed_forward", "main", "trainer_arguments"]


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences, the same for a given index on every rank and in every run (a language-model batch:
    the labels are the inputs; the model shifts them)."""

    def __init__(self, size: int = 100_000, length: int = 32, vocab: int = 256) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens.clone()}


def build_model(kind: str = "gpt2", *, layers: int = 4) -> torch.nn.Module:
    """transformers' own model class from a small config, initialized from seed 0 (the same on every rank)."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=layers, n_head=4))
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64))
    if kind == "bert":  # a BERT-style encoder (masked LM; the try-out's labels are every token)
        return BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=64))
    raise ValueError(f"model {kind!r}: gpt2, llama or bert")


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of the try-out's models (GPT-2's ``transformer.h``, Llama's ``model.layers``, BERT's
    ``bert.encoder.layer``)."""
    if hasattr(model, "transformer"):
        return model.transformer.h
    if hasattr(model, "bert"):
        return model.bert.encoder.layer
    return model.model.layers


def feed_forward(block: torch.nn.Module) -> torch.nn.Module:
    """The block's feed-forward part, whose output adds to the block's (BERT's ``output``: its second dense layer, the
    residual and the norm)."""
    return block.mlp if hasattr(block, "mlp") else block.output


def trainer_arguments(out: Path, steps: int, *, fsdp: bool = False, accumulation: int = 1, save_steps: int = 20,
                      **more: Any) -> Any:
    """The Trainer's arguments of the try-out (and of the plugin's cells): CPU ranks on gloo, no logging
    integrations, a checkpoint every ``save_steps`` steps."""
    from transformers import TrainingArguments

    extra: dict[str, Any] = {}
    if fsdp:
        extra.update(fsdp=True, fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
    return TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
        gradient_accumulation_steps=accumulation, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, logging_strategy="no", report_to="none", use_cpu=True, ddp_backend="gloo",
        dataloader_num_workers=0, disable_tqdm=True, seed=0, **extra, **more)


def fault_callback(fault: str, rank: int, fault_rank: int, model: torch.nn.Module, *, onset: int = 3) -> Any:
    """The try-out's fault, driven by the Trainer's own step events (see the module's docstring); ``onset``: the
    step from which the sdc fault computes wrongly."""
    from transformers import TrainerCallback

    step = {"n": 0}
    if fault == "sdc" and rank == fault_rank:
        part = feed_forward(blocks(model)[1])
        forward = part.forward  # the block's feed-forward: its output adds to the block's

        def defective(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            if step["n"] >= onset:
                with torch.no_grad():
                    out.view(-1)[5] *= 1.001  # one value a little wrong, in training and in replay alike
            return out

        part.forward = defective

    class Fault(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step["n"] = state.global_step + 1
            if fault == "hang" and rank == fault_rank and step["n"] == 4:
                time.sleep(3600)  # stuck in Python code, outside any collective, while the peers wait

    return Fault()


def main() -> None:
    parser = tryout_arguments(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "llama", "bert"), default="gpt2",
                        help="transformers' model class")
    parser.add_argument("--fsdp", action="store_true", help="the Trainer's FSDP2 path instead of DDP")
    parser.add_argument("--gradient-accumulation", type=int, default=1, help="micro-batches per optimizer step")
    args = parser.parse_args()
    from transformers import Trainer

    import scout_hf

    rank = int(os.environ.get("RANK", "0"))
    if args.fsdp:
        from scout_hf.cpu import fsdp_on_cpu

        fsdp_on_cpu()  # Accelerate turns FSDP on only for accelerator devices
    # (No saves with --fsdp: the Trainer's FSDP2 save of the whole model fails on CPU ranks, in safetensors:
    # "Attempted to access the data pointer on an invalid python storage".)
    targs = trainer_arguments(args.out, args.steps, fsdp=args.fsdp, accumulation=args.gradient_accumulation,
                              save_steps=0 if args.fsdp else 20)
    scout = scout_hf.ScoutCallback(overrides=[f"report.jsonl_path={args.out / 'incidents.jsonl'}",
                                              f"actions.on_verdict={'log' if args.fault == 'none' else 'stop'}"])
    model = build_model(args.model)
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(),
                      callbacks=[scout, fault_callback(args.fault, rank, args.fault_rank, model)])
    trainer.train()


if __name__ == "__main__":
    main()
