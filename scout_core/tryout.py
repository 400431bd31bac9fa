"""``scout try PLUGIN``: a new user's first run, on this machine's CPUs, with SCOUT on through that plugin.

Each plugin ships a small training script of its framework's own kind (its ``tryout`` module: CPU try-out support,
named as such, that a training job never imports) that trains a small model on CPU ranks over gloo with SCOUT
switched on the way that framework's users switch it on, at SCOUT's shipped settings (a replay check every 20 steps,
one block each in turn), optionally with a fault: ``sdc`` (rank 1 computes one block's output wrongly from step 3,
in training and in replay alike: a defective unit) or ``hang`` (rank 1 stops in Python code at step 4 while its
peers wait in the next collective). This module launches it under ``torchrun``
(the real launcher), then says what SCOUT found, from the records SCOUT wrote: the incident file and the run's
life-cycle records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["FAULT_RANK", "FAULTS", "add_try_parser", "run_tryout", "tryout_arguments"]

FAULTS = ("none", "sdc", "hang")
FAULT_RANK = 1
_EXPECTED = {"none": None, "sdc": "sdc", "hang": "hang"}
_PLAIN = {"sdc": "silent data corruption", "hang": "a hang", "straggler": "a straggler",
          "data_stall": "an input stall", "checkpoint_stall": "a checkpoint stall"}


def tryout_arguments(description: str) -> Any:
    """The arguments ``scout try`` passes to every plugin's try-out script (each adds its own options)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=FAULT_RANK)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def add_try_parser(sub: Any, plugin_group: str) -> None:
    """``scout try``'s arguments, on the ``scout`` command's sub-parsers; plugins are found in ``plugin_group``."""
    tryout = sub.add_parser("try", help="a first run on this machine's CPUs: a small job of a plugin's framework "
                                        "under torchrun, SCOUT on, optionally a fault, and what SCOUT found",
                            epilog="After --, the plugin's try-out options (its model or parallelism: its README).")
    tryout.add_argument("plugin", help="torchtitan, megatron, deepspeed, hf or lightning (see `scout plugins`)")
    tryout.add_argument("--fault", choices=FAULTS, default="sdc",
                        help="sdc: rank 1 computes wrongly from step 3; hang: rank 1 stops at step 4")
    tryout.add_argument("--ranks", type=int, default=4, help="CPU ranks (processes) to train on")
    tryout.add_argument("--steps", type=int, default=100,
                        help="optimizer steps (at SCOUT's shipped cadence, a check every 20 steps, one block each)")
    tryout.add_argument("--out", default="runs/try", help="where each run's records go (a folder per run)")
    tryout.set_defaults(func=lambda args: _command(args, plugin_group))


def _command(args: Any, plugin_group: str) -> int:
    from importlib import metadata

    found = {ep.name: ep for ep in metadata.entry_points(group=plugin_group)}
    if args.plugin not in found:
        print(f"scout try: no plugin {args.plugin!r} is installed (installed: {', '.join(sorted(found)) or 'none'})",
              file=sys.stderr)
        return 2
    try:
        plugin = found[args.plugin].load()
    except Exception as exc:  # noqa: BLE001 - its framework missing or outside the tested range: said plainly
        print(f"scout try: the {args.plugin} plugin cannot be used here: {exc}", file=sys.stderr)
        return 2
    return run_tryout(plugin, fault=args.fault, ranks=args.ranks, steps=args.steps,
                      out=os.path.join(args.out, args.plugin), options=list(getattr(args, "passed", [])))


def run_tryout(plugin: Any, *, fault: str, ranks: int, steps: int, out: str, options: list[str] | None = None,
               timeout_s: float = 600.0) -> int:
    """Run ``plugin``'s try-out under torchrun and report; 0 when SCOUT found what the fault should give (nothing,
    when there is none), 1 otherwise, 2 when it could not run."""
    if not getattr(plugin, "tryout", ""):
        print(f"scout try: the {plugin.name} plugin installed here ships no CPU try-out", file=sys.stderr)
        return 2
    if fault not in FAULTS or ranks < 2 or steps < 5:
        print(f"scout try: --fault is one of {', '.join(FAULTS)}, --ranks at least 2, --steps at least 5",
              file=sys.stderr)
        return 2
    run_dir = Path(out) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=False)
    what = "no fault" if fault == "none" else f"fault {fault} on rank {FAULT_RANK}"
    print(f"scout try {plugin.name}: {plugin.framework} {plugin.framework_version}, {ranks} CPU ranks under torchrun, "
          f"{steps} steps, {what}; records in {run_dir}", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", plugin.tryout, "--fault", fault, "--fault-rank", str(FAULT_RANK), "--steps", str(steps),
           "--out", str(run_dir), *(options or [])]
    # CPU ranks even on a GPU host: the try-out's CPU support refuses where CUDA is visible.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    log = run_dir / "launch.log"
    started = time.monotonic()
    with open(log, "w") as fh:
        try:
            code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                  start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            print(f"scout try: the job ran past {timeout_s:.0f} s and was stopped; its output is in {log}",
                  file=sys.stderr)
            return 2
    elapsed = time.monotonic() - started
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("SCOUT on:"):
            print(line)
            break
    return _report(run_dir, fault, code, elapsed, text)


def _report(run_dir: Path, fault: str, code: int, elapsed: float, text: str) -> int:
    from scout_core.report import read_incidents
    from scout_core.run_log import read_run_log, run_summary

    jsonl = run_dir / "incidents.jsonl"
    incidents = list(read_incidents(jsonl)) if jsonl.exists() else []
    verdicts = [i for i in incidents if i.kind.value in _PLAIN]
    runs = read_run_log(str(run_dir / "incidents.run.jsonl"))
    if not runs:
        print(f"SCOUT did not start (the job exited with status {code}); the launcher's output is in "
              f"{run_dir / 'launch.log'}:\n" + "\n".join(text.splitlines()[-15:]))
        return 2
    print(f"torchrun ended with status {code} after {elapsed:.0f} s")
    summary = next((line.strip() for line in text.splitlines() if "SCOUT stopped this job" in line), "")
    if summary:  # what torchrun's own failure summary says ("Root Cause")
        print(f"torchrun's root cause: {summary.split(':', 1)[1].strip()}")
    for inc in verdicts:
        print(f"SCOUT found {_PLAIN[inc.kind.value]} on rank{'s' if len(inc.ranks) > 1 else ''} "
              f"{', '.join(map(str, inc.ranks))} ({inc.scope.value}): {inc.reason}")
        files = (inc.evidence or {}).get("stack_files") or {}
        for rank, path in sorted(files.items()):
            print(f"  rank {rank}'s stacks at the verdict: {path}" if os.path.exists(path) else
                  f"  rank {rank}'s stacks at the verdict: not written (its observer could not answer)")
    print(run_summary(runs, incidents=len(incidents)))
    expected = _EXPECTED[fault]
    named = {(i.kind.value, tuple(i.ranks)) for i in verdicts}
    if expected is None:
        ok = not verdicts and code == 0
        print("as it should: a clean run, nothing reported" if ok else "NOT as expected: a clean run reported "
              "something, or did not finish")
    else:
        ok = named == {(expected, (FAULT_RANK,))}
        print(f"as it should: SCOUT named rank {FAULT_RANK} and stopped the job" if ok else
              f"NOT as expected: SCOUT should have named rank {FAULT_RANK} ({_PLAIN[expected]}); it reported "
              f"{json.dumps(sorted(named))}")
    print(f"see `scout report {jsonl}` (and --html) for the records")
    return 0 if ok else 1
