"""Recovery campaign at the shipped defaults: does a restart ever restore a state that carries the corruption?

Each defect is one job at the shipped defaults (cadence 20, coverage certification, no flush per step, stop on a
verdict), the Llama-style tiny model of the ``*-recovery-sdc-defaults`` cells, run by
:func:`integrations_tests.recovery_defaults_cells.stop_and_restart`. Drawn at random per defect (from its seed):
the layout (DDP, FSDP2, HSDP), the block (0-1), forward output or backward gradient, the bit (0-31), the rank and
the onset step (60-400: before and after the first generation is verified, at step 240). The defect is
persistent from its onset, in training and replay alike. After the stop, ``resume()`` runs in fresh processes;
a restored state is compared, bitwise on every rank, with a clean run's (no defect, no SCOUT) at that step.

Counted: restores whose state carries the corruption (the bar is 0), nothing restored (nothing was verified
yet: a FAIL once the onset is after the first verification, step 240), jobs the defect did not stop (a FAIL:
every defect is persistent inside a replayed block), and the medians of steps from onset to verdict and from
capture to verified.

    python -m integrations_tests.recovery_campaign --out benchmarks/recovery_campaign.json [--defects 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integrations_tests.campaign_report import write_block  # noqa: E402
from integrations_tests.recovery_defaults_cells import judge_restore, stop_and_restart  # noqa: E402
from scout_core.testing.inject import Fault  # noqa: E402
from scout_core.testing.launcher import prepare_parent  # noqa: E402

LAYOUTS = ("ddp", "fsdp2", "hsdp")
CADENCE = 20
VERIFIED_BY = 240
"""The first generation is verified at the second whole coverage (6 checks of 20 steps each): a defect whose
onset is later must be followed by a restore of a verified state."""


def draw(i: int, world: int) -> dict[str, Any]:
    """Defect ``i``: layout, block, output or gradient, bit, rank, onset."""
    rng = random.Random(f"recovery-{i}")
    return {"defect": i, "layout": rng.choice(LAYOUTS), "block": rng.randrange(2),
            "where": rng.choice(("output", "grad")), "bit": rng.randrange(32), "rank": rng.randrange(world),
            "onset": rng.randrange(60, 401)}


def one(i: int, world: int, workdir: str) -> dict[str, Any]:
    d = draw(i, world)
    fault = Fault.from_dict({"surface": f"layers.{d['block']}.{d['where']}", "rank": d["rank"], "kind": "bitflip",
                             "bit": d["bit"], "from_step": d["onset"]})
    # Long enough for the rotation to come back to the block four times after the onset.
    steps = d["onset"] + 4 * 2 * CADENCE
    start = time.monotonic()
    run = stop_and_restart([fault], layout=d["layout"], steps=steps, world_size=world, workdir=workdir,
                           run_id=f"recovery-campaign-{i}", seed=i, replicas=2 if world < 8 else 4, timeout_s=600)
    row: dict[str, Any] = {**d, "stopped": run.get("codes") == [75]}
    sdc = sorted(inc.step for inc in run["incidents"] if inc.kind.value == "sdc" and inc.step is not None)
    row["verdict_steps"] = sdc[0] - d["onset"] if sdc else None
    stop = next((r for r in run["decisions"] if r.get("record") == "decision"), {})
    row["capture_to_verified"] = stop.get("certifier", {}).get("steps_capture_to_verified")
    values = run["values"]
    row["stopped_for"] = stop.get("failure")  # sdc, or straggler (a false one under load: its restart sweeps)
    row["restored"] = values[0]["generation"] if values else None
    row["restored_source"] = values[0]["source"] if values else None
    row["problems"] = list(run["problems"])  # a job the defect did not stop is a miss: "phase A should stop"
    if values:
        row["problems"] += judge_restore(values, run["decisions"], run["args"], world, 600,
                                         expect_restore=d["onset"] > VERIFIED_BY)
    row["corrupted_restore"] = any("carries the corruption" in p for p in row["problems"])
    row["wall_s"] = round(time.monotonic() - start, 1)
    return row


def _failed(r: dict[str, Any]) -> bool:
    """Anything but a clean stop and restart: a miss, nothing restored after the first verification, any problem."""
    return bool(r["problems"]) or not r["stopped"] or (r["restored"] is None and r["onset"] > VERIFIED_BY)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts = [r["verdict_steps"] for r in rows if r["verdict_steps"] is not None]
    latency = [r["capture_to_verified"] for r in rows if r["capture_to_verified"] is not None]
    return {
        "defects": len(rows), "stopped": sum(r["stopped"] for r in rows),
        "restored_verified": sum(r["restored"] is not None and r.get("restored_source") != "latest"
                                 for r in rows if r["stopped"]),
        "restored_latest_swept": sum(r["restored"] is not None and r.get("restored_source") == "latest"
                                     for r in rows if r["stopped"]),
        "stopped_for_straggler": sum(r.get("stopped_for") == "straggler" for r in rows),
        "nothing_restored": sum(r["restored"] is None for r in rows if r["stopped"]),
        "corrupted_restores": sum(r["corrupted_restore"] for r in rows),
        "other_problems": sum(_failed(r) and not r["corrupted_restore"] for r in rows),
        "median_onset_to_verdict_steps": statistics.median(verdicts) if verdicts else None,
        "median_capture_to_verified_steps": statistics.median(latency) if latency else None,
    }


def _write(path: str, world: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarize(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"world_size": world, "summary": summary, "defects": rows}, fh, indent=2)
    return summary


def markdown(summary: dict[str, Any], world: int) -> str:
    s = summary
    return "\n".join([
        "| defects | stopped by a verdict (of them: a straggler verdict) | restored a verified state "
        "| restored latest, swept clean | restored nothing (none verified yet) "
        "| restores carrying the corruption (bar: 0) | onset to verdict, median steps | capture to verified, "
        "median steps |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['defects']} ({world} ranks) | {s['stopped']} ({s.get('stopped_for_straggler', 0)}) "
        f"| {s['restored_verified']} | {s.get('restored_latest_swept', 0)} | {s['nothing_restored']} "
        f"| **{s['corrupted_restores']}** | {s['median_onset_to_verdict_steps']} "
        f"| {s['median_capture_to_verified_steps']} |"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/recovery_campaign.json")
    parser.add_argument("--readme", help="rewrite the recovery-campaign block of this file")
    parser.add_argument("--defects", type=int, default=100)
    parser.add_argument("--world", type=int, default=4, help="ranks per job (16: hours on a 2-core machine)")
    parser.add_argument("--first", type=int, default=0, help="the first defect's number (to split a campaign)")
    parser.add_argument("--summarize", metavar="JSON", nargs="+",
                        help="only summarize the rows of earlier runs' JSON files (one campaign split in parts)")
    args = parser.parse_args()
    if args.summarize:
        parts = [json.loads(Path(path).read_text()) for path in args.summarize]
        keys = ("layout", "block", "where", "bit", "rank", "onset")  # a defect's draw: one row each
        rows = list({tuple(r[k] for k in keys): r for part in parts for r in part["defects"]}.values())
        args.defects, args.world = 0, parts[0]["world_size"]
    else:
        prepare_parent()
        rows = []
    for i in range(args.first, args.first + args.defects):
        with tempfile.TemporaryDirectory() as tmp:
            row = one(i, args.world, tmp)
        rows.append(row)
        _write(args.out, args.world, rows)  # after each defect: an interrupted campaign keeps what it found
        print(f"[{i + 1}/{args.first + args.defects}] {row['layout']} block {row['block']} {row['where']} "
              f"bit {row['bit']} rank {row['rank']} from step {row['onset']}: stopped={row['stopped']} "
              f"restored={row['restored']} corrupted={row['corrupted_restore']} {row['problems'][:1]} "
              f"({row['wall_s']} s)", flush=True)
    summary = _write(args.out, args.world, rows)
    table = markdown(summary, args.world)
    print(table)
    if args.readme:
        write_block(args.readme, "recovery-campaign", table)
    return 0 if summary["corrupted_restores"] == 0 and summary["other_problems"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
