"""SDC campaign at the shipped defaults: what replay localizes, how soon, and whom it never blames.

``nox -s campaign``. Each job is a training run (DDP, FSDP2, or HSDP with shard groups of 2; 6 or 8 ranks, drawn
per job) with SCOUT switched on by ``scout_core.enable`` at every replay and consensus setting as shipped: a check
every 20 steps, one of the 3 blocks per check in rotation (a rotation is 3 x 20 = 60 steps), the embedding, the
head and the optimizer slice at every check. Only the hang observer is off (the hang cells test it).

A job runs a sequence of defects, each drawn from the job's seed:

* a rank;
* a unit and what of it errs: the embedding, a block or the head computing a wrong output, a wrong input gradient
  (not the embedding: its input is token data), or reading a stuck weight element; or the optimizer kernel
  writing a wrong weight;
* 1 to 4 flipped bits of one element (a stuck weight reads a drawn value);
* an onset 1 to 60 clean steps after the previous defect, so it falls at any phase of the rotation.

The defect lives where a defective unit would put it (hooks on the model's modules, a wrapper of torch's AdamW
kernel) and errs on every call from its onset, in training and in whatever replay happens to run it. Nothing aims
it at what a check samples. Its window ends two rotations (120 steps) after the onset, or earlier at the first
check after which some rank holds an SDC verdict (any rank named: the harness only saves steps, it never
classifies). Then every rank rolls its weights and optimizer state back to the window's start, so each defect
starts from a healthy model, as on a fresh job.

Classified from the incident records alone (``classify``):

* localized: the window's first ``sdc`` record names exactly the defective rank, scope rank; "on its unit" when
  one of its surfaces belongs to the defective unit; time to verdict = its step minus the onset;
* missed: no ``sdc`` record in the window;
* mislocalized: the first ``sdc`` record names another rank, or several;
* false positive: a record naming a rank in a clean gap, or naming another rank than the defective one in a
  window. Clean checks are the checks that ran in the clean gaps.

    python -m integrations_tests.campaign --out benchmarks/campaign.json [--readme README.md]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import scout_core  # noqa: E402
from integrations_tests.campaign_report import classify, markdown, summarize, write_block  # noqa: E402
from integrations_tests.models import batches, install_optimizer_kernel_fault, start_rank  # noqa: E402
from scout_core.config import load  # noqa: E402
from scout_core.config_schema import ReplayCadence  # noqa: E402
from scout_core.report import read_incidents  # noqa: E402
from scout_core.testing.inject import Fault, Schedule  # noqa: E402
from scout_core.testing.launcher import RankContext, launch, prepare_parent  # noqa: E402

DEPTH = 3
INTERVAL = ReplayCadence().hidden
ROTATION = DEPTH * INTERVAL
"""Steps for the sampled block to come back to the same block: every block is checked once per rotation."""
MAX_WINDOW = 2 * ROTATION
MODULES = ["embed", "layers.0", "layers.1", "layers.2", "head"]
WHATS = ["output", "grad", "weight", "update"]
STUCK_VALUES = [0.0, 1.0, -2.0, 100.0]


def plan(job: int, defects: int, layouts: list[str], worlds: list[int]) -> dict[str, Any]:
    """A job's layout, world size and defects (each with its clean gap before the onset)."""
    rng = random.Random(f"campaign-{job}")
    layout = layouts[job % len(layouts)]
    world = rng.choice(worlds)
    out = []
    for _ in range(defects):
        what = rng.choice(WHATS)
        module = "optimizer" if what == "update" else rng.choice(MODULES[1:] if what == "grad" else MODULES)
        d = {"gap": rng.randint(1, ROTATION), "rank": rng.randrange(world), "module": module, "what": what}
        if what == "weight":
            d |= {"value": rng.choice(STUCK_VALUES), "index": rng.randrange(256)}  # every weight has >= 256
        else:
            d["bits"] = sorted(rng.sample(range(32), rng.choice([1, 1, 2, 3, 4])))
        out.append(d)
    return {"layout": layout, "world": world, "replicas": world // 2, "defects": out}


def faults_of(defect: dict[str, Any], onset: int) -> list[Fault]:
    """The defect as faults active from ``onset`` on: several bits of one surface at one step hit one element."""
    schedule = Schedule.from_step(onset)
    if defect["what"] == "update":
        surface = "optimizer.kernel.output"  # the weight the kernel writes: a flip of the update can round away
    else:
        surface = f"{defect['module']}.{defect['what']}"
    if defect["what"] == "weight":
        return [Fault(surface=surface, rank=defect["rank"], kind="set", value=defect["value"], index=defect["index"],
                      schedule=schedule)]
    return [Fault(surface=surface, rank=defect["rank"], kind="bitflip", bit=b, schedule=schedule)
            for b in defect["bits"]]


def _install(par: Any, injector: Any, rank: int, state: dict[str, Any]) -> None:
    """Output, input-gradient and weight-read defects on the embedding, each block's linear layer and the head;
    the optimizer kernel's defect in torch's AdamW."""
    inner = par.inner
    targets = {"embed": inner.embed, "head": inner.head,
               **{f"layers.{i}": block.fc for i, block in enumerate(inner.layers)}}
    for name, module in targets.items():
        def weight_fault(mod: Any, _a: Any, name: str = name) -> None:
            # A stuck element of this rank's weight as its compute reads it: the replica under DDP, the unsharded
            # buffer after every all-gather under FSDP2 / HSDP.
            with torch.no_grad():
                injector.corrupt(f"{name}.weight", mod.weight, rank=rank, step=state["step"])

        def out_fault(_m: Any, _a: Any, out: torch.Tensor, name: str = name) -> None:
            with torch.no_grad():
                injector.corrupt(f"{name}.output", out, rank=rank, step=state["step"])

        def grad_fault(_m: Any, grad_input: Any, _g: Any, name: str = name) -> Any:
            if grad_input[0] is None:
                return None
            g = grad_input[0].clone()
            injector.corrupt(f"{name}.grad", g, rank=rank, step=state["step"])
            return (g,)

        module.register_forward_pre_hook(weight_fault)
        module.register_forward_hook(out_fault)
        if name != "embed":  # its input (token data) takes no gradient: nothing to corrupt in its backward
            module.register_full_backward_hook(grad_fault)
    install_optimizer_kernel_fault(injector, rank, state)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _save(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """This rank's weights (local shards) and optimizer state before a defect's window."""
    return ([_local(p).detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))


def _restore(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: tuple[list[torch.Tensor], Any]) -> None:
    """Back to the state before the window, localized or not: a defect that wrecks training (an exponent bit)
    would otherwise leave the next defect a saturated model."""
    weights, opt_state = saved
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights, strict=True):
            _local(p).copy_(w)
    opt.load_state_dict(copy.deepcopy(opt_state))


def _sdc_held(engine: Any, step: int) -> bool:
    """Whether any rank holds an SDC verdict from a check at ``step`` (one world all-reduce, on check steps
    only: every rank runs the same checks, so every rank joins)."""
    last = engine.history[-1] if engine.history else None
    if last is None or last.step != step:
        return False
    mine = any(i.kind.value == "sdc" for i in [*last.incidents, *last.incidents_global])
    flag = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _job(ctx: RankContext) -> dict[str, Any]:
    a, injector, par, opt = start_rank(ctx, timeout_s=900)
    state: dict[str, Any] = {"step": 0}
    _install(par, injector, ctx.rank, state)
    cfg = load(None, ["observer.enabled=false", f"report.jsonl_path={a['jsonl']}", f"report.run_id={a['run_id']}",
                      "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh)
    engine = handle.replay
    # Replicas see different data; under HSDP the shard ranks of one replica see the same batch.
    data_rank = ctx.rank // (ctx.world_size // a["replicas"]) if a["layout"] == "hsdp" else ctx.rank
    data = batches(data_rank, 1 << 30, seed=a["seed"])
    loss_fn = torch.nn.MSELoss()

    def train_step() -> int:
        state["step"] += 1
        x, y = next(data)
        loss_fn(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return state["step"]

    windows = []
    for defect in a["defects"]:
        for _ in range(defect["gap"]):
            train_step()
        onset = state["step"] + 1
        saved = _save(par.model, opt)
        injector.faults[:] = faults_of(defect, onset)
        while True:
            step = train_step()
            if _sdc_held(engine, step) or step - onset + 1 >= MAX_WINDOW:
                break
        injector.clear()
        _restore(par.model, opt, saved)
        windows.append((onset, step))
    for _ in range(a["tail"]):
        train_step()
    dist.barrier()
    checks = [r.step for r in engine.history if r.recipes and not r.skipped]
    skipped = [(r.step, r.skipped) for r in engine.history if r.skipped]
    handle.close()
    return {"windows": windows, "checks": checks, "skipped": skipped, "steps": state["step"]}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run(jobs: int, defects: int, layouts: list[str], worlds: list[int], tail: int,
        only: list[int] | None = None) -> dict[str, Any]:
    """``jobs`` jobs (or the listed ones of them) of ``defects`` defects each."""
    prepare_parent()
    summary: dict[str, Any] = {"commit": _commit(), "interval": INTERVAL, "rotation_steps": ROTATION,
                               "max_window_steps": MAX_WINDOW, "defects_per_job": defects, "jobs": []}
    for job in only if only is not None else range(jobs):
        p = plan(job, defects, layouts, worlds)
        with tempfile.TemporaryDirectory() as tmp:
            jsonl = os.path.join(tmp, "incidents.jsonl")
            start = time.monotonic()
            result = launch(_job, p["world"], timeout_s=3600, args={
                "faults": [], "defects": p["defects"], "seed": job, "layout": p["layout"], "replicas": p["replicas"],
                "tail": tail, "jsonl": jsonl, "run_id": f"campaign-{job}"})
            wall = time.monotonic() - start
            if not result.ok:
                raise RuntimeError(f"job {job} ({p['layout']}, {p['world']} ranks) failed:\n{result.failures()}")
            incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
        ran = result.values()[0]
        rows = classify(p["defects"], ran["windows"], incidents, ran["checks"], ran["steps"])
        summary["jobs"].append({"job": job, "commit": summary["commit"], "layout": p["layout"], "world": p["world"],
                                "wall_s": round(wall, 1),
                                "steps": ran["steps"], "skipped_checks": ran["skipped"], **rows})
        print(f"job {job} {p['layout']}x{p['world']}: {rows['localized']}/{rows['defects']} localized, "
              f"{rows['mislocalized']} mislocalized, {rows['false_positive']} false positives over "
              f"{rows['clean_checks']} clean checks, {ran['steps']} steps in {wall:.0f} s", flush=True)
        for detail in rows["details"]:
            print(f"  {json.dumps(detail)}", flush=True)
    return summarize(summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/campaign.json")
    parser.add_argument("--readme", help="rewrite the campaign block of this README")
    parser.add_argument("--layouts", default="ddp,fsdp2,hsdp")
    parser.add_argument("--worlds", default="6,8", help="world sizes drawn per job")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--defects", type=int, default=25, help="defects per job")
    parser.add_argument("--only", help="run only these jobs (comma-separated numbers)")
    parser.add_argument("--table", metavar="JSON", help="run nothing: print (and with --readme write) the tables of "
                                                        "this earlier run's JSON")
    parser.add_argument("--tail", type=int, default=MAX_WINDOW, help="clean steps after the last defect")
    args = parser.parse_args()
    only = [int(j) for j in args.only.split(",")] if args.only else None
    if args.table:
        with open(args.table) as fh:
            summary = summarize(json.load(fh))
    else:
        summary = run(args.jobs, args.defects, args.layouts.split(","), [int(w) for w in args.worlds.split(",")],
                      args.tail, only)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2)
    table = markdown(summary)
    print(table)
    if args.readme:
        write_block(args.readme, "campaign", table)
    t = summary["total"]
    return 0 if t["mislocalized"] == 0 and t["false_positive"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
