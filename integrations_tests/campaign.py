"""SDC campaign: what replay covers, and how sensitive it is, over hundreds of faults (``nox -s campaign``).

Each job is a 16-rank training run (DDP, FSDP2 or HSDP 4x4) with SCOUT switched on by ``scout_core.enable``
alone: replay checks of the hidden, embedding and output recipes every step (interval I = 1), the shipped
consensus defaults, the engine choosing which block it samples (it rotates over L = 3 blocks by itself).

Faults live in the model, as a defective unit would: hooks on a module of one rank corrupt what that module
computes whenever that rank computes it (training, and a replay of it if the engine happens to sample that
module while the fault is active). Nothing aims a fault at the block a check samples. A job runs a sequence
of fault windows of ``L x I`` steps, each followed by one clean step; in each window ONE fault, drawn from the
job's seed, is active on one rank. At the end of a window every rank rolls its weights and optimizer state back
to the window's start, detected or not: each window starts from a healthy model, as the next job of a sweep
would. Without it one fault that wrecks training (an exponent bit) saturates the model and later faults vanish
into zero gradients. A fault that fires while the engine happens to replay its module also fires inside the
replay: it is a defect of the unit, not of one call.

* module: the embedding, any of the 3 blocks, or the head; forward output or backward (gradient);
* one bit (of 0..31 of an fp32 value) or several bits (2-4) of one element;
* persistent (every step of its window) or intermittent (every other step).

Classified from the incident records of the window:

* localized: the first record is an ``sdc`` of scope rank naming exactly the faulty rank, on a surface of the
  faulty module; time to verdict = its step minus the window's first step;
* missed: no record in the window;
* mislocalized: anything else (another rank, no majority, the wrong module).

Two numbers per layout: **replay coverage**, persistent faults localized within their window (one full
rotation, L x I steps) out of all persistent faults; and **detection sensitivity**, faults localized out of
those that fired inside a replayed computation (the only ones replay can see: an SDC in training alone is
averaged into every replica's weights alike). Clean steps and the steps before the first fault must produce no
record (false positives).

    python -m integrations_tests.campaign --out benchmarks/campaign.json [--readme README.md]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
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
from integrations_tests.models import batches, start_rank  # noqa: E402
from scout_core.config import load  # noqa: E402
from scout_core.report import read_incidents  # noqa: E402
from scout_core.testing.inject import Fault, Schedule  # noqa: E402
from scout_core.testing.launcher import RankContext, launch, prepare_parent  # noqa: E402

DEPTH = 3
INTERVAL = 1
WINDOW = DEPTH * INTERVAL  # one full rotation of the sampled block
MODULES = ["embed", "layers.0", "layers.1", "layers.2", "head"]
SURFACE_OF = {"embed": "embedding.", "head": "output.", "layers.0": "layers.0.", "layers.1": "layers.1.",
              "layers.2": "layers.2."}
"""How the replay names each module's surfaces (the embedding and output recipes, the sampled blocks)."""


def plan(layout: str, job: int, faults: int, world: int) -> list[dict[str, Any]]:
    """The job's fault windows: ``faults`` windows of WINDOW steps, each followed by a clean step, after a
    clean warm-up step."""
    rng = random.Random(f"{layout}-{job}")
    out = []
    step = 2
    for _ in range(faults):
        bits = rng.sample(range(32), rng.choice([1, 1, 2, 3, 4]))
        module = rng.choice(MODULES)
        # The embedding's input (token data) takes no gradient: its backward has nothing to corrupt.
        where = "output" if module == "embed" else rng.choice(["output", "grad"])
        out.append({"start": step, "stop": step + WINDOW, "rank": rng.randrange(world), "module": module,
                    "where": where, "bits": bits, "persistent": rng.random() < 0.5})
        step += WINDOW + 1
    return out


def job_steps(windows: list[dict[str, Any]]) -> int:
    return windows[-1]["stop"] if windows else 1


def _faults(windows: list[dict[str, Any]]) -> list[Fault]:
    out = []
    for w in windows:
        steps = range(w["start"], w["stop"]) if w["persistent"] else range(w["start"], w["stop"], 2)
        for step in steps:
            for bit in w["bits"]:  # several faults on one surface and step hit the same element
                out.append(Fault(surface=f"{w['module']}.{w['where']}", rank=w["rank"], kind="bitflip", bit=bit,
                                 schedule=Schedule.once(step)))
    return out


