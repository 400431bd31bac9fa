"""The SDC campaign's bookkeeping: each defect's window classified from the incident records, and the tables.

Kept apart from ``campaign`` (which runs jobs) so that the rules can be tested on records made up by hand: the
classification must be able to say missed, mislocalized and false positive.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from scout_core.checkpoint.finite import NONFINITE_SURFACE

SURFACE_OF = {"embed": "embedding.", "head": "output.", "layers.0": "layers.0.", "layers.1": "layers.1.",
              "layers.2": "layers.2.", "optimizer": "optimizer."}
"""How the replay names each unit's surfaces (the embedding and output recipes, the sampled block, the optimizer
slice)."""

_COUNTS = ("defects", "localized", "on_unit", "missed", "missed_nonfinite", "mislocalized", "false_positive",
           "unattributed", "clean_checks")


def _blames(incident: Any) -> bool:
    """Whether a record names culprits: a job-scoped record (the state went non-finite on these ranks) does not."""
    return bool(incident.ranks) and incident.scope.value != "job"


def _window_rows(defect: dict[str, Any], onset: int, got: list[Any]) -> tuple[str, int | None, list]:
    """(verdict, steps to verdict, wrong records) for one defect from the records of its window. Localized: every
    ``sdc`` record of the first step that has any names exactly the defective rank (records of one step come from
    several writers in no set order: one naming another rank makes the window mislocalized, whatever the order)."""
    rank = defect["rank"]
    sdc = [i for i in got if i.kind.value == "sdc"]
    first = [i for i in sdc if i.step == sdc[0].step] if sdc else []
    if not first:
        verdict = "missed"
    elif all(i.scope.value == "rank" and i.ranks == [rank] for i in first):
        verdict = "localized"
    else:
        verdict = "mislocalized"
    wrong = [i for i in got if _blames(i) and set(i.ranks) - {rank}]  # anyone else blamed, by any record
    return verdict, (first[0].step - onset if verdict == "localized" else None), wrong


def classify(defects: list[dict[str, Any]], windows: list[tuple[int, int]], incidents: list[Any],
             checks: list[int], steps: int) -> dict[str, Any]:
    """Counts for one job. ``windows``: (onset, last step) of each defect as it ran; ``checks``: the steps at
    which a check ran; a check outside every window is a clean check."""
    rows: dict[str, Any] = {k: 0 for k in _COUNTS} | {"verdict_steps": [], "by_unit": {}, "details": []}
    claimed: set[int] = set()
    for defect, (onset, end) in zip(defects, windows, strict=True):
        got = sorted((i for i in incidents if i.step is not None and onset <= i.step <= end), key=lambda i: i.step)
        claimed.update(id(i) for i in got)
        verdict, steps_to, wrong = _window_rows(defect, onset, got)
        rows["defects"] += 1
        rows[verdict] += 1
        unit = rows["by_unit"].setdefault(defect["what"], {"defects": 0, "localized": 0})
        unit["defects"] += 1
        unit["localized"] += verdict == "localized"
        if verdict == "localized":
            rows["verdict_steps"].append(steps_to)
            first = next(i for i in got if i.kind.value == "sdc")
            rows["on_unit"] += any(s.startswith(SURFACE_OF[defect["module"]]) for s in (first.surface or "").split(";"))
        rows["false_positive"] += len(wrong)
        rows["unattributed"] += sum(1 for i in got if not _blames(i))
        rows["missed_nonfinite"] += verdict == "missed" and any(i.surface == NONFINITE_SURFACE for i in got)
        if verdict != "localized" or wrong:
            rows["details"].append({**defect, "onset": onset, "end": end, "verdict": verdict,
                                    "reported": [(i.step, i.kind.value, i.ranks, i.scope.value, i.surface[:160])
                                                 for i in got]})
    inside = [(onset, end) for onset, end in windows]
    rows["clean_checks"] = sum(1 for s in checks if not any(a <= s <= b for a, b in inside))
    stray = [i for i in incidents if id(i) not in claimed]
    rows["false_positive"] += sum(1 for i in stray if _blames(i))
    rows["unattributed"] += sum(1 for i in stray if not _blames(i))
    if stray:
        rows["details"].append({"clean_gap_records": [(i.step, i.kind.value, i.ranks, i.surface[:160])
                                                      for i in stray]})
    return rows


def _add(total: dict[str, Any], rows: dict[str, Any]) -> None:
    for k in _COUNTS:
        total[k] = total.get(k, 0) + rows.get(k, 0)
    total.setdefault("verdict_steps", []).extend(rows["verdict_steps"])
    for what, v in rows["by_unit"].items():
        unit = total.setdefault("by_unit", {}).setdefault(what, {"defects": 0, "localized": 0})
        unit["defects"] += v["defects"]
        unit["localized"] += v["localized"]
    total["wall_s"] = round(total.get("wall_s", 0.0) + rows.get("wall_s", 0.0), 1)
    total["skipped"] = total.get("skipped", 0) + len(rows.get("skipped_checks", []))
    total["worlds"] = sorted(set(total.get("worlds", [])) | ({rows["world"]} if "world" in rows else set()))


def summarize(summary: dict[str, Any]) -> dict[str, Any]:
    """Per layout and in total, from the jobs' rows."""
    summary["layouts"], summary["total"] = {}, {}
    for job in summary["jobs"]:
        _add(summary["layouts"].setdefault(job["layout"], {}), job)
        _add(summary["total"], job)
    return summary


