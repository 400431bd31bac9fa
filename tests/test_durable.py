"""Labels of a framework's own checkpoints (scout_core.checkpoint.durable): they follow the certifier, an SDC
verdict rejects what is newer than the verified generation for good, the restart picks by the retrieval policy,
and the file survives a restart, a torn write and a purge."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from scout_core.checkpoint.certify import BoundaryEvidence, Certifier, FailureKind
from scout_core.checkpoint.durable import LABELS_FILE, FrameworkCheckpoints

# Accepted checks after which every rank's coverage is complete (a later check's ``_every`` says otherwise).
CLEAN, SDC = BoundaryEvidence(covered=True), BoundaryEvidence(sdc=True)
STRAGGLER = BoundaryEvidence(straggler=True, covered=True)


def _every(k: int, step: int, evidence: BoundaryEvidence = CLEAN) -> BoundaryEvidence:
    """``evidence`` when coverage takes ``k`` checks, one a step: complete at every ``k``-th."""
    return dataclasses.replace(evidence, covered=evidence.covered and step % k == 0)


def _run(tmp_path, steps: dict[int, BoundaryEvidence], *, k: int = 1, saves=None, stop: bool = True):
    """Boundaries at each step (evidence as given, clean otherwise); the framework saves after each boundary."""
    cert = Certifier(static=k == 1)
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    for step in range(1, max(steps) + 1):
        evidence = _every(k, step, steps.get(step, CLEAN))
        action = cert.on_boundary(step, evidence)
        failure = FailureKind.SDC if evidence.sdc else FailureKind.STRAGGLER if evidence.straggler else None
        labels.on_boundary(step, action, cert, failure=failure, stopping=stop)
        if saves is None or step in saves:
            labels.saved(step, f"/ckpt/step-{step}", cert)
    return cert, labels


def _labels(labels: FrameworkCheckpoints) -> dict[int, str]:
    return {s: e["label"] for s, e in labels.entries.items()}


def test_static_certification_verifies_each_saved_step_and_sdc_rejects_the_newer(tmp_path):
    _, labels = _run(tmp_path, {5: SDC})
    assert _labels(labels) == {1: "verified", 2: "verified", 3: "verified", 4: "verified", 5: "rejected"}
    choice = labels.choose()
    assert (choice.step, choice.label, choice.failure) == (4, "verified", "sdc")


def test_cycles_label_candidates_before_they_are_verified(tmp_path):
    # K = 2: candidate at 2, promoted at 4 (candidate 4), promoted at 6 (candidate 6).
    cert, labels = _run(tmp_path, {7: CLEAN}, k=2)
    assert (cert.verified, cert.candidate) == (4, 6)
    assert _labels(labels) == {1: "verified", 2: "verified", 3: "verified", 4: "verified", 5: "candidate",
                               6: "candidate", 7: "latest"}


def test_after_an_sdc_verdict_nothing_newer_is_trusted_until_a_restart(tmp_path):
    """With ``actions.on_verdict: log`` training goes on over the corrupted state: later checks pass (the
    corruption is in everyone's state now) and the certifier verifies again, but no checkpoint of this run after
    the verdict may be loaded as clean."""
    cert = Certifier(static=True)
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    for step in (1, 2):
        labels.on_boundary(step, cert.on_boundary(step, CLEAN), cert)
        labels.saved(step, "", cert)
    labels.saved(3, "", cert)  # saved between checks: nothing vouches for it yet
    assert _labels(labels)[3] == "latest"
    labels.on_boundary(4, cert.on_boundary(4, SDC), cert, failure=FailureKind.SDC, stopping=False)
    for step in (5, 6):  # training goes on (actions.on_verdict: log) and checks pass again
        labels.on_boundary(step, cert.on_boundary(step, CLEAN), cert)
        labels.saved(step, "", cert)
    assert cert.verified == 6
    assert _labels(labels) == {1: "verified", 2: "verified", 3: "rejected", 5: "rejected", 6: "rejected"}
    assert labels.choose(FailureKind.SDC).step == 2
    assert labels.stopped_for is None  # nobody stopped for it: a restart is not bound by that verdict


def test_a_straggler_stop_loads_the_newest_verified(tmp_path):
    """Slowness is not divergence (a straggler's round verifies like a clean one), but a newer checkpoint may
    carry an SDC no check has reached yet and no sweep can run on a framework checkpoint: the newest verified."""
    _, labels = _run(tmp_path, {3: STRAGGLER}, saves={1, 3})
    assert labels.stopped_for == "straggler"
    assert labels.choose().step == 3
    assert labels.choose(FailureKind.SDC).step == 3  # the straggler's round verified 3
    _, labels = _run(tmp_path / "cycle", {4: STRAGGLER}, k=2, saves={1, 2, 3, 4})
    verified = max(s for s, e in labels.entries.items() if e["label"] == "verified")
    assert verified < 4 and labels.entries[4]["label"] != "rejected"
    choice = labels.choose()
    assert (choice.step, choice.label, choice.failure) == (verified, "verified", "straggler"), choice
    assert "no check has reached yet" in choice.reason


def test_an_unexplained_stop_loads_the_newest_verified(tmp_path):
    cert = Certifier()  # coverage in 2 checks
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    for step in (1, 2, 3, 4, 5):
        labels.on_boundary(step, cert.on_boundary(step, _every(2, step)), cert)
        labels.saved(step, "", cert)
    assert cert.verified == 2
    choice = FrameworkCheckpoints(str(tmp_path), writer=False).choose()  # the restart, reading the file
    assert (choice.step, choice.failure) == (2, "other")


def test_an_sdc_before_anything_was_verified_loads_nothing(tmp_path):
    _, labels = _run(tmp_path, {1: SDC})
    choice = labels.choose()
    assert choice.step is None and "no verified checkpoint" in choice.reason


def test_an_unexplained_stop_before_anything_was_verified_loads_the_newest_not_rejected(tmp_path):
    """A preemption early in a job (or within a long recipe cycle): no evidence says the state is bad, and
    starting over would throw the run away."""
    cert = Certifier()  # coverage in 4 checks
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    for step in (1, 2, 3):
        labels.on_boundary(step, cert.on_boundary(step, _every(4, step)), cert)
        labels.saved(step, "", cert)
    assert cert.verified is None
    choice = labels.choose()
    assert (choice.step, choice.label, choice.failure) == (3, "latest", "other") and "unproven" in choice.reason
    assert labels.choose(FailureKind.SDC).step is None


def test_the_seed_checkpoint_is_verified_and_never_rejected(tmp_path):
    cert = Certifier(static=True)
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    labels.saved(0, "", cert)
    labels.on_boundary(1, cert.on_boundary(1, SDC), cert, failure=FailureKind.SDC, stopping=True)
    assert labels.entries[0]["label"] == "verified" and labels.choose().step == 0


def test_a_second_sdc_after_a_restart_keeps_the_first_runs_verified_checkpoints(tmp_path):
    """The restarted job's certifier continues from the loaded step with its trust (handle.continue_from)."""
    _run(tmp_path, {5: SDC})
    restart = FrameworkCheckpoints(str(tmp_path), writer=True)
    loaded = restart.choose().step
    restart.restarted_from(loaded)
    cert = Certifier(static=True)
    cert.latest, cert.verified = loaded, restart.verified_at(loaded)  # what continue_from sets
    restart.on_boundary(5, cert.on_boundary(5, SDC), cert, failure=FailureKind.SDC, stopping=True)
    assert {s: e["label"] for s, e in restart.entries.items()} == {1: "verified", 2: "verified", 3: "verified",
                                                                     4: "verified"}
    assert restart.choose().step == 4


def test_a_scout_store_write_that_failed_never_rejects_what_replay_evidence_verified(tmp_path):
    """SCOUT's durable store is not the framework's: some rank could not write SCOUT's own generations 1 and 3
    (``not_durable``), yet the evidence verified steps 1-3, so the framework's checkpoints 1-3 stay verified after
    an SDC verdict (for these labels and for labels made later), while a restart from SCOUT's store is offered
    the newest generation every rank holds (2)."""
    from scout_core.checkpoint.labels import FrameworkLabels

    cert = Certifier(static=True)
    labels = FrameworkCheckpoints(str(tmp_path / "a"), writer=True)
    later = FrameworkLabels(writer=True, replay_on=True, new_certifier=None)
    for step in (1, 2, 3):
        action = cert.on_boundary(step, CLEAN)
        if step != 2:
            cert.not_durable(step, step, "rank 1 could not write it")
        else:
            cert.confirm(step, step)
        labels.on_boundary(step, action, cert)
        later.on_boundary(step, action, cert, failure=None, stopping=False, on_error=print)
        labels.saved(step, "", cert)
    assert (cert.verified, cert.durable, cert.retrievable) == (3, 2, 2)
    action = cert.on_boundary(4, SDC)
    labels.on_boundary(4, action, cert, failure=FailureKind.SDC, stopping=True)
    later.on_boundary(4, action, cert, failure=FailureKind.SDC, stopping=True, on_error=print)
    assert _labels(labels) == {1: "verified", 2: "verified", 3: "verified"}
    assert labels.choose().step == 3
    made_later = later.label(str(tmp_path / "b"))  # labels whose folder is known only now
    for step in (2, 3, 4):
        made_later.saved(step, "", cert)
    assert _labels(made_later)[3] == "verified" and _labels(made_later)[4] == "rejected", _labels(made_later)


def test_purged_or_incomplete_checkpoints_are_not_chosen(tmp_path):
    _, labels = _run(tmp_path, {5: SDC})
    assert labels.choose(exists=lambda s: s != 4).step == 3


def test_the_file_is_the_state_of_a_restart_and_the_restart_forgets_the_abandoned_steps(tmp_path):
    _run(tmp_path, {5: SDC})
    with open(tmp_path / LABELS_FILE) as fh:
        body = json.load(fh)
    assert body["stopped_for"] == "sdc" and body["checkpoints"]["5"]["label"] == "rejected"
    restart = FrameworkCheckpoints(str(tmp_path), writer=True)
    assert restart.choose().step == 4
    restart.restarted_from(4)
    again = FrameworkCheckpoints(str(tmp_path), writer=False)
    assert sorted(again.entries) == [1, 2, 3, 4] and again.stopped_for is None
    assert not os.path.exists(tmp_path / f"{LABELS_FILE}.tmp")


def test_only_the_writer_writes(tmp_path):
    _run(tmp_path / "a", {2: CLEAN})
    cert = Certifier(static=True)
    reader = FrameworkCheckpoints(str(tmp_path / "b"), writer=False)
    reader.saved(1, "", cert)
    assert not os.path.exists(tmp_path / "b" / LABELS_FILE)


@pytest.mark.parametrize("content", ["{\"checkpoints\": {\"1\": ", "[1, 2]", "not json"])
def test_a_torn_or_foreign_file_means_no_labels_not_a_crash(tmp_path, content):
    (tmp_path / LABELS_FILE).write_text(content)
    labels = FrameworkCheckpoints(str(tmp_path), writer=False)
    assert labels.entries == {} and labels.choose().step is None


def test_a_restarted_job_keeps_the_labels_its_predecessor_earned(tmp_path):
    _run(tmp_path, {5: SDC})
    restart = FrameworkCheckpoints(str(tmp_path), writer=True)
    restart.restarted_from(restart.choose().step)
    fresh = Certifier(static=True)  # the restarted job's certifier knows nothing yet
    restart.saved(5, "", fresh)
    assert {s: e["label"] for s, e in restart.entries.items()} == {1: "verified", 2: "verified", 3: "verified",
                                                                     4: "verified", 5: "latest"}
    restart.on_boundary(6, fresh.on_boundary(6, CLEAN), fresh)
    assert restart.entries[5]["label"] == "verified"


def test_a_run_that_ended_normally_is_relaunched_from_its_newest_checkpoint(tmp_path):
    """A normal end (SCOUT closed after the last step, no failure, no verdict) is not an unexplained stop: the
    relaunch goes on from the newest checkpoint not rejected, unverified as a job's last save usually is; a later
    save of the relaunched run, or a verdict, takes that back."""
    cert = Certifier()  # coverage in 2 checks
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    for step in (1, 2, 3, 4, 5):
        labels.on_boundary(step, cert.on_boundary(step, _every(2, step)), cert)
        labels.saved(step, "", cert)
    labels.ended()
    choice = FrameworkCheckpoints(str(tmp_path), writer=False).choose()
    assert (choice.step, choice.label) == (5, "latest")
    again = FrameworkCheckpoints(str(tmp_path), writer=True)
    again.restarted_from(5)  # a load is repeatable: a second job loading the folder (an evaluation) finds 5 too,
    for _ in range(2):  # and so does a relaunch whose run failed before its first save
        assert FrameworkCheckpoints(str(tmp_path), writer=False).choose().step == 5
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    labels.saved(6, "", cert)  # the run goes on: an unexplained stop now goes back to the newest verified
    assert FrameworkCheckpoints(str(tmp_path), writer=False).choose().step == 2


def test_a_verdicts_stop_is_never_taken_for_a_normal_end(tmp_path):
    _cert, labels = _run(tmp_path, {5: SDC})
    labels.ended()
    choice = FrameworkCheckpoints(str(tmp_path), writer=False).choose()
    assert (choice.step, choice.failure) == (4, "sdc")


def test_a_folder_saved_to_again_no_longer_vouches_for_the_step_it_held(tmp_path):
    """A rolling tag (DeepSpeed's ``save_checkpoint(dir, "last")``): each save overwrites the folder, so only the
    newest step it holds keeps a label; after an SDC a restart finds nothing verified there, not the rejected state
    under an older step's verified label."""
    cert = Certifier(static=True)
    labels = FrameworkCheckpoints(str(tmp_path), writer=True)
    for step in (1, 2, 3):
        labels.on_boundary(step, cert.on_boundary(step, CLEAN), cert)
        labels.saved(step, "/ckpt/last", cert)
    action = cert.on_boundary(4, SDC)
    labels.on_boundary(4, action, cert, failure=FailureKind.SDC, stopping=True)
    labels.saved(4, "/ckpt/last", cert)
    assert _labels(labels) == {4: "rejected"}
    assert labels.choose().step is None


def test_a_restart_that_names_a_rejected_checkpoint_is_refused_unless_allowed(tmp_path, caplog):
    from scout_core.checkpoint.durable import RejectedCheckpointError, refuse_rejected

    fc = FrameworkCheckpoints(str(tmp_path), writer=True)
    fc.entries = {s: {"label": lab, "path": str(tmp_path / f"step{s}"), "saved_unix": 0.0}
                  for s, lab in {2: "verified", 4: "rejected"}.items()}
    fc._write()

    def named(step):
        return lambda s, _entry: s == step

    with pytest.raises(RejectedCheckpointError, match=r"step4 is labelled rejected.*newest verified.* step 2"):
        refuse_rejected(str(tmp_path), named(4), "step4", who="test", allowed=False)
    refuse_rejected(str(tmp_path), named(2), "step2", who="test", allowed=False)  # verified: loaded
    refuse_rejected(str(tmp_path), named(9), "step9", who="test", allowed=False)  # not labelled: loaded
    refuse_rejected(str(tmp_path / "elsewhere"), named(4), "step4", who="test", allowed=False)  # no labels
    with caplog.at_level("WARNING", logger="scout"):
        refuse_rejected(str(tmp_path), named(4), "step4", who="test", allowed=True)
    assert "loading it as asked" in caplog.text


def test_a_foreign_label_entry_never_stops_the_refusal_check_half_way(tmp_path, caplog):
    """Rank 0 reads the labels before the broadcast the other ranks wait in: an entry without the keys a matcher
    reads must not raise there (the others would wait until the process group's timeout)."""
    from scout_core.checkpoint.durable import refuse_rejected

    (tmp_path / LABELS_FILE).write_text(json.dumps({"checkpoints": {"3": {"label": "rejected"}}}))
    with caplog.at_level("ERROR", logger="scout"):
        refuse_rejected(str(tmp_path), lambda _s, entry: entry["path"].endswith("x"), "tag x", who="test",
                        allowed=False)
    assert "cannot read the labels" in caplog.text
