"""Certified recovery at the shipped defaults: ``{ddp,fsdp2,hsdp}-recovery-sdc-defaults``.

Every SCOUT key is at its default (cadence 20, the shipped coverage rule, default thresholds, the observer on)
except ``checkpoint.enabled: true``, ``actions.on_verdict: stop`` and where records go. The training loop does not
flush SCOUT after each step: persistence runs behind training, as in a user's loop.

Phase A trains the tiny model in Llama style (two repeated blocks of an RMSNorm and a linear without bias; AdamW
over 6 parameter tensors, so replay's coverage is the optimizer slice's 6 parameters, the two blocks, the
embedding and the head: 6 checks, 120 steps at cadence 20; the ``*-recovery-sdc-defaults`` cells take weight-free
RMSNorms, ``norm_weight: false``: 4 tensors, 4 checks, 80 steps, which shortens the run by a third). A persistent
defect starts in block 1, the block the rotation reaches last, right after the rotation's check of it: one rank's
block 1 flips a bit in its output at every call from then on (training and replay alike). SCOUT's replay finds it
when the rotation comes back to block 1 and stops the job. Phase B (fresh processes, other initial weights) calls
``handle.resume()``.

The verdict on the restore comes from a CLEAN run: the same model, data and seed without the defect and without
SCOUT, up to the step phase B restored. Each rank's restored state (parameters, AdamW state, RNG, caller state) must
equal the clean run's at that step, bitwise; a restore of a state that carries the corruption is a FAIL whatever
generation the product named. The job stops after two whole coverages, so restoring nothing is a FAIL too (a
certification that never completes would otherwise pass).
The guard runs the cell with ``checkpoint.certify: last_check_only`` (the paper's K = 1 rule): a capture after the
defect's onset is verified by a clean check of another block and restored, and the cell turns red. The guard
flushes after every step (``flush_each_step``): behind a loaded machine's training the captures of steps 140-180
may not be durable yet at the stop, and K = 1 then restores step 120, clean by luck (seen in one guard run).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch

from integrations_tests.models import batches, start_rank
from integrations_tests.recovery_cells import STOP_CODE, _phase_a, _phase_b, _Tokens, recovery_report, state_signatures
from scout_core.checkpoint.coordinator import read_records
from scout_core.checkpoint.memory import default_memory_root
from scout_core.report import read_incidents
from scout_core.testing.cells import CellReport, CellSpec
from scout_core.testing.launcher import RankContext, launch


def _clean(ctx: RankContext) -> dict[str, Any]:
    """The reference: the same training without the defect and without SCOUT, signed at ``until``."""
    a, _, par, opt = start_rank(ctx, timeout_s=600)
    tokens = _Tokens()
    loss_fn = torch.nn.MSELoss()
    for x, y in batches(ctx.rank, a["until"], seed=a["seed"]):
        loss_fn(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        tokens.seen += x.shape[0]
    return state_signatures(par, opt, tokens.state_dict())


# What the clean run reads of a cell's arguments: cells that agree on these share one reference run (in one
# parent process, as under `scout cells matrix`), e.g. the DDP recovery cells restoring the same step.
_REFERENCE_KEYS = ("seed", "layout", "replicas", "hidden", "bias", "norm_weight", "depth")
_references: dict[str, list[dict[str, Any]]] = {}


def _clean_reference(args: dict[str, Any], world_size: int, timeout_s: float,
                     until: int) -> tuple[list[dict[str, Any]], str]:
    """Each rank's state signatures in the clean run at ``until``, and what went wrong if the run failed."""
    key = json.dumps([world_size, until, [args.get(k) for k in _REFERENCE_KEYS]])
    if key not in _references:
        clean = launch(_clean, world_size, timeout_s=timeout_s, args={**args, "faults": [], "until": until})
        if not clean.ok:
            return [], clean.failures()
        _references[key] = clean.values()
    return _references[key], ""


