"""SCOUT on a CUDA machine: the checks that need a GPU, as one short script.

    python benchmarks/cuda_check.py --out DIR [--device cuda]

CI has no GPU, so these run by hand on a machine that has one (the figures go
in the "On CUDA" table of docs/benchmarks.md). Each check records its outcome and goes on:

1. the signature fold's throughput beside ``torch.sum`` on the GPU;
2. NCCL as the only default backend (one rank per GPU): ``enable()`` with every
   feature on must train exactly as the run without SCOUT (same final weights),
   under DDP and FSDP2;
3. several ranks on one GPU over ``cuda:gloo`` (NCCL refuses two ranks on one
   device): replay with real peers on CUDA tensors, a clean run reporting
   nothing and a flipped bit on rank 2 localized to rank 2;
4. the observer beside a CUDA-initialized trainer (NCCL when there are two GPUs, else ``cuda:gloo``): a fresh
   interpreter that maps no torch, CUDA or NCCL library, which still names the rank whose training thread
   stops (``actions.on_verdict: stop`` ends the job);
5. step-time overhead of SCOUT at the shipped defaults and with every recipe
   replayed each step, on a model large enough for matrix work to dominate,
   as ratios of median step times within one run.

``--device cpu`` runs the same sequence on the CPU, to try the script out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scout_core.report import read_incidents  # noqa: E402

TRAIN = ROOT / "integrations_tests" / "torchrun_train.py"


def torchrun(nproc: int, out: Path, args: list[str], timeout_s: float) -> list[dict]:
    """Run the example training script under torchrun; each rank's result JSON, in rank order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(TRAIN), "--out", str(out), *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def incidents(out: Path) -> list[tuple]:
    """(kind, scope, ranks, step) of each incident the run recorded."""
    path = out / "incidents.jsonl"
    if not path.exists():
        return []
    return [(i.kind.value, i.scope.value, i.ranks, i.step) for i in read_incidents(path)]


def median_step(results: list[dict], skip: int) -> float:
    """Median over steps (after warm-up) of the slowest rank's step time: a synchronous job runs at that pace."""
    steps = len(results[0]["step_s"])
    return statistics.median(max(r["step_s"][i] for r in results) for i in range(skip, steps))


def check_signature(device: torch.device) -> dict:
    from primitives_bench import bench_signature  # benchmarks/primitives_bench.py, beside this file

    return {"rows": bench_signature(device, 1024 if device.type == "cuda" else 64, 10)}


def check_nccl_harmless(device: torch.device, tmp: Path, layout: str) -> dict:
    backend = "nccl" if device.type == "cuda" else "gloo"
    base = ["--model", "gpt2", "--layout", layout, "--steps", "8", "--device", device.type, "--backend", backend]
    plain = torchrun(1, tmp / f"nccl-{layout}-plain", base, 120)
    scout = torchrun(1, tmp / f"nccl-{layout}-scout", [*base, "--scout"], 120)
    same = plain[0]["params"] == scout[0]["params"]
    return {"backend": backend, "layout": layout, "same_final_weights": same,
            "incidents": len(incidents(tmp / f"nccl-{layout}-scout")), "ok": same}


def check_replay_peers(device: torch.device, tmp: Path) -> dict:
    backend = "cpu:gloo,cuda:gloo" if device.type == "cuda" else "gloo"
    base = ["--model", "gpt2", "--layout", "ddp", "--steps", "8", "--device", device.type, "--backend", backend,
            "--scout"]
    torchrun(4, tmp / "peers-clean", base, 150)
    clean = incidents(tmp / "peers-clean")
    # As the CPU test: block 1 is first sampled at SCOUT step 2 (the script's step 1).
    torchrun(4, tmp / "peers-fault", [*base, "--fault-rank", "2", "--fault-from-step", "1"], 150)
    fault = incidents(tmp / "peers-fault")
    ok = not clean and bool(fault) and fault[0] == ("sdc", "rank", [2], 2) and all(
        f[:3] == ("sdc", "rank", [2]) for f in fault)
    return {"backend": backend, "clean_incidents": clean[:3], "fault_incidents": fault[:5], "ok": ok}


