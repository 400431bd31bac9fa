"""``nox -s demo``: a 16-rank training job with every SCOUT feature on, a defective unit on one rank mid-run, and
what SCOUT does about it: the SDC verdict naming that rank, the job stopped by the configured action, the
restart from the verified checkpoint (torchrun --max-restarts 1), then the incident table and the HTML report.

    python examples/demo.py [--out runs/demo] [--ranks 16] [--steps 240] [--fault-rank 9] [--fault-step 120]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "demo")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--fault-rank", type=int, default=9)
    p.add_argument("--fault-step", type=int, default=120)
    args = p.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"SCOUT demo: {args.ranks} ranks (DDP, gloo, two simulated machines), a small Llama-style transformer, "
          f"{args.steps} steps; rank {args.fault_rank} computes with a defective unit from step {args.fault_step}")
    print("  SCOUT: hang observers, replay checks every 10 steps (layers, embedding, head; the optimizer recipe off so "
          "that certification completes in a short run), certified snapshots with peer replicas, on_verdict=stop, "
          "metrics textfile, runtime control")
    start = time.monotonic()
    log = out / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           "--max-restarts", "1", str(ROOT / "examples" / "demo_train.py"), "--out", str(out),
           "--steps", str(args.steps), "--fault-rank", str(args.fault_rank), "--fault-step", str(args.fault_step)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as err:  # torchrun's own log (the restart, the worker that exited 75) goes to the file
        run = subprocess.run(cmd, stderr=err, env=env, cwd=ROOT)
    wall = time.monotonic() - start
    print(f"\n  torchrun finished with status {run.returncode} after {wall:.0f}s (its log: {log})")

    from scout_core.checkpoint.coordinator import read_records
    from scout_core.report import format_table, hosts_to_exclude, read_incidents
    from scout_core.report_html import render_html

    incidents = list(read_incidents(out / "incidents.jsonl")) if (out / "incidents.jsonl").exists() else []
    decisions_path = out / "checkpoints" / "decisions.jsonl"
    decisions = read_records(str(decisions_path))  # the coordinator's own reader (a torn last line is skipped)
    print("\nIncidents:\n")
    print(format_table(incidents, width=shutil.get_terminal_size((150, 24)).columns))
    print("\nRetrieval decisions:")
    for d in decisions:
        print(f"  {d.get('record')}: load the {d.get('source')} checkpoint of step {d.get('generation')} "
              f"({d.get('reason', '')})")
    print(f"\nMachines to drain: {', '.join(hosts_to_exclude(incidents)) or 'none'}")
    page = out / "report.html"
    page.write_text(render_html(incidents, decisions=decisions, title="SCOUT demo", source=str(out)))
    print(f"HTML report: {page}")

    done = json.loads((out / "done.json").read_text()) if (out / "done.json").exists() else {}
    sdc = [i for i in incidents if i.kind.value == "sdc" and i.scope.value == "rank"]
    problems = []
    if run.returncode != 0:
        problems.append(f"torchrun exited with {run.returncode}")
    if not sdc or {r for i in sdc for r in i.ranks} != {args.fault_rank}:
        problems.append(f"expected SDC verdicts on rank {args.fault_rank} only, got {[i.ranks for i in sdc]}")
    if done.get("attempt") != 1 or done.get("source") != "verified" or done.get("resumed_from") is None \
            or done["resumed_from"] > args.fault_step:  # step N's state holds steps 0..N-1 of the loop
        problems.append(f"expected a restart from a verified checkpoint before step {args.fault_step}, got {done}")
    if problems:
        print("\nDEMO FAILED: " + "; ".join(problems))
        return 1
    print(f"\nThe defective unit on rank {args.fault_rank} was named, the job stopped, and the restart resumed from "
          f"the verified checkpoint of step {done['resumed_from']} and finished ({wall:.0f}s in all).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
