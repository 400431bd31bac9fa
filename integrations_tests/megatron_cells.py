"""Megatron cells: real Megatron-Core training with SCOUT switched on by the plugin's command-line flags.

Each rank runs what a ``pretrain_gpt.py`` launch with the one-line change runs: Megatron's argument parser
(``scout_megatron.parse_and_validate_args``, the cell's Megatron and ``--scout-*`` flags on ``sys.argv``), then
``scout_megatron.pretrain``, which attaches SCOUT after Megatron's own ``setup_model_and_optimizer`` (GPTModel
from megatron.core with the local layer spec, Megatron's DDP and optimizer) and runs Megatron's own ``train``
loop. Megatron's ``pretrain`` asserts CUDA, so here :func:`_pretrain_on_host` makes the same calls it makes
(``initialize_megatron`` with ``allow_no_cuda``, ``setup_model_and_optimizer``, ``train``), with the CPU shim of
:mod:`scout_megatron.cpu`; the plugin's wrapper around ``setup_model_and_optimizer`` is the one a
GPU job runs.

Faults (``faults`` in configs/cells.yaml) act in a transformer layer's forward, in training and in SCOUT's replay
alike: ``layers.<i>.output`` corrupts layer i's output (bit flip, set, scale); ``layers.<i>.forward``
(``freeze``) stops the rank in layer i's forward. Steps are Megatron's iterations, counted from 1.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from integrations_tests.training_jobs import bitwise_problems, cell_report, restart_problems, run_job
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, prepare_parent
from scout_megatron.tryout import masked_loss

__all__ = ["megatron_cell"]

SEQ, VOCAB, MICRO_BATCH = 32, 128, 2


def _prepare() -> None:
    """Import Megatron in the parent, once: forked ranks start with it loaded."""
    prepare_parent()
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    megatron_cpu.quiet_host_notices()
    import megatron.core.tokenizers.text  # noqa: F401  (each rank builds its tokenizer: this imports transformers)
    import megatron.training.training  # noqa: F401

    import scout_megatron.entry  # noqa: F401


def _argv(a: dict[str, Any]) -> list[str]:
    """A ``pretrain_gpt.py`` command line: a tiny GPT, the cell's parallelism, SCOUT's flags."""
    dp = a["world"] // a["tp"]
    megatron = ["--num-layers", str(a["layers"]), "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
                "--tokenizer-type", "NullTokenizer", "--micro-batch-size", str(MICRO_BATCH),
                "--global-batch-size", str(MICRO_BATCH * dp), "--train-iters", str(a["steps"]),
                "--tensor-model-parallel-size", str(a["tp"]), "--lr", "1e-3", "--seed", str(1234 + a["seed"]),
                "--transformer-impl", "local", "--distributed-backend", "gloo", "--attention-dropout", "0",
                "--hidden-dropout", "0", "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
                "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
                "--no-rope-fusion", "--log-interval", "1000", "--eval-iters", "0", "--logging-level", "40"]
    megatron += list(a.get("megatron", []))  # the cell's own Megatron flags (distributed optimizer, overlap)
    if a.get("save_interval"):
        folder = os.path.join(a["workdir"], "megatron")
        megatron += ["--save", folder, "--load", folder, "--save-interval", str(a["save_interval"])]
    scout = [] if a["scout"] is None else ["--scout", *a["scout"]]
    return ["pretrain_gpt.py", *megatron, *scout]


def _batches(seed: int, injector: Injector, rank: int) -> Any:
    """Synthetic token batches, different on each data-parallel rank (Megatron's data loader is not needed). A
    ``dataloader`` delay fault holds the fetch (a stalled input pipeline)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    gen = torch.Generator().manual_seed(seed * 1000 + parallel_state.get_data_parallel_rank())
    while True:
        injector.delay("dataloader", rank=rank, step=int(getattr(get_args(), "curr_iteration", 0)) + 1)
        yield torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)


def _forward_step(data_iterator: Any, model: Any) -> Any:
    """pretrain_gpt.py's forward step, on synthetic batches: as Megatron's ``get_batch``, tensor-parallel rank 0
    reads the batch (the others have no iterator) and broadcasts it to its tensor-parallel partners."""
    from megatron.core import parallel_state

    tokens = next(data_iterator) if data_iterator is not None else \
        torch.empty(MICRO_BATCH, SEQ + 1, dtype=torch.int64)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(tokens, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
    mask = torch.ones(MICRO_BATCH, SEQ)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]), partial(masked_loss, mask)