def _install(par: Any, injector: Any, rank: int, state: dict[str, Any]) -> None:
    """Forward-output and backward faults on the embedding, each block's linear layer and the head; each
    firing is logged with whether it happened inside a replay."""
    inner = par.inner
    targets = {"embed": inner.embed, "head": inner.head,
               **{f"layers.{i}": block.fc for i, block in enumerate(inner.layers)}}
    for name, module in targets.items():
        def out_fault(_m: Any, _a: Any, out: torch.Tensor, name: str = name) -> None:
            with torch.no_grad():
                if injector.corrupt(f"{name}.output", out, rank=rank, step=state["step"]):
                    state["fired"].append((state["step"], _replaying(state)))

        def grad_fault(_m: Any, grad_input: Any, _g: Any, name: str = name) -> Any:
            if grad_input[0] is None:
                return None
            g = grad_input[0].clone()
            if injector.corrupt(f"{name}.grad", g, rank=rank, step=state["step"]):
                state["fired"].append((state["step"], _replaying(state)))
            return (g,)

        module.register_forward_hook(out_fault)
        if name != "embed":  # its input (token data) takes no gradient: nothing to corrupt in its backward
            module.register_full_backward_hook(grad_fault)


def _save(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """This rank's weights (local shards) and optimizer state before a fault window."""
    return ([_local(p).detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))


def _restore(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: tuple[list[torch.Tensor], Any]) -> None:
    """Back to the state before the window (detected or not): a fault that wrecks training (an exponent bit of
    the loss) would otherwise saturate the model and mask every later window's fault."""
    weights, opt_state = saved
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights, strict=True):
            _local(p).copy_(w)
    opt.load_state_dict(copy.deepcopy(opt_state))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _replaying(state: dict[str, Any]) -> bool:
    engine = state.get("engine")
    return bool(engine is not None and engine.replaying)


