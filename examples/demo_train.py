"""The demo's training script: a small Llama-style transformer under DDP, SCOUT on with every feature, started
by ``torchrun --max-restarts 1`` (examples/demo.py does that).

The only SCOUT lines are ``scout_core.enable(...)``, ``handle.resume()`` and ``handle.close()``. On its first
attempt rank ``--fault-rank`` computes with a defective unit from step ``--fault-step`` (one mantissa bit of one
attention output flipped, in training and in replay alike). SCOUT's replay names that rank, certification keeps
the last verified checkpoint, and ``actions.on_verdict: stop`` ends every trainer with status 75; torchrun starts
the job again, ``handle.resume()`` restores the verified checkpoint and training goes on to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file by torchrun
    sys.path.insert(0, str(ROOT))

import scout_core  # noqa: E402
from integrations_tests.zoo import build_zoo_model, zoo_batches  # noqa: E402
from scout_core.config import load  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fault-rank", type=int, default=9)
    p.add_argument("--fault-step", type=int, default=120)
    p.add_argument("--ranks-per-host", type=int, default=8, help="simulated machines of this many ranks")
    return p.parse_args()


def install_fault(model: nn.Module, state: dict[str, int], from_step: int) -> None:
    """A defective unit: from ``from_step`` every attention output projection this rank computes has one
    mantissa bit flipped (in training and in replay alike), whichever block SCOUT samples."""

    def flip(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
        if state["step"] >= from_step:
            with torch.no_grad():
                out.view(torch.int32).view(-1)[0] ^= 1 << 22

    for block in model.layers:
        block.o_proj.register_forward_hook(flip)


def progress(step: int, total: int, started: float, note: str) -> None:
    done = int(30 * step / total)
    rate = step / max(time.monotonic() - started, 1e-6)
    print(f"\r  [{'#' * done}{'.' * (30 - done)}] step {step:4d}/{total} {rate:5.1f} steps/s {note:<40}",
          end="", flush=True)


def main() -> None:
    args = parse_args()
    # Plain init: `import scout_core` above keeps each restart attempt's rendezvous apart (torch 2.13's torchrun
    # reuses one store across attempts: scout_core/restart_rendezvous.py).
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["SCOUT_HOSTNAME"] = f"node{rank // args.ranks_per_host}"  # simulated machines
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    inner = build_zoo_model("llama", 0, "tiny")
    state = {"step": 0}
    if rank == args.fault_rank and attempt == 0:
        install_fault(inner, state, args.fault_step)
    model = nn.parallel.DistributedDataParallel(inner)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = load(None, [
        # The optimizer recipe is off so that certification's coverage is the three blocks, the embedding and the
        # head (30 steps): a short demo reaches a verified checkpoint under the shipped rule (docs/recovery.md).
        "replay.cadence.hidden=10", "replay.cadence.embedding=10", "replay.cadence.output=10",
        "replay.cadence.optimizer=0",
        "checkpoint.enabled=true", f"checkpoint.directory={args.out}/checkpoints",
        f"checkpoint.memory_dir={args.out}/memory",  # a fresh demo never meets an earlier one's snapshots
        "actions.on_verdict=stop",
        f"report.jsonl_path={args.out}/incidents.jsonl", "report.run_id=scout-demo", "report.log_level=ERROR",
        f"report.prometheus.textfile_dir={args.out}/metrics",
        f"control.directory={args.out}/control",
    ])
    handle = scout_core.enable(model, optimizer, config=cfg)
    resumed = handle.resume()
    if rank == 0 and resumed.step is not None:
        print(f"\n  restart {attempt}: restored the {resumed.source} checkpoint of step {resumed.step} "
              f"({resumed.reason})", flush=True)
    batches = list(zoo_batches(rank, args.steps, seed=0))
    started = time.monotonic()
    model.train()
    for step in range(resumed.next_step, args.steps):
        state["step"] = step
        input_ids, labels = batches[step]
        model(input_ids, labels=labels).loss.backward()
        optimizer.step()  # SCOUT's boundary runs here; a verdict with on_verdict: stop exits with status 75
        optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            note = f"fault injected on rank {args.fault_rank}" if attempt == 0 and step >= args.fault_step else ""
            progress(step + 1 - resumed.next_step, args.steps - resumed.next_step, started, note)
    handle.close(discard_snapshots=True)
    if rank == 0:
        print(flush=True)
        (args.out / "done.json").write_text(json.dumps({"attempt": attempt, "resumed_from": resumed.step,
                                                        "source": resumed.source, "world": world}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
