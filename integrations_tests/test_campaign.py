"""The SDC campaign: its classification must be able to say missed, mislocalized and false positive, and one
short job must run end to end at the shipped settings."""

from __future__ import annotations

from integrations_tests.campaign import MAX_WINDOW, ROTATION, faults_of, plan, run
from integrations_tests.campaign_report import classify, markdown, p95, summarize
from scout_core.report import Incident


def _inc(step, ranks, surface, kind="sdc", scope="rank"):
    return Incident(kind=kind, scope=scope, ranks=ranks, step=step, surface=surface)


def test_plan_is_deterministic_and_draws_every_unit():
    a = plan(0, 40, ["ddp", "fsdp2", "hsdp"], [6, 8])
    assert a == plan(0, 40, ["ddp", "fsdp2", "hsdp"], [6, 8]) and a != plan(3, 40, ["ddp", "fsdp2", "hsdp"], [6, 8])
    assert a["layout"] == "ddp" and plan(1, 1, ["ddp", "fsdp2"], [6])["layout"] == "fsdp2"
    assert a["world"] in (6, 8) and a["replicas"] == a["world"] // 2
    assert all(1 <= d["gap"] <= ROTATION and 0 <= d["rank"] < a["world"] for d in a["defects"])
    assert {d["what"] for d in a["defects"]} == {"output", "grad", "weight", "update"}
    assert not any(d["module"] == "embed" and d["what"] == "grad" for d in a["defects"])
    assert all((d["module"] == "optimizer") == (d["what"] == "update") for d in a["defects"])


def test_a_defect_errs_on_every_step_from_its_onset():
    faults = faults_of({"rank": 3, "module": "layers.1", "what": "output", "bits": [2, 30]}, onset=41)
    assert [(f.surface, f.rank, f.bit) for f in faults] == [("layers.1.output", 3, 2), ("layers.1.output", 3, 30)]
    assert not faults[0].schedule.active(40) and all(faults[0].schedule.active(s) for s in (41, 100, 500))
    stuck = faults_of({"rank": 1, "module": "optimizer", "what": "update", "bits": [7]}, onset=5)
    assert stuck[0].surface == "optimizer.kernel.output"


def test_classification():
    defects = [{"rank": r, "module": m, "what": w} for r, m, w in [
        (3, "layers.1", "output"), (4, "head", "grad"), (5, "layers.1", "output"), (6, "optimizer", "update"),
        (7, "embed", "weight")]]
    windows = [(10, 30), (50, 170), (200, 220), (240, 260), (280, 300)]
    incidents = [
        _inc(20, [3], "layers.1.x1.output;layers.1.x1.grad_input"),  # localized, 10 steps after the onset
        # window 2: nothing (missed)
        _inc(220, [9], "layers.1.x1.output"),  # wrong rank: mislocalized, and a false positive
        _inc(260, [6], "layers.0.x1.output"),  # right rank, another unit's surface
        _inc(260, [2], "optimizer.replayed", kind="straggler"),  # a later record blaming another rank
        _inc(300, [7, 2], "embedding.x1.output"),  # two ranks: mislocalized
        _inc(40, [2], "layers.2.x1.output"),  # a clean gap flagged
        _inc(45, [], "replay", kind="inconclusive", scope="job"),  # no one named
    ]
    checks = [20, 40, 60, 80, 100, 120, 140, 160, 180, 200, 220, 240, 260, 280, 300, 320]
    rows = classify(defects, windows, incidents, checks, steps=320)
    assert (rows["localized"], rows["missed"], rows["mislocalized"]) == (2, 1, 2)
    assert rows["on_unit"] == 1 and rows["verdict_steps"] == [10, 20]
    assert rows["false_positive"] == 4  # r9 in window 3, r2 in window 4, r2 in window 5, r2 in the clean gap
    assert rows["unattributed"] == 1 and rows["clean_checks"] == 3  # steps 40, 180 and 320
    assert rows["by_unit"]["output"] == {"defects": 2, "localized": 1}
    assert p95(list(range(1, 101))) == 95 and p95([7]) == 7


def test_one_short_job_localizes_at_the_shipped_settings():
    summary = run(1, 2, ["ddp"], [6], tail=1)
    job = summary["jobs"][0]
    assert job["world"] == 6 and job["defects"] == 2
    assert (job["localized"], job["mislocalized"]) == (2, 0), job["details"]
    assert all(0 <= s < MAX_WINDOW for s in job["verdict_steps"])


def test_a_state_gone_non_finite_blames_nobody():
    """Every replica NaN before a check reached the unit: the job-scoped record names every rank, and is not a
    verdict on them."""
    from scout_core.checkpoint.finite import nonfinite_incident

    defects = [{"rank": 1, "module": "layers.0", "what": "output"}]
    rows = classify(defects, [(10, 129)], [nonfinite_incident(20, [0, 1, 2, 3], certifying=False)], [20], steps=129)
    assert (rows["missed"], rows["missed_nonfinite"], rows["false_positive"], rows["unattributed"]) == (1, 1, 0, 1)


def test_records_of_one_step_are_judged_together_whatever_their_order():
    defects = [{"rank": 3, "module": "layers.1", "what": "output"}]
    right, wrong = _inc(20, [3], "layers.1.x1.output"), _inc(20, [5], "layers.1.x1.output")
    for incidents in ([right, wrong], [wrong, right]):
        rows = classify(defects, [(10, 20)], incidents, [20], steps=20)
        assert (rows["localized"], rows["mislocalized"], rows["false_positive"]) == (0, 1, 1)


def test_the_table_shows_what_the_rows_hold():
    defects = [{"rank": 3, "module": "layers.1", "what": "output"}]
    rows = classify(defects, [(10, 20)], [_inc(20, [3], "layers.1.x1.output")], [20, 40], steps=40)
    job = {"job": 0, "layout": "ddp", "world": 6, "skipped_checks": [(40, "diagnosis_error")], **rows}
    summary = summarize({"interval": 20, "rotation_steps": 60, "max_window_steps": 120, "jobs": [job]})
    table = markdown(summary)
    assert "| ddp (6) | 1 | 1/1 (100 %) | 1 | 10 / 10 | 0 (0) | 0 | 0 / 1 | 0 | 1 |" in table
    assert "| wrong output | 1/1 (100 %) |" in table
