"""scout-megatron on a CUDA machine: what CI's CPU ranks cannot show, as one short script.

    python integrations_tests/gpu/megatron_check.py --out DIR [--nproc N] [--device cuda|cpu]

Each check records its outcome in ``DIR/megatron_check.json`` and the next one runs:

1. ``te``: whether Transformer Engine imports, its version, and whether this GPU runs FP8;
2. ``harmless``: Megatron's real ``pretrain`` (``initialize_megatron`` on NCCL, Megatron's data loader, its
   ``train`` loop) through ``scout_megatron.pretrain`` with ``--scout`` and every recipe each iteration, with
   Transformer Engine layers (``--transformer-impl transformer_engine``, bf16, FP8 where the GPU has it) when TE
   imports, Megatron's local layers otherwise: no incident, replay checks ran and none was skipped, and the final
   parameters equal bit for bit those of the same run without SCOUT;
3. ``fp8_state``: which TE modules hold FP8 scaling state after training, and that SCOUT's capture of it (what its
   snapshots keep, :mod:`scout_core.extra_state`) puts it back bitwise (``harmless`` already shows that replays,
   which run outside Megatron's FP8 context, left it as training had it: the final parameters are bitwise);
4. ``overhead``: the median iteration time with SCOUT at the shipped defaults and with every recipe each
   iteration, over the run without SCOUT (ratios within one run);
5. ``fault`` (4 GPUs or more: tensor parallel 2 x data parallel 2): a bit flip in rank 1's layer output from the
   first iteration: the first verdict names rank 1.

The signature kernel on CUDA is ``benchmarks/cuda_check.py``'s first check. ``--device cpu`` runs checks 2, 4
and 5 on gloo ranks with the test-only CPU shim, to try the script out here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def launch(nproc: int, out: Path, args: list[str], device: str, timeout_s: float = 600) -> list[dict[str, Any]]:
    """This file as a torchrun job (``--rank-job``); each rank's result, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--rank-job", "--out", str(out), "--device", device, *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


# -- one rank ---------------------------------------------------------------------------------------