def _ratio(a: int, b: int) -> str:
    return f"{a}/{b} ({100.0 * a / b:.0f} %)" if b else "-"


def p95(xs: list[int]) -> int:
    """The nearest-rank 95th percentile."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _steps(xs: list[int]) -> str:
    return f"{statistics.median(xs):.0f} / {p95(xs)}" if xs else "-"


UNIT_WORDS = {"output": "wrong output", "grad": "wrong input gradient", "weight": "stuck weight read",
              "update": "optimizer kernel writing a wrong weight"}


def markdown(summary: dict[str, Any]) -> str:
    rotation, window = summary["rotation_steps"], summary["max_window_steps"]
    lines = [f"| layout (ranks) | defects | localized within two rotations ({window} steps) | of them on the "
             "defective unit's surface | onset to verdict, steps: median / p95 | missed (of them: state found not "
             "finite, cause not named) | mislocalized (bar 0) "
             "| false positives (bar 0) / clean checks | records naming no culprit | checks skipped |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for layout, v in list(summary["layouts"].items()) + [("**total**", summary["total"])]:
        worlds = ",".join(str(w) for w in v["worlds"])
        lines.append(f"| {layout} ({worlds}) | {v['defects']} | {_ratio(v['localized'], v['defects'])} "
                     f"| {v['on_unit']} | {_steps(v['verdict_steps'])} "
                     f"| {v['missed']} ({v.get('missed_nonfinite', 0)}) | {v['mislocalized']} "
                     f"| {v['false_positive']} / {v['clean_checks']} | {v['unattributed']} | {v['skipped']} |")
    by_unit = summary["total"]["by_unit"]
    lines += ["", "| defect | localized within two rotations |", "|---|---|"]
    lines += [f"| {UNIT_WORDS[w]} | {_ratio(v['localized'], v['defects'])} |" for w, v in sorted(by_unit.items())]
    by_commit: dict[str, list[int]] = {}
    for job in summary["jobs"]:
        by_commit.setdefault(job.get("commit", summary.get("commit", "unknown")), []).append(job["job"])
    ran = "; ".join(f"jobs {', '.join(map(str, jobs))} at {commit}" for commit, jobs in by_commit.items())
    lines += ["", f"Shipped settings: a check every {summary['interval']} steps, one block of 3 per check "
                  f"(a rotation is {rotation} steps). Commits: {ran}."]
    return "\n".join(lines)


def write_block(readme: str, name: str, table: str) -> None:
    """Replace what stands between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``readme`` by ``table``."""
    text = Path(readme).read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    Path(readme).write_text(f"{head}{start}\n{table}\n{end}{tail}")