def check_observer_beside_cuda(device: torch.device, tmp: Path) -> dict:
    nccl = device.type == "cuda" and torch.cuda.device_count() >= 2
    backend = "nccl" if nccl else ("cpu:gloo,cuda:gloo" if device.type == "cuda" else "gloo")
    out = tmp / "observer-cuda"
    args = ["--model", "gpt2", "--layout", "ddp", "--steps", "40", "--device", device.type, "--backend", backend,
            "--scout", "--preset", "defaults", "--freeze-rank", "1", "--freeze-step", "6",
            "--scout-set", "actions.on_verdict=stop"]
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        torchrun(2, out, args, 180)  # the stop ends it: the trainers exit non-zero
    facts = [json.loads((out / f"observer-r{r}.json").read_text()) for r in range(2)
             if (out / f"observer-r{r}.json").exists()]
    fresh = len(facts) == 2 and all("scout_core.progress.spawn" in f["cmdline"] and not any(f["maps"].values())
                                    for f in facts)
    named = incidents(out)
    ok = fresh and bool(named) and named[0][:3] == ("hang", "rank", [1])
    return {"backend": backend, "observers": facts, "incidents": named[:3], "fresh_interpreters": fresh, "ok": ok}


def check_overhead(device: torch.device, tmp: Path, nproc: int, steps: int) -> dict:
    backend = ("nccl" if nproc == 1 else "cpu:gloo,cuda:gloo") if device.type == "cuda" else "gloo"
    size = ("medium" if nproc == 1 else "small") if device.type == "cuda" else "tiny"
    base = ["--model", "gpt2", "--layout", "ddp", "--steps", str(steps), "--device", device.type,
            "--backend", backend, "--size", size]
    defaults = [*base, "--scout", "--preset", "defaults"]
    runs = {
        "plain": torchrun(nproc, tmp / f"ovh{nproc}-plain", base, 150),
        "defaults": torchrun(nproc, tmp / f"ovh{nproc}-defaults", defaults, 150),
        "defaults_no_snapshots": torchrun(nproc, tmp / f"ovh{nproc}-nosnap",
                                          [*defaults, "--scout-set", "checkpoint.enabled=false"], 150),
        "every_step": torchrun(nproc, tmp / f"ovh{nproc}-every", [*base, "--scout"], 150),
    }
    skip = 3
    t = {k: median_step(v, skip) for k, v in runs.items()}
    mean = {k: statistics.fmean(max(r["step_s"][i] for r in v) for i in range(skip, steps)) for k, v in runs.items()}
    # Where the time goes: the slowest rank's step times in ms, so periodic costs (a capture or replay every
    # cadence period) can be told from one-time start-up costs.
    per_step_ms = {k: [round(max(r["step_s"][i] for r in v) * 1e3, 1) for i in range(steps)] for k, v in runs.items()}
    return {"ranks": nproc, "backend": backend, "size": size, "steps": steps, "per_step_ms": per_step_ms,
            "median_step_s": {k: round(v, 5) for k, v in t.items()},
            "mean_step_s": {k: round(v, 5) for k, v in mean.items()},
            "defaults_median_overhead": round(t["defaults"] / t["plain"] - 1, 4),
            "defaults_mean_overhead": round(mean["defaults"] / mean["plain"] - 1, 4),
            "defaults_no_snapshots_median_overhead": round(t["defaults_no_snapshots"] / t["plain"] - 1, 4),
            "defaults_no_snapshots_mean_overhead": round(mean["defaults_no_snapshots"] / mean["plain"] - 1, 4),
            "every_step_median_overhead": round(t["every_step"] / t["plain"] - 1, 4),
            "every_step_mean_overhead": round(mean["every_step"] / mean["plain"] - 1, 4),
            "same_final_weights_defaults": runs["defaults"][0]["params"] == runs["plain"][0]["params"],
            "ok": True}


def run_check(name: str, fn: Callable[[], dict], results: dict, log: Path, only: list[str] | None) -> None:
    if only is not None and name not in only:
        return
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # one failing check must not hide the others' figures
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-4000:],
                         "trace": traceback.format_exc()[-3000:]}
    results[name]["wall_s"] = round(time.perf_counter() - start, 1)
    with log.open("a") as f:
        f.write(f"{name}: {json.dumps(results[name])[:2000]}\n")
    print(f"[{name}] ok={results[name].get('ok', True)} in {results[name]['wall_s']} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--overhead-steps", type=int, default=30)
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        }}
    log = args.out / "cuda_check.log"
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checks: dict[str, Callable[[], dict]] = {
            "signature": lambda: check_signature(device),
            "nccl_ddp_harmless": lambda: check_nccl_harmless(device, tmp, "ddp"),
            "nccl_fsdp2_harmless": lambda: check_nccl_harmless(device, tmp, "fsdp2"),
            "replay_peers": lambda: check_replay_peers(device, tmp),
            "observer_beside_cuda": lambda: check_observer_beside_cuda(device, tmp),
            "overhead_1rank": lambda: check_overhead(device, tmp, 1, args.overhead_steps),
            "overhead_4ranks": lambda: check_overhead(device, tmp, 4, args.overhead_steps),
        }
        for name, fn in checks.items():
            run_check(name, fn, results, log, args.only)
    (args.out / "cuda_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1)[:6000])


if __name__ == "__main__":
    main()