def _rank_job(opts: argparse.Namespace, extra: list[str]) -> None:
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_cpu = opts.device == "cpu"
    if on_cpu:
        from scout_megatron import cpu as megatron_cpu

        megatron_cpu.allow_python_311()
        megatron_cpu.stub_triton_ops()
        torch.distributed.init_process_group("gloo")
        megatron_cpu.on_host()
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import training

    import scout_megatron

    dataset_utils.compile_helpers = lambda: None  # synthetic batches: Megatron's indexed-dataset helpers unused
    tp = 2 if world >= 4 else 1
    te = opts.te and not on_cpu
    sys.argv = ["megatron_check", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
                "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "32000",
                "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "4",
                "--global-batch-size", str(4 * world // tp), "--train-iters", str(opts.iters), "--lr", "1e-4",
                "--tensor-model-parallel-size", str(tp), "--seed", "1234", "--log-interval", "1000",
                "--eval-iters", "0", "--logging-level", "40", "--attention-dropout", "0", "--hidden-dropout", "0",
                *(["--transformer-impl", "transformer_engine", "--bf16"] if te else ["--transformer-impl", "local"]),
                *(["--fp8-format", "hybrid"] if te and opts.fp8 else []),
                *(["--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
                   "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
                   "--no-rope-fusion", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                   "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
                   "--micro-batch-size", "2", "--global-batch-size", str(2 * world // tp)] if on_cpu else []),
                *extra]
    scout_megatron.parse_and_validate_args()
    kept: dict[str, Any] = {}
    setup = training.setup_model_and_optimizer

    def keep(*a: Any, **k: Any) -> Any:
        model, optimizer, scheduler = setup(*a, **k)
        kept["model"] = model
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = keep  # the plugin wraps what it finds, as in any script
    steps: list[float] = []
    if on_cpu:
        from integrations_tests.megatron_cells import _pretrain_on_host
        from scout_core.testing.inject import Fault, Injector

        injector = Injector([Fault.from_dict(f) for f in _faults(opts)], seed=0)
        training.pretrain = _pretrain_on_host({}, injector, rank, 0)
        scout_megatron.pretrain()
    else:
        _install_fault(opts, rank, kept)
        from megatron.core.enums import ModelType

        scout_megatron.pretrain(_datasets, _gpt_model, ModelType.encoder_or_decoder, _timed(_forward_step, steps))
    handle = scout_megatron.entry.last_handle()
    params = [p.detach().float().sum().item() for m in kept["model"] for p in m.parameters()]
    fp8 = [type(m).__name__ for c in kept["model"] for m in c.modules() if getattr(m, "fp8_meta", None)]
    roundtrip = None
    if fp8:  # SCOUT's capture of the FP8 state, put back, captures the same bytes again
        from scout_core.extra_state import capture_extra_states, extra_state_tensors, restore_extra_states
        from scout_core.signature import sign_many

        def signed() -> list[int]:
            return [x.signature for x in sign_many(extra_state_tensors(capture_extra_states(kept["model"][0])))]

        first = signed()
        restore_extra_states(kept["model"][0], capture_extra_states(kept["model"][0]))
        roundtrip = signed() == first
    result = {"rank": rank, "params": params, "iteration_s": steps, "fp8_roundtrip": roundtrip,
              "checks": [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle else [],
              "fp8_modules": sorted(set(fp8))}
    (Path(opts.out) / f"rank-{rank}.json").write_text(json.dumps(result))


def _faults(opts: argparse.Namespace) -> list[dict[str, Any]]:
    if opts.fault_rank < 0:
        return []
    return [{"surface": "layers.1.output", "rank": opts.fault_rank, "kind": "bitflip", "bit": 10, "index": 5,
             "from_step": 1}]


def _install_fault(opts: argparse.Namespace, rank: int, kept: dict[str, Any]) -> None:
    """On the GPU: a bit flip in layer 1's output on ``--fault-rank`` (training and replay alike)."""
    if opts.fault_rank != rank:
        return
    import torch
    from megatron.core.utils import unwrap_model
    from megatron.training import training

    setup = training.setup_model_and_optimizer

    def with_fault(*a: Any, **k: Any) -> Any:
        out = setup(*a, **k)
        layer = unwrap_model(out[0][0]).decoder.layers[1]

        def flip(_m: Any, _a: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                word = torch.int16 if hidden.dtype in (torch.bfloat16, torch.float16) else torch.int32
                hidden.view(-1)[5:6].view(word).bitwise_xor_(1 << 10)

        layer.register_forward_hook(flip)
        return out

    training.setup_model_and_optimizer = with_fault


def _timed(forward_step: Any, steps: list[float]) -> Any:
    import torch

    last = [time.perf_counter()]

    def timed(data_iterator: Any, model: Any) -> Any:
        torch.cuda.synchronize()
        now = time.perf_counter()
        steps.append(now - last[0])
        last[0] = now
        return forward_step(data_iterator, model)

    return timed


def _datasets(sizes: list[int], *_: Any, **__: Any) -> Any:
    import torch
    from megatron.training import get_args

    args = get_args()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n = max(int(n), 1)

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, Any]:
            gen = torch.Generator().manual_seed(i)
            return {"tokens": torch.randint(0, args.vocab_size, (args.seq_length + 1,), generator=gen)}

    return Tokens(sizes[0]), None, None


_datasets.is_distributed = True  # every rank builds it (Megatron's flag for dataset providers)


def _gpt_model(pre_process: bool = True, post_process: bool = True, **_: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    spec = (specs.get_gpt_layer_with_transformer_engine_spec() if args.transformer_impl == "transformer_engine"
            else specs.get_gpt_layer_local_spec())
    return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process)


def _forward_step(data_iterator: Any, model: Any) -> Any:
    import functools

    import torch

    tokens = next(data_iterator)["tokens"].cuda()
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    mask = torch.ones_like(labels, dtype=torch.float)

    def loss(output: torch.Tensor) -> Any:
        total = (output.float().view(-1) * mask.view(-1)).sum()
        n = mask.sum().to(torch.int)
        return total, n, {"lm loss": torch.cat([total.detach().view(1), n.view(1).float()])}

    return model(inputs, positions, None, labels=labels), functools.partial(loss)


# -- the driver -------------------------------------------------------------------------------------


def check_te() -> dict[str, Any]:
    try:
        import torch
        import transformer_engine
        from transformer_engine.pytorch.fp8 import check_fp8_support

        fp8, why = check_fp8_support()
        return {"importable": True, "version": transformer_engine.__version__, "fp8": bool(fp8), "why": why,
                "device": torch.cuda.get_device_name(0), "ok": True}
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"importable": False, "error": f"{type(exc).__name__}: {exc}", "ok": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU; 4 on cpu)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--te", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fp8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fault-rank", type=int, default=-1, help=argparse.SUPPRESS)
    opts, extra = parser.parse_known_args()
    if opts.rank_job:
        _rank_job(opts, extra)
        return
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    if opts.device == "cuda":
        import torch

        nproc = opts.nproc or torch.cuda.device_count()
        results["te"] = check_te()
    else:
        nproc = opts.nproc or 4
    te = results.get("te", {})
    flags = [*(["--te"] if te.get("importable") else []), *(["--fp8"] if te.get("fp8") else []),
             "--iters", str(opts.iters)]
    every = ["--scout", "--scout-replay-cadence-hidden=1", "--scout-replay-cadence-embedding=1",
             "--scout-replay-cadence-output=1", "--scout-replay-cadence-optimizer=1",
             f"--scout-report-jsonl-path={out}/harmless.jsonl"]

    def run(name: str, fn: Any) -> None:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - recorded, the next check runs
            results[name] = {"ok": False, "error": traceback.format_exc()[-4000:]}
        results[name]["wall_s"] = round(time.perf_counter() - start, 1)
        (out / "megatron_check.json").write_text(json.dumps(results, indent=1))

    runs: dict[str, list[dict[str, Any]]] = {}

    def harmless() -> dict[str, Any]:
        runs["plain"] = launch(nproc, out / "plain", flags, opts.device)
        runs["every"] = launch(nproc, out / "every", [*flags, *every], opts.device)
        reported = (out / "harmless.jsonl").read_text().splitlines() if (out / "harmless.jsonl").exists() else []
        checks = runs["every"][0]["checks"]
        same = [r["params"] for r in runs["plain"]] == [r["params"] for r in runs["every"]]
        return {"same_final_params": same, "incidents": reported[:3], "checks": len(checks),
                "skipped": [c for c in checks if c[2]][:3], "ok": same and not reported and bool(checks)
                and not any(c[2] for c in checks)}

    def fp8_state() -> dict[str, Any]:
        first = runs["every"][0]
        return {"fp8_modules": first["fp8_modules"], "snapshot_roundtrip": first["fp8_roundtrip"],
                "ok": first["fp8_roundtrip"] is not False}

    def overhead() -> dict[str, Any]:
        runs["defaults"] = launch(nproc, out / "defaults", [*flags, "--scout"], opts.device)
        skip = 5

        def median(rs: list[dict[str, Any]]) -> float:
            n = min(len(r["iteration_s"]) for r in rs)
            return statistics.median(max(r["iteration_s"][i] for r in rs) for i in range(skip, n)) if n > skip else 0

        base = median(runs["plain"])
        return {"median_iteration_s": {k: round(median(v), 5) for k, v in runs.items()},
                "defaults_overhead": round(median(runs["defaults"]) / base - 1, 4) if base else None,
                "every_iteration_overhead": round(median(runs["every"]) / base - 1, 4) if base else None, "ok": True}

    def fault() -> dict[str, Any]:
        if nproc < 4:
            return {"skipped": f"needs 4 ranks for tensor parallel 2 x data parallel 2, has {nproc}", "ok": True}
        path = out / "fault.jsonl"
        launch(nproc, out / "fault", [*flags, *every[:-1], f"--scout-report-jsonl-path={path}", "--fault-rank", "1"],
               opts.device)
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        # The first verdict names the rank; trained on, the corrupted steps pull rank 1's replica pair's copied
        # parameters apart, and later checks of two replicas can only name the groups (the plugin's README).
        first = (records[0]["kind"], records[0]["scope"], records[0]["ranks"]) if records else None
        return {"first": first, "records": len(records), "ok": first == ("sdc", "rank", [1])}

    run("harmless", harmless)
    if "every" in runs:
        run("fp8_state", fp8_state)
        run("overhead", overhead)
    run("fault", fault)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
