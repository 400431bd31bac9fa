"""How sensitive compute-straggler detection is at the shipped defaults, on this machine: a rate, not a test.

The paper's bar: a rank whose replayed compute is 1.3x slower is named within three rounds. Each layout's
straggler cell runs here exactly as shipped (a check every 20 steps, one block per check in rotation, every
consensus setting as shipped), ``runs`` times with one rank slowed from step 41 (two clean rounds first; its
slowed rounds are steps 60, 80 and 100) and ``clean_runs`` times with no fault, all 100 steps long. Per run it
reports when the rank was named and by which path (beyond the noise floor, or persistently slower than the same
rounds' peers), the noise floor in force, and any record naming another rank (a false positive).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("ddp", "fsdp2", "hsdp")
CADENCE, ONSET, STEPS = 20, 41, 100
WITHIN = 100  # the third slowed round
"""Slowed from step 41, after two clean rounds; named by step 100, its third slowed round; runs of 100 steps."""


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p5": round(at(0.05), 3), "p50": round(at(0.5), 3), "p95": round(at(0.95), 3),
            "max": round(xs[-1], 3)}


def _shipped_spec(layout: str, world: int, victim: int, factor: float | None, rule: dict | None = None):
    """The layout's straggler cell at the shipped settings (``rule``: consensus settings changed from them):
    ``factor`` None is a clean run of the same length."""
    from scout_core.testing.cells import load_cells
    from scout_core.testing.inject import Schedule

    spec = load_cells(ROOT / "configs" / "cells.yaml")[f"{layout}-straggler-defaults"]
    params = dict(spec.params, shipped=True, steps=STEPS, rule=dict(rule or {}))
    params["expect"] = {"ranks": [victim]}  # the watched rank's ratios: what the table reports
    if layout == "hsdp":
        params["replicas"] = world // 2
    faults = () if factor is None else tuple(
        dataclasses.replace(f, factor=factor, rank=victim, schedule=Schedule(start=ONSET)) for f in spec.faults)
    return dataclasses.replace(spec, params=params, faults=faults, timeout_s=900)


def _one_run(spec: Any, world: int, victim: int | None) -> dict[str, Any]:
    """One job: when ``victim`` was first named and how, records naming anyone else, the floor in force."""
    from integrations_tests.replay_cells import replay_cell

    with tempfile.TemporaryDirectory() as workdir:
        report = replay_cell(spec, world, workdir)
    if report.verdict == "FAIL" and "exit" in report.details:  # a crashed job is no measurement
        raise RuntimeError(report.details[:2000])
    stragglers = [r for r in report.reported if r["kind"] == "straggler"]
    mine = sorted((r["step"], _path(r, victim)) for r in stragglers if victim in r["ranks"])
    floors = [v for k, v in report.metrics.items() if k.startswith("floor.") and math.isfinite(v)]
    ratios = [v for k, v in report.metrics.items()
              if k.startswith("ratio.") and int(k.rsplit("step", 1)[1]) >= ONSET]
    return {"named_at": mine[0][0] if mine else None, "by": mine[0][1] if mine else None,
            "false_positives": sum(1 for r in report.reported if set(r["ranks"]) - {victim}),
            "floor": max(floors) if floors else None, "ratios": ratios, "wall_s": round(report.wall_s, 1)}


def _path(record: dict, rank: int) -> str:
    """Which path named ``rank``: the noise floor's or the persistent one (the record's ``evidence.path``)."""
    return record.get("evidence", {}).get("path", {}).get(str(rank), "floor")


def bench_straggler_sensitivity(runs: int = 10, factor: float = 1.3, world: int = 16, clean_runs: int = 10,
                                rule: dict | None = None, layouts: tuple[str, ...] = LAYOUTS) -> dict[str, Any]:
    """Per layout, ``runs`` jobs with one rank ``factor`` slower from step 41 (rank 9 at 16 ranks, rank 5 at 8;
    HSDP as ``world / 2`` replicas x 2 shards) and ``clean_runs`` clean jobs, at the shipped settings but for
    the consensus settings in ``rule``."""
    victim = 9 if world == 16 else world - 3
    out: dict[str, Any] = {"factor": factor, "runs": runs, "clean_runs": clean_runs, "world_size": world,
                           "rank": victim, "onset": ONSET, "within": WITHIN, "steps": STEPS, "rule": rule or {},
                           "layouts": {}}
    for layout in layouts:
        started = time.monotonic()
        slowed = [_one_run(_shipped_spec(layout, world, victim, factor, rule), world, victim) for _ in range(runs)]
        clean = [_one_run(_shipped_spec(layout, world, victim, None, rule), world, None) for _ in range(clean_runs)]
        named_at = [r["named_at"] for r in slowed]
        out["layouts"][layout] = {
            "within_three_rounds": sum(1 for s in named_at if s is not None and s <= WITHIN),
            "named_at_step": named_at,
            "named_by": [r["by"] for r in slowed],
            "false_positives": sum(r["false_positives"] for r in slowed),  # records naming another rank
            "clean_false_positives": sum(r["false_positives"] for r in clean),
            "measured_slowdown": _quantiles([x for r in slowed for x in r["ratios"]]),
            "floor_per_run": [r["floor"] for r in slowed],  # the highest floor in force in the run's flagged rounds
            "clean_floor_per_run": [r["floor"] for r in clean],
            "wall_s": round(time.monotonic() - started, 1),
        }
    return out


def rows(results: dict) -> list[str]:
    """Full-table rows: per layout and world size, the rate against the goal (9 of 10 within three rounds,
    no false positive in the clean runs)."""
    lines = []
    for key in ("straggler", "straggler_8", "straggler_persist"):
        lines += _rows_of(results.get(key))
    return lines


def _rows_of(sens: dict | None) -> list[str]:
    if not sens or "within_three_rounds" not in next(iter(sens["layouts"].values()), {}):
        return []
    lines = []
    for layout, r in sens["layouts"].items():
        late = [s for s in r["named_at_step"] if s is None or s > sens["within"]]
        floors = [f for f in r["floor_per_run"] if f is not None]
        lines.append(
            f"| {layout.upper()} {sens['world_size']} ranks, rank {sens['rank']} {sens['factor']}x slower from step "
            f"{sens['onset']}, shipped settings{_changed(sens)} ({sens['steps']} steps, a check every {CADENCE}): "
            f"runs named by step "
            f"{sens['within']} (late: step named, None = never); named by (floor / persistent); measured slowdown "
            f"p5/p50/p95; noise floor in force per run; false positives in the slowed and in "
            f"{sens['clean_runs']} clean runs "
            f"| {r['within_three_rounds']}/{sens['runs']} (late: {late or 'none'}); "
            f"{r['named_by'].count('floor')} / {r['named_by'].count('persistent')}; "
            f"{r['measured_slowdown']['p5']}/{r['measured_slowdown']['p50']}/{r['measured_slowdown']['p95']}x; "
            f"{_floors(floors)}; {r['false_positives']} and {r['clean_false_positives']} "
            f"| {_goal(r, sens)} |")
    return lines


def _changed(sens: dict) -> str:
    rule = sens.get("rule") or {}
    return " but " + ", ".join(f"consensus.{k}={v}" for k, v in rule.items()) if rule else ""


def _floors(floors: list[float]) -> str:
    return ", ".join(f"{f:.2f}" for f in floors) + "x" if floors else "never computed"


def _met(r: dict, sens: dict) -> bool:
    """The goal: at least 9 of 10 runs named within three rounds, and no false positive anywhere."""
    return (10 * r["within_three_rounds"] >= 9 * sens["runs"] and r["false_positives"] == 0
            and r["clean_false_positives"] == 0)


def _goal(r: dict, sens: dict) -> str:
    return "9/10, 0 false positives " + ("(met)" if _met(r, sens) else "(**missed**)")


def headline_rows(results: dict) -> list[str]:
    """The README's row: how often a rank at the paper's 1.3x is named within three rounds, per world size."""
    lines = []
    for key in ("straggler", "straggler_8"):
        sens = results.get(key)
        if not sens or "within_three_rounds" not in next(iter(sens["layouts"].values()), {}):
            continue
        layouts = sens["layouts"]
        rates = ", ".join(f"{k.upper()} {r['within_three_rounds']}/{sens['runs']}" for k, r in layouts.items())
        fps = sum(r["false_positives"] + r["clean_false_positives"] for r in layouts.values())
        clean = sens["clean_runs"] * len(layouts)
        met = all(_met(r, sens) for r in layouts.values())
        lines.append(f"| a rank {sens['factor']}x slower named within three rounds at the shipped settings, "
                     f"{sens['world_size']} ranks | {rates} runs; {fps} false positives (incl. {clean} clean runs) "
                     f"| 9/10, 0 {'(met)' if met else '(**missed**)'} |")
    return lines


def bench_clock_noise(width: int = 512, samples: int = 600) -> dict[str, Any]:
    """One process, one thread, nothing else of SCOUT's running: the same block's forward and backward timed
    on this thread's CPU clock ``samples`` times. The fastest of k consecutive runs still varies from window to
    window (its coefficient of variation, per k): drift of the machine itself, which more samples per round
    do not remove."""
    import statistics

    import torch

    from integrations_tests.models import Block

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        block = Block(width)
        x = torch.randn(width, width)

        def once() -> float:
            xi = x.clone().requires_grad_(True)
            start = time.thread_time()
            out = block(xi)
            torch.autograd.grad(out, [xi, *block.parameters()], grad_outputs=torch.ones_like(out))
            return time.thread_time() - start

        times = [once() for _ in range(samples)]
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"width": width, "samples": samples, "median_s": round(statistics.median(times), 5)}
    for k in (1, 3, 6, 12):
        mins = [min(times[i:i + k]) for i in range(0, samples - k + 1, k)]
        out[f"cv_min_of_{k}"] = round(statistics.pstdev(mins) / statistics.mean(mins), 4)
    return out


def noise_row(results: dict) -> list[str]:
    n = results.get("clock_noise")
    if not n:
        return []
    return [f"| this machine's clock: one block ({n['width']} wide) timed {n['samples']} times on one thread's CPU "
            f"clock, coefficient of variation of the fastest of k = 1 / 3 / 6 / 12 consecutive runs "
            f"| {n['cv_min_of_1'] * 100:.1f} / {n['cv_min_of_3'] * 100:.1f} / {n['cv_min_of_6'] * 100:.1f} / "
            f"{n['cv_min_of_12'] * 100:.1f} % | - |"]