def _gpt_provider(pre_process: bool = True, post_process: bool = True, **_: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process)


def _pretrain_on_host(state: dict[str, Any], injector: Injector, rank: int, seed: int) -> Any:
    """What Megatron's ``pretrain`` calls, on this host: ``initialize_megatron(allow_no_cuda=True)`` (its CUDA
    assertion is the one step that cannot run here), ``setup_model_and_optimizer`` looked up on the module at
    call time (as ``pretrain`` does, so the plugin's wrapper runs), then Megatron's ``train``."""
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
        if args.iteration:  # Megatron loaded a checkpoint (--load): which iteration, and its state bitwise
            state["loaded"] = [int(args.iteration), *_signature(model, optimizer)]
        _install_faults(model, injector, rank)
        logged: list[int] = []
        _log_moe_metrics(logged)
        state["model"], state["optimizer"] = model, optimizer
        from megatron.core import parallel_state

        # Megatron builds data iterators on tensor-parallel rank 0 only.
        data = RerunDataIterator(_batches(seed, injector, rank)) \
            if parallel_state.get_tensor_model_parallel_rank() == 0 else None
        iteration = training.train(_forward_step, model, optimizer, scheduler, data, None, None,
                                   get_model_config(model[0]), {}, None)
        state["iterations"] = iteration[0] if isinstance(iteration, tuple) else iteration
        state["final"] = _signature(model, optimizer) + _side_state(model, logged)
        dist.barrier()

    return pretrain


def _install_faults(model: list[torch.nn.Module], injector: Injector, rank: int) -> None:
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args

    step = lambda: int(getattr(get_args(), "curr_iteration", 0)) + 1  # noqa: E731 - Megatron counts from 0
    for i, layer in enumerate(unwrap_model(model[0]).decoder.layers):
        experts = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "local_experts", None)
        for e, expert in enumerate(experts or []):
            # A faulty unit in one expert's computation: ``layers.<i>.experts.<e>.output`` (training and replay).
            def expert_out(_m: Any, _a: Any, out: Any, i: int = i, e: int = e) -> Any:
                # A corrupted copy replaces the output: the expert's own output may be a view an autograd Function
                # returned, which must not be changed in place.
                first = out[0] if isinstance(out, tuple) else out
                corrupted = first.detach().clone()
                if not injector.corrupt(f"layers.{i}.experts.{e}.output", corrupted, rank=rank, step=step()):
                    return None
                corrupted = first + (corrupted - first.detach())  # the corrupted value, training's gradient path
                return (corrupted, *out[1:]) if isinstance(out, tuple) else corrupted

            expert.register_forward_hook(expert_out)
        def enter(_m: Any, _a: Any, i: int = i) -> None:
            injector.freeze(f"layers.{i}.forward", rank=rank, step=step())

        def leave(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            with torch.no_grad():
                injector.corrupt(f"layers.{i}.output", hidden, rank=rank, step=step())
                injector.corrupt("layers.any.output", hidden, rank=rank, step=step())  # a faulty unit: every layer

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)


