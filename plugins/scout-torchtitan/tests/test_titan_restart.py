"""The restart plan of ScoutCheckpointManager (rank 0's part), on real folders: which step TorchTitan loads,
what is set aside, and what is never touched."""

from __future__ import annotations

import os

import pytest

from scout_core.checkpoint.certify import BoundaryEvidence, Certifier, FailureKind
from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_torchtitan.checkpointer import SET_ASIDE, ScoutCheckpointManager, evidence_of_sdc


class _Manager:
    """Rank 0's side of ScoutCheckpointManager's restart, over a folder of ``step-N`` checkpoints."""

    _plan = ScoutCheckpointManager._plan
    _complete = ScoutCheckpointManager._complete
    _step_folders = ScoutCheckpointManager._step_folders
    _set_aside = ScoutCheckpointManager._set_aside

    def __init__(self, folder: str, *, load_only: bool = False) -> None:
        self.folder, self.load_only = folder, load_only
        self._failure = None
        self.labels = FrameworkCheckpoints(folder, writer=True)

    def _create_checkpoint_id(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _find_load_step(self) -> int:
        steps = [s for s in self._step_folders() if self._complete(s)]
        return max(steps) if steps else -1


def _job(tmp_path, sdc_at: int | None, steps: int = 5, *, unlabelled: tuple[int, ...] = ()) -> _Manager:
    """A run that saved a complete DCP checkpoint every step (and some folders SCOUT never labelled)."""
    m = _Manager(str(tmp_path))
    cert = Certifier(static=True)
    for step in range(1, steps + 1):
        evidence = BoundaryEvidence(sdc=step == sdc_at, covered=True)  # every check replays a layer
        m.labels.on_boundary(step, cert.on_boundary(step, evidence), cert,
                             failure=FailureKind.SDC if evidence.sdc else None, stopping=True)
        _dcp(tmp_path, step)
        m.labels.saved(step, m._create_checkpoint_id(step), cert)
    for step in unlabelled:
        _dcp(tmp_path, step)
    return _Manager(str(tmp_path))  # the restarted job reads the labels


def _dcp(tmp_path, step: int) -> None:
    os.makedirs(tmp_path / f"step-{step}", exist_ok=True)
    (tmp_path / f"step-{step}" / ".metadata").write_text("")


def _left(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n.startswith("step-"))


def test_after_sdc_the_newest_verified_is_loaded_and_what_is_newer_set_aside(tmp_path):
    m = _job(tmp_path, sdc_at=5, unlabelled=(6,))  # step 6: saved, but its label never written
    plan = m._plan(-1)
    assert plan["load"] == 4 and _left(tmp_path) == ["step-1", "step-2", "step-3", "step-4"]
    assert sorted(os.listdir(tmp_path / SET_ASIDE))[0].startswith("step-5-")
    assert sorted(plan["entries"]) == ["1", "2", "3", "4"] and len(m.labels.set_aside) == 2


def test_with_nothing_safe_every_labelled_checkpoint_goes_and_the_older_unlabelled_one_is_loaded(tmp_path):
    _dcp(tmp_path, 0)  # a checkpoint of a run before SCOUT (or a seed): never labelled
    m = _job(tmp_path, sdc_at=1, steps=3)
    plan = m._plan(-1)
    assert plan["load"] == 0 and _left(tmp_path) == ["step-0"] and m.labels.entries == {}


def test_an_explicit_load_step_moves_nothing_and_a_wrong_one_fails_before_anything_changes(tmp_path):
    m = _job(tmp_path, sdc_at=5)
    with pytest.raises(FileNotFoundError, match="1050"):
        m._plan(1050)
    assert _left(tmp_path) == [f"step-{s}" for s in range(1, 6)] and sorted(m.labels.entries) == [1, 2, 3, 4, 5]
    plan = m._plan(2)
    assert plan["load"] == 2 and _left(tmp_path) == [f"step-{s}" for s in range(1, 6)]
    assert sorted(m.labels.entries) == [1, 2]  # the abandoned steps' labels go; the new run overwrites them


def test_an_explicit_load_step_labelled_rejected_is_refused_unless_the_config_allows_it(tmp_path):
    """--checkpoint.load_step of the step an SDC verdict rejected: refused on every rank (the plan carries why,
    nothing moved or relabelled); with checkpoint.load_rejected, loaded as asked."""
    from types import SimpleNamespace

    from scout_core.config import load

    m = _job(tmp_path, sdc_at=5)
    m.scout = SimpleNamespace(config=load(values={"checkpoint.load_rejected": False}))
    plan = m._plan(5)
    assert set(plan) == {"rejected"} and "--checkpoint.load_step 5 is labelled rejected" in plan["rejected"]
    assert "newest verified checkpoint is step 4" in plan["rejected"]
    assert _left(tmp_path) == [f"step-{s}" for s in range(1, 6)] and sorted(m.labels.entries) == [1, 2, 3, 4, 5]
    m.scout = SimpleNamespace(config=load(values={"checkpoint.load_rejected": True}))
    plan = m._plan(5)
    assert plan["load"] == 5 and "rejected" in plan


def test_a_load_only_job_or_an_unlabelled_folder_is_left_to_torchtitan(tmp_path):
    _job(tmp_path, sdc_at=5)
    reader = _Manager(str(tmp_path), load_only=True)
    assert reader._plan(-1) is None and _left(tmp_path) == [f"step-{s}" for s in range(1, 6)]
    assert _Manager(str(tmp_path / "fresh"))._plan(-1) is None


def test_incomplete_checkpoints_are_not_chosen(tmp_path):
    m = _job(tmp_path, sdc_at=5)
    os.remove(tmp_path / "step-4" / ".metadata")  # a save that never finished
    assert m._plan(-1)["load"] == 3


def test_a_restored_scout_snapshot_newer_than_the_chosen_checkpoint_stays_and_later_folders_go(tmp_path):
    """SCOUT restored its snapshot of step 4 (--scout.checkpoint.enabled): TorchTitan loads nothing over it, its
    step folders after 4 (the rejected 5, the unlabelled 6) are set aside, the labels go on from 4."""
    m = _job(tmp_path, sdc_at=5, unlabelled=(6,))
    plan = m._plan(-1, restored=4)
    assert plan["load"] is None and _left(tmp_path) == ["step-1", "step-2", "step-3", "step-4"]
    assert sorted(plan["entries"]) == ["1", "2", "3", "4"]


def test_a_checkpoint_the_labels_trust_newer_than_scouts_snapshot_is_loaded_over_it(tmp_path):
    """SCOUT could restore only an older snapshot (step 2): TorchTitan's verified step 4 is newer and is loaded."""
    m = _job(tmp_path, sdc_at=5)
    plan = m._plan(-1, restored=2)
    assert plan["load"] == 4 and _left(tmp_path) == ["step-1", "step-2", "step-3", "step-4"]


def test_only_a_verified_torchtitan_checkpoint_replaces_scouts_restored_snapshot(tmp_path):
    """After a crash SCOUT restores its swept-clean latest snapshot (step 2); TorchTitan's step 3, newer but never
    verified, must not be loaded over it."""
    m = _job(tmp_path, sdc_at=None, steps=3)
    m.labels.entries = {s: {**e, "label": "candidate"} for s, e in m.labels.entries.items()}
    m._failure = "sdc"  # what load() sets whenever SCOUT restored a snapshot
    plan = m._plan(-1, restored=2)
    assert plan["load"] is None and _left(tmp_path) == ["step-1", "step-2"]


def test_when_scouts_sweep_found_its_latest_dirty_no_unverified_torchtitan_checkpoint_is_loaded(tmp_path):
    """A straggler stopped the job before anything was verified; SCOUT's restart swept its latest snapshot, found
    SDC and restored nothing. TorchTitan's newest holds the same suspect state: it must not be loaded either
    (load() passes "sdc" on from the sweep), while a crash with no evidence keeps the newest, unproven."""
    m = _job(tmp_path, sdc_at=None, steps=3)
    m.labels.entries = {s: {**e, "label": "candidate"} for s, e in m.labels.entries.items()}
    m.labels.stopped_for = "straggler"
    assert m._plan(-1)["load"] == 3  # no sweep said anything: the newest, unproven (the reason says so)
    m = _job(tmp_path / "swept", sdc_at=None, steps=3)
    m.labels.entries = {s: {**e, "label": "candidate"} for s, e in m.labels.entries.items()}
    m.labels.stopped_for = "straggler"
    m._failure = "sdc" if evidence_of_sdc({"failure": "straggler", "sweep_clean": False}) else None  # as load()
    plan = m._plan(-1)
    assert plan["load"] == -1 and _left(tmp_path / "swept") == []


def test_only_evidence_of_sdc_keeps_unverified_torchtitan_checkpoints_out():
    """A dirty sweep or an SDC stop is evidence against the newest state; a lost machine (a drained straggler's,
    a rebooted node's) or a sweep that could not run is not: the labels' own policy holds."""
    assert evidence_of_sdc({"failure": "straggler", "sweep_clean": False})
    assert evidence_of_sdc({"failure": "other", "sweep_clean": False})
    assert evidence_of_sdc({"failure": "sdc", "sweep_clean": None})
    assert not evidence_of_sdc({"failure": "machine_unreachable", "sweep_clean": None})
    assert not evidence_of_sdc({"failure": "other", "sweep_clean": None, "sweep_failed": True})
    assert not evidence_of_sdc({"failure": "straggler", "sweep_clean": True})
    assert not evidence_of_sdc({}) and not evidence_of_sdc(None)
