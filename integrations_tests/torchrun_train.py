"""An ordinary torchrun training script with SCOUT switched on by ``--scout``.

It shows how a user integrates SCOUT: the training loop is unchanged, and the
only additions are ``scout_core.enable(...)`` after the optimizer exists and
``handle.close()`` at the end. ``--fault-rank``/``--fault-from-step`` model a
faulty device (one flipped mantissa bit in a block's output on one rank), and
each rank's final parameter and RNG digests let a test compare runs.

    torchrun --standalone --nproc-per-node 4 integrations_tests/torchrun_train.py \\
        --model gpt2 --layout ddp --steps 12 --out DIR [--scout] [--fault-rank R --fault-from-step S]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):  # run as a file by torchrun: make ``integrations_tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integrations_tests.zoo import SIZES, ZOO, blocks, build_zoo_model, zoo_batches  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=ZOO, default="gpt2")
    p.add_argument("--layout", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scout", action="store_true")
    p.add_argument("--fault-rank", type=int, default=None)
    p.add_argument("--fault-from-step", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--freeze-rank", type=int, default=None, help="this rank's training thread stops ...")
    p.add_argument("--freeze-step", type=int, default=4, help="... at the start of this step (a hang)")
    p.add_argument("--sigterm-sets-a-flag", action="store_true",
                   help="SIGTERM only sets a flag read between steps, as Megatron's --exit-signal-handler does")
    p.add_argument("--scout-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra SCOUT config overrides (e.g. actions.on_verdict=stop)")
    p.add_argument("--preset", choices=("every-step", "defaults"), default="every-step",
                   help="every-step: every replay recipe each step or two; defaults: the shipped cadences")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", default="gloo", help='process-group backend, e.g. "nccl" or "cpu:gloo,cuda:nccl"')
    p.add_argument("--size", choices=SIZES, default="tiny")
    return p.parse_args(argv)


def wrap(model: nn.Module, layout: str, device: torch.device) -> tuple[nn.Module, Any]:
    """DDP, or FSDP2 with each block sharded on its own and then the root, over a 1-D ``dp_shard`` mesh."""
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model), None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def install_fault(block: nn.Module, state: dict[str, int], from_step: int) -> None:
    """From ``from_step`` on, flip bit 22 (top mantissa bit) of element 0 of the block's attention output
    projection, as a defective unit would in every computation of the block (training and replay alike:
    FSDP2 replay calls the block's forward directly, but its children's hooks still run)."""
    proj = block.c_proj if hasattr(block, "c_proj") else block.o_proj

    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        if state["step"] >= from_step:
            with torch.no_grad():
                output.view(torch.int32).view(-1)[0] ^= 1 << 22

    proj.register_forward_hook(hook)


def digest(t: torch.Tensor) -> str:
    local = t.to_local() if hasattr(t, "to_local") else t
    return hashlib.sha256(local.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if args.device == "cuda":
        # Ranks share the visible GPUs round-robin (one GPU can host several gloo ranks, not NCCL ones).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    inner = build_zoo_model(args.model, args.seed, args.size).to(device)
    state = {"step": 0}
    if args.sigterm_sets_a_flag:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: state.__setitem__("exit_requested", 1))
    if args.fault_rank == rank:
        install_fault(blocks(inner)[1], state, args.fault_from_step)
    model, mesh = wrap(inner, args.layout, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    handle = None
    if args.scout:
        import scout_core
        from scout_core.config import load

        # Every feature on: hang observer, replay of every recipe, certified snapshots with peer replicas. The
        # every-step preset proves the launcher's path in a few steps: each capture after a layer check is verified
        # (last_check_only); the defaults preset keeps the shipped coverage rule.
        every_step = [
            "replay.cadence.embedding=2", "replay.cadence.hidden=1", "replay.cadence.output=2",
            "replay.cadence.optimizer=2", "observer.silence_threshold_s=30", "checkpoint.certify=last_check_only",
        ] if args.preset == "every-step" else []
        cfg = load(None, [
            *every_step,
            "checkpoint.enabled=true", f"checkpoint.directory={args.out}/checkpoints",
            f"report.jsonl_path={args.out}/incidents.jsonl", "report.log_level=ERROR", *args.scout_set,
        ])
        handle = scout_core.enable(model, optimizer, config=cfg, mesh=mesh)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"observer-r{rank}.json").write_text(json.dumps(observer_facts(handle.observer_pid)))
        handle.resume()  # a fresh start here; after a crash it restores the certified checkpoint

    model.train()  # dropout on: replays must reproduce the RNG draws too
    loss = torch.tensor(float("nan"))
    dims = SIZES[args.size]
    batches = zoo_batches(rank, args.steps, seq=dims["seq"], vocab=dims["vocab"], seed=args.seed)
    step_s = []
    for step, (input_ids, labels) in enumerate(batches):
        state["step"] = step
        if args.freeze_rank == rank and step == args.freeze_step:
            while True:  # the training thread stops; the process and its peers' collectives stay up
                time.sleep(3600)
        start = time.perf_counter()
        loss = model(input_ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - start)

    if handle is not None:
        handle.close(discard_snapshots=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "params": [digest(p) for _, p in model.named_parameters()],
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()
                              + (torch.cuda.get_rng_state(device).numpy().tobytes() if device.type == "cuda"
                                 else b"")).hexdigest(),
        "loss": loss.item(),
        "step_s": step_s,
    }
    (args.out / f"rank-{rank}.json").write_text(json.dumps(result, indent=1))
    # The model (DDP's reducer, FSDP's state) holds the process group: released here, the group's C++ threads are
    # joined inside destroy_process_group while the interpreter is whole, not during its teardown, where gloo's
    # worker threads can abort the process ("terminate called without an active exception", seen once in CI).
    del model, optimizer, inner, mesh, handle, loss  # the loss's graph holds FSDP2's state too
    gc.collect()
    dist.destroy_process_group()


def observer_facts(pid: int | None) -> dict:
    """What this rank's observer process is: its command line, and which of the trainer's libraries it maps (a
    fresh interpreter maps no torch, CUDA or NCCL; a fork of a CUDA trainer maps them all)."""
    if pid is None:
        return {}
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        cmdline = fh.read().replace(b"\0", b" ").decode()
    with open(f"/proc/{pid}/maps") as fh:
        maps = fh.read()
    return {"pid": pid, "cmdline": cmdline,
            "maps": {lib: lib in maps for lib in ("libtorch", "libcuda", "libnccl", "libcudart")}}


if __name__ == "__main__":
    main()
