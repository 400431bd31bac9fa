"""``scout report PATH --html OUT``: one self-contained page for reading a run's incidents.

The page holds an incident timeline, a per-rank heatmap of the replay timings the records carry (each timing
verdict keeps the round's time of every peer; flagged ranks are outlined), the certification history from the
checkpoint coordinator's ``decisions.jsonl``, the machines to drain and the grouped incident table. It needs no
network and no script: inline CSS and SVG, with hover text in SVG ``<title>`` elements. Every string taken from
a record is escaped, so a hostile surface name or reason cannot inject markup.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from scout_core.report import (
    Incident,
    IncidentKind,
    format_table,
    group_repeats,
    hosts_to_exclude,
    ranks_text,
    step_being_run,
    surfaces_text,
)

__all__ = ["render_html", "timing_rounds"]

_KIND_COLOURS = {
    "sdc": "#d62728", "straggler": "#ff7f0e", "hang": "#9467bd", "data_stall": "#8c564b",
    "checkpoint_stall": "#e377c2", "observer_failure": "#7f7f7f", "diagnosis_error": "#bcbd22",
    "resolved": "#2ca02c", "shutdown": "#7f7f7f", "inconclusive": "#17becf",
}

_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;
vertical-align:top}th{background:#f4f4f4}.muted{color:#777}.pill{display:inline-block;padding:1px 8px;
border-radius:9px;color:#fff;font-size:12px}pre{background:#f8f8f8;padding:8px;overflow-x:auto;font-size:12px}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _when(t: Any) -> str:
    """A record's time, or "-" for one the clock cannot show (decision records are not validated as incidents
    are: a hand-edited or foreign line may carry anything)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (OverflowError, OSError, ValueError, TypeError):
        return "-"


def _timed_surfaces(inc: Incident) -> list[tuple[str, Any, bool]]:
    """(surface, result, flags from the record's ranks): a timing verdict's compared timings (its own bitmap
    flags), and the round's timings an SDC record keeps beside its signatures (the record's ranks are flagged)."""
    evidence = inc.evidence if isinstance(inc.evidence, dict) else {}
    out = []
    for key, by_ranks in (("surfaces", False), ("timing", True)):
        found = evidence.get(key)
        if isinstance(found, dict):
            out += [(str(name), res, by_ranks) for name, res in found.items()]
    return out


def timing_rounds(incidents: Iterable[Incident]) -> list[dict[str, Any]]:
    """The timing rounds the records carry: per record and timing surface (every peer's value a number), the
    step, surface, each peer's time over the round's median, and the flagged peers (a timing verdict's outliers;
    an SDC record's named ranks)."""
    rounds = []
    for inc in incidents:
        for name, res, by_ranks in _timed_surfaces(inc):
            if not isinstance(res, dict) or not str(name).endswith("_s"):  # timings (replay.compute_s ...), never
                continue  # signatures, which are numbers too
            values, peers, bitmap = res.get("evidence"), res.get("peer_ranks"), res.get("bitmap")
            if not (isinstance(values, list) and isinstance(peers, list) and len(values) == len(peers) and values
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                            and v >= 0 for v in values)
                    and all(isinstance(p, int) for p in peers)):
                continue
            ordered = sorted(values)
            median = ordered[len(ordered) // 2] if len(ordered) % 2 else sum(ordered[len(ordered) // 2 - 1:
                                                                                 len(ordered) // 2 + 1]) / 2
            flagged = ({p for p in peers if p in inc.ranks} if by_ranks else
                       {p for p, b in zip(peers, bitmap if isinstance(bitmap, list) else [], strict=False) if b})
            seconds = dict(zip(peers, values, strict=True))
            if any((r["step"], r["surface"], r["seconds"]) == (inc.step, str(name), seconds) for r in rounds):
                continue  # one check's round, kept by its SDC record and its straggler record alike
            rounds.append({"step": inc.step, "surface": str(name), "kind": inc.kind.value,
                           "ratio": {p: (v / median if median > 0 else 1.0) for p, v in seconds.items()},
                           "seconds": seconds, "flagged": flagged})
    return rounds


def _timeline(incidents: Sequence[Incident]) -> str:
    if not incidents:
        return '<p class="muted">no incidents</p>'
    kinds = list(dict.fromkeys(i.kind.value for i in incidents))
    t0, t1 = min(i.time_unix for i in incidents), max(i.time_unix for i in incidents)
    span = max(t1 - t0, 1.0)
    left, width, row = 150, 1000, 26
    height = row * len(kinds) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
             'role="img" aria-label="incident timeline">']
    for k, kind in enumerate(kinds):
        y = 20 + k * row
        parts.append(f'<text x="{left - 8}" y="{y + 5}" text-anchor="end" font-size="12">{_e(kind)}</text>'
                     f'<line x1="{left}" y1="{y}" x2="{left + width}" y2="{y}" stroke="#eee"/>')
    for inc in incidents:
        x = left + (inc.time_unix - t0) / span * width
        y = 20 + kinds.index(inc.kind.value) * row
        tip = (f"{_when(inc.time_unix)} {inc.kind.value}/{inc.scope.value} ranks {ranks_text(inc.ranks)} "
               f"step {step_being_run(inc)} {inc.surface[:120]}: {inc.reason[:300]}")
        parts.append(f'<circle cx="{x:.1f}" cy="{y}" r="6" fill="{_KIND_COLOURS.get(inc.kind.value, "#333")}" '
                     f'fill-opacity="0.8"><title>{_e(tip)}</title></circle>')
    parts.append(f'<text x="{left}" y="{height - 6}" font-size="11" fill="#777">{_e(_when(t0))}</text>'
                 f'<text x="{left + width}" y="{height - 6}" font-size="11" fill="#777" text-anchor="end">'
                 f'{_e(_when(t1))}</text></svg>')
    return "".join(parts)


