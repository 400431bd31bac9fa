"""The restart plan on Megatron's own checkpoint folder (rank 0's part, on files)."""

from __future__ import annotations

import os

import pytest

from scout_core.checkpoint.durable import FrameworkCheckpoints
from scout_megatron import checkpoints
from scout_megatron.checkpoints import SET_ASIDE, TRACKER, complete, iteration_dir


def job(tmp_path, labels: dict[int, str], *, stopped_for=None, ended=False, tracker=None) -> str:
    """A --save folder as a stopped or ended run leaves it: complete torch_dist iterations, its tracker, labels."""
    folder = str(tmp_path / "ckpt")
    for it in labels:
        os.makedirs(iteration_dir(folder, it))
        for name in (".metadata", "metadata.json"):
            open(os.path.join(iteration_dir(folder, it), name), "w").close()
    with open(os.path.join(folder, TRACKER), "w") as fh:
        fh.write(str(tracker if tracker is not None else max(labels)))
    fc = FrameworkCheckpoints(folder, writer=True)
    fc.entries = {it: {"label": label, "path": iteration_dir(folder, it), "saved_unix": 0.0}
                  for it, label in labels.items()}
    fc.stopped_for, fc.ended_normally = stopped_for, ended
    fc._write()
    return folder


def tracked(folder: str) -> int:
    with open(os.path.join(folder, TRACKER)) as fh:
        return int(fh.read())


def test_after_an_sdc_stop_the_newest_verified_iteration_and_the_rest_set_aside(tmp_path):
    folder = job(tmp_path, {1: "verified", 2: "verified", 3: "rejected", 4: "rejected"}, stopped_for="sdc")
    os.makedirs(os.path.join(folder, "non_persistent"))
    plan = checkpoints._plan(folder, None)
    assert plan["load"] == 2 and tracked(folder) == 2
    assert checkpoints.iterations(folder) == [1, 2]
    moved = sorted(os.listdir(os.path.join(folder, SET_ASIDE)))
    assert [m.split("-")[0] for m in moved] == ["iter_0000003", "iter_0000004", "non_persistent"]
    after = FrameworkCheckpoints(folder, writer=False)
    assert sorted(after.entries) == [1, 2] and after.stopped_for is None


def test_a_run_that_ended_normally_goes_on_from_its_newest_checkpoint_unverified_or_not(tmp_path):
    """A job's last save (end of its iterations, a planned exit) usually comes between two checks."""
    folder = job(tmp_path, {1000: "verified", 1537: "latest"}, ended=True)
    assert checkpoints._plan(folder, None)["load"] == 1537
    assert tracked(folder) == 1537 and checkpoints.iterations(folder) == [1000, 1537]


def test_an_unexplained_stop_goes_back_to_the_newest_verified(tmp_path):
    folder = job(tmp_path, {1000: "verified", 1537: "latest"})
    assert checkpoints._plan(folder, None)["load"] == 1000 and checkpoints.iterations(folder) == [1000]


def test_a_plan_that_fails_half_way_keeps_why_the_job_stopped(tmp_path, monkeypatch):
    folder = job(tmp_path, {1: "verified", 2: "rejected"}, stopped_for="sdc")

    def broken(*_a, **_k):
        raise OSError("read-only file system")

    monkeypatch.setattr(checkpoints, "point_tracker", broken)
    with pytest.raises(OSError):
        checkpoints._plan(folder, None)
    assert FrameworkCheckpoints(folder, writer=False).stopped_for == "sdc"  # the launch still stops on it


def test_ckpt_step_is_loaded_as_asked(tmp_path):
    folder = job(tmp_path, {1: "verified", 2: "latest"}, stopped_for="sdc")
    assert checkpoints._plan(folder, 2)["load"] == 2 and checkpoints.iterations(folder) == [1, 2]


def test_a_distributed_checkpoint_is_complete_only_with_its_metadata_json(tmp_path):
    folder = str(tmp_path)
    where = iteration_dir(folder, 5)
    os.makedirs(where)
    open(os.path.join(where, ".metadata"), "w").close()
    assert not complete(folder, 5)  # the coordinator's .metadata comes before metadata.json
    open(os.path.join(where, "metadata.json"), "w").close()
    assert complete(folder, 5)


def test_nothing_labelled_leaves_megatron_its_own_choice(tmp_path):
    folder = str(tmp_path / "fresh")
    os.makedirs(folder)
    assert checkpoints._plan(folder, None) is None


def test_ckpt_step_of_an_iteration_labelled_rejected_is_refused(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from scout_core.checkpoint.durable import RejectedCheckpointError

    folder = job(tmp_path, {1: "verified", 2: "rejected"}, stopped_for="sdc")
    monkeypatch.setattr(checkpoints, "dist", SimpleNamespace(is_initialized=lambda: True))
    with pytest.raises(RejectedCheckpointError, match="--ckpt-step 2 is labelled rejected"):
        checkpoints.plan_restart(folder, 2)
    assert tracked(folder) == 2 and checkpoints.iterations(folder) == [1, 2]  # nothing moved or repointed