def _signature(model: list[torch.nn.Module], optimizer: Any) -> list[int]:
    """A bitwise signature of this rank's parameters and optimizer state."""
    from scout_core.adapter import find_inner_optimizers

    tensors = [p for m in model for p in m.parameters()]
    for opt in find_inner_optimizers(optimizer):
        for p in (p for g in opt.param_groups for p in g["params"]):
            tensors += [v for _k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return [s.signature for s in sign_many([t.detach() for t in tensors])]


def _side_state(model: list[torch.nn.Module], logged: list[int]) -> list[int]:
    """A bitwise signature of what training keeps beside its parameters that a replay could touch: the modules'
    buffers (a router's token counts for the expert bias), and the MoE metrics Megatron logged (``logged``, see
    :func:`_log_moe_metrics`)."""
    tensors = [b for m in model for b in torch.nn.Module.buffers(m)]  # Megatron's DDP has its own `buffers` list
    return [s.signature for s in sign_many([t.detach() for t in tensors])] + logged


def _log_moe_metrics(logged: list[int]) -> None:
    """Sign the MoE metrics (auxiliary losses) each time Megatron reports and clears them, every iteration."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    report = MoEMetricsTracker.report

    def signed_report(self: Any, *args: Any, **kwargs: Any) -> Any:
        logged.extend(s.signature for s in sign_many([e.values.detach() for _n, e in sorted(self.metrics.items())]))
        return report(self, *args, **kwargs)

    MoEMetricsTracker.report = signed_report  # this rank's process only


def _megatron_rank(ctx: RankContext) -> dict[str, Any]:
    a = ctx.args
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")  # what Megatron's launch scripts set for TP
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // a['ranks_per_machine']}"
    init_gloo(ctx, timeout_s=120)  # Megatron keeps a process group that already exists
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.on_host()
    from megatron.training import training

    import scout_megatron

    sys.argv = _argv(a)
    scout_megatron.parse_and_validate_args()
    state: dict[str, Any] = {}
    megatron_pretrain, megatron_save = training.pretrain, training.save_checkpoint
    if a.get("save_interval"):
        sigs: dict[int, list[int]] = {}

        def save_signed(iteration: int, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            sigs[int(iteration)] = _signature(model, optimizer)  # the state this save writes, bitwise
            with open(os.path.join(a["workdir"], f"sigs-{a['phase']}-r{ctx.rank}.json"), "w") as fh:
                json.dump(sigs, fh)
            return megatron_save(iteration, model, optimizer, *args, **kwargs)

        training.save_checkpoint = save_signed  # before pretrain: the plugin wraps what it finds, as on a GPU
    training.pretrain = _pretrain_on_host(state, Injector(a["faults"], seed=a["seed"]), ctx.rank, a["seed"])
    try:
        scout_megatron.pretrain()
    finally:
        training.pretrain, training.save_checkpoint = megatron_pretrain, megatron_save
    handle = scout_megatron.entry.last_handle()
    checks = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle is not None else []
    alltoall = 0  # expert checks that replayed the AllToAll (its surfaces compared among the expert peers)
    if handle is not None and handle.experts is not None:
        checks += [(c.step, ["expert"], c.skipped) for c in handle.experts.history]
        alltoall = sum(any(r.surface.startswith("alltoall.") for r in c.surfaces) for c in handle.experts.history)
    return {"checks": checks, "iterations": state.get("iterations"), "final": state.get("final"),
            "loaded": state.get("loaded", []), "alltoall_checks": alltoall}


def megatron_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    _prepare()
    p = spec.params
    hang = bool(p.get("hang", False))
    recovery = bool(p.get("recovery", False))  # a stop, then a restart that must load the chosen iteration
    stop = recovery or bool(p.get("stop", False))  # --scout-actions-on-verdict=stop: every rank exits 75
    jsonl = os.path.join(workdir, "incidents.jsonl")
    scout = [f"--scout-report-jsonl-path={jsonl}", f"--scout-report-run-id={spec.name}",
             "--scout-report-log-level=ERROR", *(["--scout-actions-on-verdict=stop"] if stop else []),
             *p.get("flags", [])]
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 8)), "world": world_size,
            "tp": int(p.get("tp", 1)), "layers": int(p.get("layers", 2)), "scout": scout,
            "ranks_per_machine": int(p.get("ranks_per_machine", 8)), "workdir": workdir,
            "save_interval": int(p.get("save_interval", 0)), "phase": "a", "megatron": list(p.get("megatron", []))}
    run = run_job(_megatron_rank, spec, world_size, workdir, args, hang=hang, stop=stop)
    if run.result.ok and not hang and any(v["iterations"] != args["steps"] for v in run.result.values()):
        run.problems.append(f"Megatron trained {[v['iterations'] for v in run.result.values()]} iterations, "
                            f"expected {args['steps']}")
    if p.get("alltoall") and run.result.ok and not hang:  # expert parallelism: the token exchange replayed too
        missing = [r for r, v in enumerate(run.result.values()) if not (v or {}).get("alltoall_checks")]
        if missing:
            run.problems.append(f"no expert check replayed the AllToAll on ranks {missing}")
    if p.get("bitwise_without_scout") and run.result.ok and not run.problems:
        run.problems += bitwise_problems(_megatron_rank, spec, world_size, args, run)
    if recovery and not run.problems:
        run.problems += restart_problems(_megatron_rank, spec, world_size, workdir, args,
                                         folder=os.path.join(workdir, "megatron"),
                                         unit="iteration", prefix="iter_", counted="iterations")
    return cell_report(spec, world_size, run, hang=hang)