def _job(ctx: RankContext) -> list[tuple[int, bool]]:
    a, injector, par, opt = start_rank(ctx, timeout_s=600)
    state: dict[str, Any] = {"step": 0, "fired": []}
    _install(par, injector, ctx.rank, state)
    cfg = load(None, [f"replay.cadence.hidden={INTERVAL}", f"replay.cadence.embedding={INTERVAL}",
                      f"replay.cadence.output={INTERVAL}", "replay.cadence.optimizer=0", "observer.enabled=false",
                      f"report.jsonl_path={a['jsonl']}", f"report.run_id={a['run_id']}", "report.log_level=ERROR",
                      "report.fsync=false"])
    handle = scout_core.enable(par.model, opt, config=cfg, mesh=par.mesh)
    state["engine"] = handle.replay
    data_rank = ctx.rank // (ctx.world_size // 4) if a["layout"] == "hsdp" else ctx.rank
    starts = {w["start"] for w in a["windows"]}
    ends = {w["stop"] - 1 for w in a["windows"]}
    saved = None
    for step, (x, y) in enumerate(batches(data_rank, a["steps"], seed=a["seed"]), start=1):
        state["step"] = step
        if step in starts:
            saved = _save(par.model, opt)
        torch.nn.functional.mse_loss(par.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step in ends and saved is not None:
            _restore(par.model, opt, saved)
    dist.barrier()
    handle.close()
    return state["fired"]


def classify(windows: list[dict[str, Any]], incidents: list[Any], fired: list[tuple[int, int, bool]],
             steps: int) -> dict[str, Any]:
    """``fired``: (rank, step, inside a replay) of every firing of a fault."""
    rows: dict[str, Any] = {"faults": len(windows), "persistent": 0, "covered": 0, "fired_in_replay": 0,
                            "sensitive": 0, "localized": 0, "missed": 0, "mislocalized": 0, "false_positive": 0,
                            "clean_steps": 0, "verdict_steps": [], "details": []}
    claimed: set[int] = set()
    for w in windows:
        got = sorted((i for i in incidents if w["start"] <= i.step < w["stop"]), key=lambda i: i.step)
        claimed.update(id(i) for i in got)
        first = got[0] if got else None
        in_replay = any(r == w["rank"] and w["start"] <= s < w["stop"] and rep for r, s, rep in fired)
        prefix = SURFACE_OF[w["module"]]

        def right_record(i: Any, w: dict[str, Any] = w, prefix: str = prefix) -> bool:
            return (i.kind.value == "sdc" and i.scope.value == "rank" and i.ranks == [w["rank"]]
                    and any(s.startswith(prefix) for s in i.surface.split(";")))

        right = first is not None and right_record(first)
        verdict = "localized" if right else ("missed" if first is None else "mislocalized")
        rows[verdict] += 1
        # Every later record of the window is held to the same bar: another rank, kind or module named
        # after the right first record is a false positive, not hidden behind it.
        wrong_later = [i for i in got[1:] if not right_record(i)]
        rows["false_positive"] += len(wrong_later)
        if wrong_later:
            rows["details"].append({"false_positives": [(i.step, i.kind.value, i.ranks, i.surface)
                                                        for i in wrong_later], "window": w})
        if w["persistent"]:
            rows["persistent"] += 1
            rows["covered"] += verdict == "localized"
        if in_replay:
            rows["fired_in_replay"] += 1
            rows["sensitive"] += verdict == "localized"
        if verdict == "localized":
            rows["verdict_steps"].append(first.step - w["start"])
        if verdict != "localized" and (w["persistent"] or in_replay):
            rows["details"].append({**w, "verdict": verdict, "fired_in_replay": in_replay,
                                    "reported": [(i.step, i.kind.value, i.ranks, i.scope.value, i.surface)
                                                 for i in got]})
    faulty_steps = {s for w in windows for s in range(w["start"], w["stop"])}
    rows["clean_steps"] = sum(1 for s in range(1, steps + 1) if s not in faulty_steps)
    stray = [i for i in incidents if id(i) not in claimed]
    rows["false_positive"] += len(stray)
    if stray:
        rows["details"].append({"false_positives": [(i.step, i.kind.value, i.ranks, i.surface) for i in stray]})
    return rows


_COUNTS = ("faults", "persistent", "covered", "fired_in_replay", "sensitive", "localized", "missed",
           "mislocalized", "false_positive", "clean_steps")


def run(layouts: list[str], jobs: int, faults: int, world: int) -> dict[str, Any]:
    prepare_parent()
    summary: dict[str, Any] = {"world_size": world, "window_steps": WINDOW, "interval": INTERVAL,
                               "faults_per_job": faults, "layouts": {}}
    for layout in layouts:
        total: dict[str, Any] = {k: 0 for k in _COUNTS} | {"verdict_steps": [], "details": [], "wall_s": 0.0}
        for job in range(jobs):
            windows = plan(layout, job, faults, world)
            steps = job_steps(windows)
            with tempfile.TemporaryDirectory() as tmp:
                jsonl = os.path.join(tmp, "incidents.jsonl")
                start = time.monotonic()
                result = launch(_job, world, timeout_s=900, args={
                    "faults": _faults(windows), "windows": windows, "seed": job, "layout": layout, "steps": steps,
                    "jsonl": jsonl, "run_id": f"campaign-{layout}-{job}"})
                total["wall_s"] += time.monotonic() - start
                if not result.ok:
                    raise RuntimeError(f"{layout} job {job} failed:\n{result.failures()}")
                incidents = list(read_incidents(jsonl)) if os.path.exists(jsonl) else []
            fired = [(rank, s, rep) for rank, v in enumerate(result.values()) for s, rep in v]
            rows = classify(windows, incidents, fired, steps)
            for k in _COUNTS:
                total[k] += rows[k]
            total["verdict_steps"] += rows["verdict_steps"]
            total["details"] += rows["details"]
            print(f"{layout} job {job}: {rows['covered']}/{rows['persistent']} persistent covered, "
                  f"{rows['sensitive']}/{rows['fired_in_replay']} fired in replay localized, "
                  f"{rows['mislocalized']} mislocalized, {rows['false_positive']} false positives", flush=True)
        total["wall_s"] = round(total["wall_s"], 1)
        summary["layouts"][layout] = total
    summary["total"] = {k: sum(v[k] for v in summary["layouts"].values()) for k in _COUNTS}
    summary["total"]["verdict_steps"] = [s for v in summary["layouts"].values() for s in v["verdict_steps"]]
    return summary


def _ratio(a: int, b: int) -> str:
    return f"{a}/{b} ({100.0 * a / b:.0f} %)" if b else "-"


def _steps(xs: list[int]) -> str:
    return f"{statistics.median(xs):.0f} / {max(xs)}" if xs else "-"


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| layout | faults | replay coverage: persistent faults localized within L x I steps | detection "
             "sensitivity: localized of those fired inside a replay | time to verdict, steps: median / max "
             "| mislocalized | false positives (clean steps) |",
             "|---|---|---|---|---|---|---|"]
    for layout, v in list(summary["layouts"].items()) + [("**total**", summary["total"])]:
        lines.append(f"| {layout} | {v['faults']} | {_ratio(v['covered'], v['persistent'])} "
                     f"| {_ratio(v['sensitive'], v['fired_in_replay'])} | {_steps(v['verdict_steps'])} "
                     f"| {v['mislocalized']} | {v['false_positive']} ({v['clean_steps']}) |")
    return "\n".join(lines)


def write_block(readme: str, name: str, table: str) -> None:
    """Replace what stands between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``readme`` by ``table``."""
    text = Path(readme).read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    Path(readme).write_text(f"{head}{start}\n{table}\n{end}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/campaign.json")
    parser.add_argument("--readme", help="rewrite the campaign block of this README")
    parser.add_argument("--layouts", default="ddp,fsdp2,hsdp")
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--faults", type=int, default=10, help="fault windows per job")
    parser.add_argument("--world", type=int, default=16)
    args = parser.parse_args()
    summary = run(args.layouts.split(","), args.jobs, args.faults, args.world)
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