def _heat_colour(ratio: float) -> str:
    """White at the median, deepening red up to 3x, blue below."""
    if ratio >= 1:
        a = min((ratio - 1) / 2, 1.0)
        return f"rgb(255,{int(255 - 175 * a)},{int(255 - 205 * a)})"
    a = min((1 - ratio) / 0.5, 1.0)
    return f"rgb({int(255 - 120 * a)},{int(255 - 60 * a)},255)"


MAX_HEAT_ROUNDS = 200
"""Rows of the heatmap (the latest rounds); the page stays readable and small for long runs."""


def _heatmap(rounds: Sequence[dict[str, Any]]) -> str:
    note = ""
    if len(rounds) > MAX_HEAT_ROUNDS:
        note = f'<p class="muted">the latest {MAX_HEAT_ROUNDS} of {len(rounds)} rounds</p>'
        rounds = rounds[-MAX_HEAT_ROUNDS:]
    if not rounds:
        return ('<p class="muted">no record carries per-rank timings (straggler verdicts, and SDC verdicts of a '
                'timed check, keep the round\'s time of every peer)</p>')
    ranks = sorted({p for r in rounds for p in r["ratio"]})
    cell, left, top = max(6, min(22, 1100 // max(len(ranks), 1))), 260, 30
    width, height = left + cell * len(ranks) + 10, top + cell * len(rounds) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             'aria-label="replay timings per rank">']
    step_labels = max(1, len(ranks) // 32)
    for j, rank in enumerate(ranks):
        if j % step_labels == 0:
            parts.append(f'<text x="{left + j * cell + cell / 2}" y="{top - 8}" font-size="10" '
                         f'text-anchor="middle">{rank}</text>')
    for i, rnd in enumerate(rounds):
        y = top + i * cell
        parts.append(f'<text x="{left - 6}" y="{y + cell * 0.7}" font-size="11" text-anchor="end">step '
                     f'{_e(rnd["step"])} {_e(rnd["surface"][:28])}</text>')
        for j, rank in enumerate(ranks):
            if rank not in rnd["ratio"]:
                continue
            ratio = rnd["ratio"][rank]
            flagged = rank in rnd["flagged"]
            stroke = ' stroke="#000" stroke-width="2"' if flagged else ' stroke="#ccc" stroke-width="0.5"'
            tip = (f"rank {rank}, step {rnd['step']}, {rnd['surface']}: {rnd['seconds'][rank] * 1e3:.3f} ms, "
                   f"{ratio:.2f}x the median" + (" (flagged)" if flagged else ""))
            parts.append(f'<rect x="{left + j * cell}" y="{y}" width="{cell}" height="{cell}" '
                         f'fill="{_heat_colour(ratio)}"{stroke}><title>{_e(tip)}</title></rect>')
    parts.append("</svg>")
    return note + "".join(parts)


def _certification(decisions: Sequence[dict[str, Any]]) -> str:
    if not decisions:
        return '<p class="muted">no retrieval decisions (checkpoint.directory/decisions.jsonl) given</p>'
    rows = ["<tr><th>time</th><th>record</th><th>loads</th><th>generation</th><th>latest / candidate / "
            "verified</th><th>failure</th><th>binding</th><th>reason</th></tr>"]
    for d in decisions:
        cert = d.get("certifier") if isinstance(d.get("certifier"), dict) else {}
        t = d.get("time_unix")
        rows.append("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in (
            _when(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else "-", d.get("record", "-"),
            d.get("source", "-"), d.get("generation", "-"),
            " / ".join(str(cert.get(k, "-")) for k in ("latest", "candidate", "verified")),
            d.get("failure", "-"), d.get("binding", "-"), d.get("reason", ""))) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def render_html(incidents: Sequence[Incident], *, decisions: Sequence[dict[str, Any]] = (),
                title: str = "SCOUT incidents", source: str = "") -> str:
    """The whole page as one string."""
    incidents = sorted(incidents, key=lambda i: i.time_unix)
    runs = sorted({i.run_id for i in incidents if i.run_id})
    counts: dict[str, int] = {}
    for inc in incidents:
        counts[inc.kind.value] = counts.get(inc.kind.value, 0) + 1
    pills = " ".join(f'<span class="pill" style="background:{_KIND_COLOURS.get(k, "#333")}">{_e(k)}: {n}</span>'
                     for k, n in counts.items()) or '<span class="muted">no incidents</span>'
    drain = hosts_to_exclude(incidents)
    groups = group_repeats(incidents)
    table_rows = ["<tr><th>first seen</th><th>kind</th><th>scope</th><th>ranks</th><th>hosts</th><th>n</th>"
                  "<th>steps</th><th>surfaces</th><th>reason</th></tr>"]
    for g in groups:
        inc = g.first
        steps = "-" if not g.steps else (str(g.steps[0]) if len(g.steps) == 1 else f"{g.steps[0]}..{g.steps[-1]}")
        table_rows.append("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in (
            _when(inc.time_unix), inc.kind.value, inc.scope.value, ranks_text(inc.ranks) or "-",
            ", ".join(dict.fromkeys(inc.hosts)) or "-", g.count, steps,
            "; ".join(surfaces_text(s)[:200] for s in g.surfaces[:5]) + (f" (+{len(g.surfaces) - 5})"
                                                                        if len(g.surfaces) > 5 else ""),
            inc.reason)) + "</tr>")
    sdc_or_slow = [i for i in incidents if i.kind in (IncidentKind.SDC, IncidentKind.STRAGGLER)]
    return "\n".join([
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="muted">{_e(source)} · runs: {_e(", ".join(runs) or "-")} · {len(incidents)} records, '
        f"{len(groups)} distinct faults · written {_e(_when(time.time()))}</p>",
        f"<p>{pills}</p>",
        "<h2>Machines to drain</h2>",
        (f"<p>{_e(', '.join(drain))}</p>" if drain else '<p class="muted">none (no SDC on a rank or machine, no '
         "machine-scoped straggler)</p>"),
        "<h2>Timeline</h2>", _timeline(incidents),
        "<h2>Replay timings per rank</h2>",
        '<p class="muted">each row is a round a verdict was recorded in; colour: replay time over the round\'s '
        "median (red slower, blue faster); outlined: the ranks the record names</p>",
        _heatmap(timing_rounds(sdc_or_slow)),
        "<h2>Certification and retrieval</h2>", _certification(decisions),
        "<h2>Incidents</h2>", "<table>" + "".join(table_rows) + "</table>",
        "<h2>Table</h2>", f"<pre>{_e(format_table(incidents, width=None))}</pre>",
        "</body></html>",
    ])