def stop_and_restart(faults: list[Any], *, layout: str, steps: int, world_size: int, workdir: str, run_id: str,
                     seed: int = 0, certify: str = "coverage", timeout_s: float = 300.0,
                     replicas: int = 4, norm_weight: bool = True, flush: bool = False) -> dict[str, Any]:
    """Phase A (the faults, shipped defaults, stop on a verdict), then phase B (``resume()`` in fresh processes):
    the exit codes, what each rank restored, the incident and decision records."""
    args = {
        "faults": faults, "seed": seed, "layout": layout, "steps": steps, "replicas": replicas,
        "incidents": os.path.join(workdir, "incidents.jsonl"), "store": os.path.join(workdir, "store"),
        "workdir": workdir, "run_id": run_id, "failure": None, "kill_step": None, "flush": flush,
        "defaults": True, "bias": False, "norm_weight": norm_weight, "depth": 2, "ref_every": 0, "replicate": True,
        "overrides": [f"checkpoint.certify={certify}"],
        "defect_persists": True,  # the restart runs on the same machines: a defective unit is still there
    }
    out: dict[str, Any] = {"args": args, "values": [], "problems": []}
    memory_root = default_memory_root(args["store"])
    try:
        a_result = launch(_phase_a, world_size, timeout_s=timeout_s, args=args)
        out["codes"] = sorted({o.exitcode for o in a_result.outcomes})
        if out["codes"] != [STOP_CODE]:
            out["problems"].append(f"phase A should stop every trainer with exit {STOP_CODE}: exits {out['codes']}\n"
                                   + a_result.failures())
        b_result = launch(_phase_b, world_size, timeout_s=timeout_s, args=args)
        if b_result.ok:
            out["values"] = b_result.values()
        else:
            out["problems"].append("phase B: " + b_result.failures())
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
    out["incidents"] = list(read_incidents(args["incidents"])) if os.path.exists(args["incidents"]) else []
    out["decisions"] = read_records(os.path.join(args["store"], "decisions.jsonl"))
    return out


def recovery_defaults_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    p = spec.params
    expect = p["expect"]
    start = time.monotonic()
    run = stop_and_restart(list(spec.faults), layout=p["layout"], steps=int(p["steps"]), world_size=world_size,
                           workdir=workdir, run_id=spec.name, seed=spec.seed, certify=p.get("certify", "coverage"),
                           timeout_s=spec.timeout_s, norm_weight=bool(p.get("norm_weight", True)),
                           flush=bool(p.get("flush_each_step", False)))
    problems, incidents, decisions = run["problems"], run["incidents"], run["decisions"]
    got_inc = sorted({(i.kind.value, i.scope.value, tuple(sorted(i.ranks))) for i in incidents})
    want_inc = sorted({(i["kind"], i["scope"], tuple(i["ranks"])) for i in expect["incidents"]})
    if got_inc != want_inc:
        problems.append(f"incidents {got_inc}, expected {want_inc}")
    if run["values"]:
        problems += judge_restore(run["values"], decisions, run["args"], world_size, spec.timeout_s,
                                  expect_restore=expect.get("restores", True))
    return recovery_report(spec, world_size, problems, incidents, decisions, start)


def judge_restore(values: list[dict[str, Any]], decisions: list[dict[str, Any]], args: dict[str, Any],
                   world_size: int, timeout_s: float, *, expect_restore: bool = True) -> list[str]:
    """The restored state against the clean run's at the restored step (every rank, bitwise)."""
    got = {(v["source"], v["generation"]) for v in values}
    if len(got) != 1:
        return [f"ranks restored different things: {sorted(got, key=str)}"]
    source, generation = next(iter(got))
    stop = next((d for d in decisions if d.get("record") == "decision"), None)
    if generation is None:
        verified = (stop or {}).get("certifier", {}).get("verified")
        if verified is not None:
            return [f"nothing restored though verified {verified} existed at the stop"]
        # The cells stop after two whole coverages: a run where nothing became verified lost certification.
        return [] if not expect_restore else ["nothing restored: no generation was ever verified in this run"]
    problems = [] if source == "verified" else [
        f"restored {source} {generation} though the state carried a defect (expected a verified generation)"]
    reference, failure = _clean_reference(args, world_size, timeout_s, generation)
    if failure:
        return problems + ["the clean reference run failed: " + failure]
    bad = {r: [k for k, want in ref.items() if want != values[r]["got"][k]] for r, ref in enumerate(reference)}
    bad = {r: keys for r, keys in bad.items() if keys}
    if bad:
        problems.append(f"the restored {source} step {generation} is not the clean run's state at that step (it "
                        f"carries the corruption) on ranks {sorted(bad)}: {json.dumps(bad)[:300]}")
    return problems
