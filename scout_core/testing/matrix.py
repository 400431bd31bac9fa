"""The fault matrix (``nox -s matrix``, ``scout cells matrix``): every cell with a place (all 16-rank cells among them),
summarised in the style of the paper's Table 3.

Written as markdown and drawn as a PNG (passed / failed per layout and fault class, and the time to verdict of
each cell)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from scout_core.report import ranks_text
from scout_core.testing.cells import MATRIX_FAULTS, MATRIX_LAYOUTS, CellReport, CellSpec

__all__ = ["false_positives", "matrix_plot", "matrix_summary", "steps_to_verdict", "time_to_verdict"]

VERDICT_KINDS = ("sdc", "straggler", "hang", "data_stall", "checkpoint_stall", "inconclusive")
"""Records about the job (not a recovery decision, SCOUT's own error, or a resolution); ``inconclusive`` blocks
certification, so one in a clean cell counts too."""


def _expected_ranks(spec: CellSpec | None) -> set[int]:
    """Ranks a cell expects named (``params.expect``): faults some cells inject through their own parameters."""
    expect = spec.params.get("expect") if spec is not None else None
    entries = expect if isinstance(expect, list) else [expect] if isinstance(expect, dict) else []
    return {int(r) for e in entries if isinstance(e, dict) for r in e.get("ranks", ())}


def false_positives(report: CellReport, spec: CellSpec | None = None) -> list[dict[str, Any]]:
    """Verdicts naming ranks no fault touched: in a cell that injects nothing and expects nothing, every verdict;
    otherwise a verdict naming a rank outside the injected and expected ones (a group's or machine's members
    included: a wrong machine is a false positive too)."""
    verdicts = [r for r in report.reported if r.get("kind") in VERDICT_KINDS]
    allowed = {f["rank"] for f in report.injected} | _expected_ranks(spec)
    if not allowed:
        return verdicts
    return [r for r in verdicts if not set(r.get("ranks", ())) <= allowed]


def time_to_verdict(report: CellReport) -> float | None:
    """Seconds from the triggering observation to the first verdict, where the cell measured it."""
    times = [r["time_to_verdict_s"] for r in report.reported
             if r.get("kind") in VERDICT_KINDS and r.get("time_to_verdict_s") is not None]
    if report.time_to_verdict_s is not None:
        times.append(report.time_to_verdict_s)
    return min(times) if times else None


def steps_to_verdict(report: CellReport, spec: CellSpec | None = None) -> int | None:
    """Training steps from the first injected fault's onset to the first verdict at or after it that names the
    ranks the faults touched (0: named in the step the fault began; a verdict on a wrong rank is a false positive,
    not a detection), where both carry a step: every replay and hang cell, not only those that time it."""
    starts = [f["schedule"]["start"] for f in report.injected
              if isinstance(f.get("schedule"), dict) and f["schedule"].get("start") is not None]
    if not starts:
        return None
    onset = min(starts)
    wrong = false_positives(report, spec)
    steps = [r["step"] for r in report.reported
             if r.get("kind") in VERDICT_KINDS and isinstance(r.get("step"), int) and r["step"] >= onset
             and not any(r is w for w in wrong)]
    return min(steps) - onset if steps else None


def _steps_text(reports: Sequence[CellReport], specs: Mapping[str, CellSpec]) -> str:
    steps = sorted(s for r in reports if (s := steps_to_verdict(r, specs.get(r.name))) is not None)
    if not steps:
        return "-"
    return str(steps[0]) if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"


def _named(reports: Sequence[CellReport]) -> str:
    seen: dict[str, None] = {}
    for rep in reports:
        for r in rep.reported:
            if r.get("kind") in VERDICT_KINDS:
                seen[f"{r['kind']}/{r['scope']}"] = None
    return ", ".join(seen) or "nothing"


def matrix_summary(specs: Mapping[str, CellSpec], reports: Sequence[CellReport]) -> str:
    """Markdown: per fault class, the cells passed / run in each layout, what was named and the false positives;
    then every failed cell with the first line of its details."""
    placed = [(specs[r.name].matrix, r) for r in reports if r.name in specs and specs[r.name].matrix is not None]
    layouts = [lay for lay in MATRIX_LAYOUTS if any(p.layout == lay for p, _ in placed)]
    lines = ["| fault class | " + " | ".join(layouts)
             + " | passed / run | named | steps to verdict | at the shipped settings | false positives |",
             "|---|" + "---|" * len(layouts) + "---|---|---|---|---|"]
    for fault in MATRIX_FAULTS:
        mine = [(p, r) for p, r in placed if p.fault == fault]
        if not mine:
            continue
        cols = []
        for lay in layouts:
            cell = [r for p, r in mine if p.layout == lay]
            passed = sum(r.verdict == "PASS" for r in cell)
            cols.append("-" if not cell else f"{passed}/{len(cell)}" + ("" if passed == len(cell) else " **FAIL**"))
        runs = [r for _, r in mine]
        passed = sum(r.verdict == "PASS" for r in runs)
        fps = sum(len(false_positives(r, specs.get(r.name))) for r in runs)
        shipped = [r for r in runs if "shipped" in specs[r.name].tags]
        lines.append(f"| {fault.replace('_', ' ')} | " + " | ".join(cols) + f" | {passed}/{len(runs)} | {_named(runs)}"
                     f" | {_steps_text(runs, specs)} | {_steps_text(shipped, specs)} | {fps} |")
    total = sum(r.verdict == "PASS" for _, r in placed)
    lines += ["", f"{total} of {len(placed)} cells passed; `-`: no cell of that layout and fault class. Steps to "
              "verdict: from the fault's first step to the step of the first verdict, over the cells (a recovery "
              "cell's verdict is its first run's); at the shipped settings: over the cells that run every SCOUT "
              "setting as shipped (tag `shipped`: replay every 20 steps, one layer per check in rotation; the hang "
              "observer's 5 s silence threshold and 10 s gather timeout)."]
    failed = [r for _, r in placed if r.verdict != "PASS"]
    if failed:
        lines += ["", "Failed cells:", ""]
        lines += [f"- `{r.name}`: {(r.details.strip().splitlines() or ['(no details)'])[0][:200]}" for r in failed]
    fp_cells = [(r, fp) for _, r in placed if (fp := false_positives(r, specs.get(r.name)))]
    if fp_cells:
        lines += ["", "False positives:", ""]
        lines += [f"- `{r.name}`: " + "; ".join(f"{f['kind']}/{f['scope']} r{ranks_text(f['ranks'])}" for f in fps)
                  for r, fps in fp_cells]
    return "\n".join(lines) + "\n"


def slowest_cells(reports: Sequence[CellReport], count: int = 10) -> str:
    """The ``count`` slowest cells of a run, slowest first: where CI's time goes, printed at the end of each run."""
    ranked = sorted(reports, key=lambda r: r.wall_s, reverse=True)[:count]
    lines = [f"\n{len(ranked)} slowest cells ({sum(r.wall_s for r in reports):.0f} s in all):"]
    lines += [f"  {r.wall_s:7.1f} s  {r.name} ({r.world_size} ranks)" for r in ranked]
    return "\n".join(lines)


def matrix_plot(specs: Mapping[str, CellSpec], reports: Sequence[CellReport], path: str | os.PathLike[str]) -> None:
    """Three panels: passed / run per layout and fault class (green all passed, red any failed, blank none run);
    each cell's time to verdict by fault class where the cell timed it (the observer's verdicts); each cell's
    steps from the fault's onset to its verdict. Needs matplotlib (``scout-core[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the matrix plot needs matplotlib: pip install 'scout-core[bench]'") from exc
    placed = [(specs[r.name].matrix, r) for r in reports if r.name in specs and specs[r.name].matrix is not None]
    layouts = [lay for lay in MATRIX_LAYOUTS if any(p.layout == lay for p, _ in placed)]
    faults = [f for f in MATRIX_FAULTS if any(p.fault == f for p, _ in placed)]
    fig, (grid, times, steps) = plt.subplots(1, 3, figsize=(19, 0.55 * max(len(faults), 4) + 2),
                                             gridspec_kw={"width_ratios": [max(len(layouts), 1), 5, 4]})
    colours = [[(1, 1, 1)] * len(layouts) for _ in faults]
    for i, fault in enumerate(faults):
        for j, lay in enumerate(layouts):
            cell = [r for p, r in placed if p.fault == fault and p.layout == lay]
            if not cell:
                continue
            passed = sum(r.verdict == "PASS" for r in cell)
            colours[i][j] = (0.55, 0.85, 0.55) if passed == len(cell) else (0.95, 0.45, 0.45)
            grid.text(j, i, f"{passed}/{len(cell)}", ha="center", va="center", fontsize=9)
    grid.imshow(colours, aspect="auto")
    grid.set_xticks(range(len(layouts)), layouts, rotation=30, ha="right")
    grid.set_yticks(range(len(faults)), [f.replace("_", " ") for f in faults])
    grid.set_title("cells passed / run")
    for i, fault in enumerate(faults):
        for p, r in placed:
            ttv = time_to_verdict(r)
            if p.fault == fault and ttv is not None:
                times.scatter(max(ttv, 1e-3), i, color="tab:green" if r.verdict == "PASS" else "tab:red", s=18)
    times.set_xscale("log")
    times.set_xlabel("time to verdict (s, log)")
    times.set_title("time to verdict, where the cell timed it")
    counts: dict[tuple[int, int, bool], int] = {}  # cells at one (class, steps): one marker, labelled how many
    for i, fault in enumerate(faults):
        for p, r in placed:
            n = steps_to_verdict(r, specs.get(r.name))
            if p.fault == fault and n is not None:
                key = (i, n, r.verdict == "PASS")
                counts[key] = counts.get(key, 0) + 1
    for (i, n, passed), k in counts.items():
        y = i if passed else i + 0.25  # a failed cell's marker beside, not under, the passed ones
        steps.scatter(n, y, color="tab:green" if passed else "tab:red", s=18 + 8 * k)
        if k > 1:
            steps.annotate(str(k), (n, y), xytext=(7, 4), textcoords="offset points", fontsize=8)
    steps.set_xlabel("steps from the fault's onset to the verdict")
    steps.set_title("steps to verdict per cell")
    steps.xaxis.get_major_locator().set_params(integer=True)
    for ax in (times, steps):
        ax.set_yticks(range(len(faults)), [f.replace("_", " ") for f in faults])
        ax.set_ylim(len(faults) - 0.5, -0.5)
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
