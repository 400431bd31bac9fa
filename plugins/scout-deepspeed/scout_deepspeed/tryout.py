"""CPU try-out support: a small DeepSpeed job with SCOUT on, for ``scout try deepspeed`` (run under ``torchrun``).

Not for training jobs: it forces DeepSpeed's CPU accelerator and gloo. It trains a small Llama-style model (token
embedding, four pre-norm blocks of attention and a gated MLP, a head) with the DeepSpeed config a user writes, SCOUT
switched on by that config's ``"scout"`` section and ``scout_deepspeed.initialize`` in place of
``deepspeed.initialize``: the one-line change of the plugin's README.

DeepSpeed's CPU backend builds a shared-memory op with the C++ compiler the first time it starts (about 3 minutes
here). The try-out marks that op unavailable in DeepSpeed's own table of compatible ops
(``deepspeed.ops.__compatible_ops__``), where DeepSpeed looks before building it; its CPU backend then does what it
does on a machine that cannot build the op: every collective on gloo.

Faults (``--fault``): ``sdc``: rank ``--fault-rank``'s block 1 computes one output value wrong from step 3, in
training and in replay alike (a defective unit); ``hang``: that rank stops in Python code at step 4.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from scout_core.tryout import tryout_arguments

__all__ = ["TinyLlama", "main"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, depth: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _config(out: Path, stop: bool, stage: int) -> Path:
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "scout": {"enabled": True,
                  "report": {"jsonl_path": str(out / "incidents.jsonl")},
                  "checkpoint": {"directory": str(out / "checkpoints")},
                  "actions": {"on_verdict": "stop" if stop else "log"}},
    }
    path = out / "ds_config.json"
    if int(os.environ.get("RANK", "0")) == 0:
        path.write_text(json.dumps(config, indent=1))
    return path


def main() -> None:
    parser = tryout_arguments(__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2, help="DeepSpeed's ZeRO stage")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported: it picks its accelerator once
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo for everything: no op build (see above)
    import scout_deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = _config(args.out, stop=args.fault != "none", stage=args.zero_stage)
    torch.distributed.barrier()  # rank 0 wrote the config
    torch.manual_seed(0)
    model = TinyLlama()
    step = {"n": 0}
    if rank == args.fault_rank and args.fault == "sdc":
        block = model.layers[1]
        forward = block.forward

        def defective(x: torch.Tensor) -> torch.Tensor:
            out = forward(x)
            if step["n"] >= 3:
                with torch.no_grad():
                    out.view(-1)[5] *= 1.001  # one value a little wrong, in training and in replay alike
            return out

        block.forward = defective
    engine, _, _, _ = scout_deepspeed.initialize(config=str(config), model=model,
                                                 model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    for n in range(1, args.steps + 1):
        step["n"] = n
        if args.fault == "hang" and rank == args.fault_rank and n == 4:
            time.sleep(3600)  # stuck in Python code, outside any collective, while the peers wait
        tokens = torch.randint(0, 256, (2, 33), generator=gen)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    engine.destroy()


if __name__ == "__main__":
    main()
