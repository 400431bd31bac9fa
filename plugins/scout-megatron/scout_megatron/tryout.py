"""CPU try-out support: a small Megatron-Core GPT trained with SCOUT on, for ``scout try megatron`` (run under
``torchrun``).

Not for training jobs. It is a ``pretrain_gpt.py`` with the plugin's one-line change (``scout_megatron``'s
``parse_and_validate_args`` and ``pretrain``, SCOUT switched on by ``--scout`` at its shipped settings), made to run
on the host by :mod:`scout_megatron.cpu`: Megatron's own ``pretrain`` asserts CUDA, so :func:`host_pretrain` makes
the calls it makes (``initialize_megatron`` with ``allow_no_cuda``, ``setup_model_and_optimizer``, which the plugin
wraps exactly as on a GPU, and Megatron's ``train``) over synthetic token batches.

Faults (``--fault``): ``sdc``: rank ``--fault-rank``'s transformer layer 1 computes one output value wrong from
iteration 3, in training and in replay alike (a defective unit); ``hang``: that rank stops in Python code in layer
2's forward at iteration 4.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from typing import Any

import torch

from scout_core.tryout import tryout_arguments

__all__ = ["host_pretrain", "main", "masked_loss"]

SEQ, VOCAB, MICRO_BATCH = 32, 128, 2


def _batches(seed: int) -> Any:
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(seed * 1000 + parallel_state.get_data_parallel_rank())
    while True:
        yield torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)


def masked_loss(mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output.float().view(-1) * mask.view(-1)).sum()
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}


def _forward_step(data_iterator: Any, model: Any) -> Any:
    tokens = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
    mask = torch.ones(MICRO_BATCH, SEQ)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]), partial(masked_loss, mask)


def _gpt_provider(pre_process: bool = True, post_process: bool = True, **_: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process)


def _install_fault(model: list[torch.nn.Module], fault: str) -> None:
    from megatron.training import get_args

    layers = model[0].module.decoder.layers if hasattr(model[0], "module") else model[0].decoder.layers
    iteration = lambda: int(getattr(get_args(), "curr_iteration", 0)) + 1  # noqa: E731 - the one being run
    if fault == "sdc":
        def defective(_m: Any, _a: Any, out: Any) -> None:
            if iteration() >= 3:
                with torch.no_grad():
                    (out[0] if isinstance(out, tuple) else out).view(-1)[5] *= 1.001  # one value a little wrong

        layers[1].register_forward_hook(defective)
    elif fault == "hang":
        def stuck(_m: Any, _a: Any) -> None:
            if iteration() == 4:
                time.sleep(3600)  # stuck in Python code, outside any collective, while the peers wait

        layers[2].register_forward_pre_hook(stuck)


def host_pretrain(fault: str, fault_rank: int, seed: int = 0) -> Any:
    """A stand-in for Megatron's ``pretrain`` on the host: the same calls, the host allowed, synthetic batches."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import get_args, training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.initialize import initialize_megatron

    def pretrain(*_: Any, **__: Any) -> Any:
        initialize_megatron(allow_no_cuda=True)
        args = get_args()
        model, optimizer, scheduler = training.setup_model_and_optimizer(
            ModelType.encoder_or_decoder, _gpt_provider, cfg_container=pretrain_cfg_container_from_args(args))
        if torch.distributed.get_rank() == fault_rank:
            _install_fault(model, fault)
        return training.train(_forward_step, model, optimizer, scheduler, RerunDataIterator(_batches(seed)), None,
                              None, get_model_config(model[0]), {}, None)

    return pretrain


def main() -> None:
    parser = tryout_arguments(__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel", type=int, default=1, help="Megatron's --tensor-model-parallel-size")
    parser.add_argument("--num-layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from scout_megatron import cpu

    cpu.allow_python_311()
    cpu.stub_triton_ops()
    cpu.quiet_host_notices()
    torch.distributed.init_process_group("gloo")  # Megatron keeps a process group that exists
    cpu.on_host()
    from megatron.training import training

    import scout_megatron

    world = torch.distributed.get_world_size()
    sys.argv = ["pretrain_gpt.py", "--num-layers", str(args.num_layers), "--hidden-size", "64",
                "--num-attention-heads", "4", "--tensor-model-parallel-size", str(args.tensor_parallel),
                "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
                "--tokenizer-type", "NullTokenizer", "--micro-batch-size", str(MICRO_BATCH),
                "--global-batch-size", str(MICRO_BATCH * world // args.tensor_parallel), "--train-iters",
                str(args.steps), "--lr", "1e-3",
                "--seed", "1234", "--transformer-impl", "local", "--distributed-backend", "gloo",
                "--attention-dropout", "0", "--hidden-dropout", "0", "--no-gradient-accumulation-fusion",
                "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
                "--no-persist-layer-norm", "--no-rope-fusion", "--log-interval", "1000", "--eval-iters", "0",
                "--logging-level", "40",
                "--scout", "--scout-report-jsonl-path", str(args.out / "incidents.jsonl"),
                "--scout-actions-on-verdict", "stop" if args.fault != "none" else "log"]
    scout_megatron.parse_and_validate_args()
    training.pretrain = host_pretrain(args.fault, args.fault_rank)
    scout_megatron.pretrain()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
