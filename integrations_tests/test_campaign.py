"""The campaign's classification must be able to say 'mislocalized' and 'false positive'."""

from __future__ import annotations

from integrations_tests.campaign import classify, plan
from scout_core.report import Incident


def _inc(step, ranks, surface, kind="sdc", scope="rank"):
    return Incident(kind=kind, scope=scope, ranks=ranks, step=step, surface=surface)


def test_plan_is_deterministic_and_has_clean_steps():
    a = plan("ddp", 0, 30, 16, 6)
    assert a == plan("ddp", 0, 30, 16, 6) and a != plan("ddp", 1, 30, 16, 6)
    assert sum(i["clean"] for i in a) == 5 and all(i["block"] == (i["step"] - 1) % 3 for i in a if not i["clean"])


def test_classification():
    injections = [
        {"step": 1, "clean": False, "rank": 3, "where": "output", "block": 0, "bit": 5},
        {"step": 2, "clean": False, "rank": 4, "where": "grad", "block": 1, "bit": 5},
        {"step": 3, "clean": False, "rank": 5, "where": "output", "block": 2, "bit": 5},
        {"step": 4, "clean": False, "rank": 6, "where": "grad", "block": 0, "bit": 0},
        {"step": 5, "clean": False, "rank": 7, "where": "grad", "block": 1, "bit": 5},
        {"step": 6, "clean": True},
    ]
    incidents = [
        _inc(1, [3], "layers.0.x1.output;layers.0.x1.grad_input"),  # localized
        _inc(2, [4], "layers.1.x1.grad_param"),  # localized
        _inc(3, [6], "layers.2.x1.output"),  # wrong rank
        _inc(5, [7], "layers.1.x1.output"),  # a backward fault cannot change the output
        _inc(6, [1], "layers.2.x1.output"),  # clean step flagged
        _inc(9, [2], "layers.2.x1.output"),  # nothing injected there
    ]
    rows = classify(injections, incidents)
    assert (rows["localized"], rows["masked"], rows["mislocalized"]) == (2, 1, 2)
    assert (rows["clean_accepted"], rows["false_positive"]) == (0, 2)
