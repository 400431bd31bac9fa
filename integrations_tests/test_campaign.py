"""The campaign's classification must be able to say 'missed', 'mislocalized' and 'false positive'."""

from __future__ import annotations

from integrations_tests.campaign import WINDOW, classify, job_steps, plan
from scout_core.report import Incident


def _inc(step, ranks, surface, kind="sdc", scope="rank"):
    return Incident(kind=kind, scope=scope, ranks=ranks, step=step, surface=surface)


def test_plan_is_deterministic_and_leaves_clean_steps():
    a = plan("ddp", 0, 10, 16)
    assert a == plan("ddp", 0, 10, 16) and a != plan("ddp", 1, 10, 16)
    assert all(w["stop"] - w["start"] == WINDOW for w in a)
    assert all(b["start"] == w["stop"] + 1 for w, b in zip(a, a[1:]))  # one clean step between windows
    assert a[0]["start"] == 2 and job_steps(a) == a[-1]["stop"]
    assert not any(w["module"] == "embed" and w["where"] == "grad" for w in a)


def _window(start, rank, module="layers.1", where="output", persistent=True):
    return {"start": start, "stop": start + WINDOW, "rank": rank, "module": module, "where": where, "bits": [5],
            "persistent": persistent}


def test_classification():
    windows = [_window(2, 3), _window(6, 4, module="head"), _window(10, 5), _window(14, 6, persistent=False),
               _window(18, 7, module="embed")]
    fired = [(3, 3, True), (4, 6, False), (5, 10, True), (6, 15, False), (7, 18, True)]
    incidents = [
        _inc(3, [3], "layers.1.x1.output;layers.1.x1.grad_input"),  # localized, one step after the start
        _inc(11, [9], "layers.1.x1.output"),  # wrong rank
        _inc(19, [7], "layers.0.x1.output"),  # right rank, wrong module
        _inc(17, [2], "layers.2.x1.output"),  # a clean step flagged
        _inc(1, [2], "layers.2.x1.output", kind="straggler"),  # before any fault
    ]
    rows = classify(windows, incidents, fired, steps=21)
    assert (rows["localized"], rows["missed"], rows["mislocalized"]) == (1, 2, 2)
    assert (rows["persistent"], rows["covered"]) == (4, 1)
    assert (rows["fired_in_replay"], rows["sensitive"]) == (3, 1)
    assert rows["verdict_steps"] == [1]
    assert rows["false_positive"] == 2 and rows["clean_steps"] == 21 - 5 * WINDOW
