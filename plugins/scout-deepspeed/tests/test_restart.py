"""The restart plan on DeepSpeed's checkpoint folder: the chosen tag in `latest`, newer tags set aside."""

import os

from scout_core.checkpoint.durable import LABELS_FILE, SET_ASIDE, FrameworkCheckpoints
from scout_deepspeed import checkpoints


def job(tmp_path, labels, stopped_for=None, latest="global_step3"):
    folder = str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    for step in labels:
        os.makedirs(os.path.join(folder, f"global_step{step}"))
    with open(os.path.join(folder, "latest"), "w") as fh:
        fh.write(latest)
    entries = {str(s): {"label": lab, "path": os.path.join(folder, f"global_step{s}"), "saved_unix": 0.0}
               for s, lab in labels.items()}
    import json

    with open(os.path.join(folder, LABELS_FILE), "w") as fh:
        json.dump({"checkpoints": entries, "stopped_for": stopped_for}, fh)
    return folder


def test_after_an_sdc_stop_latest_names_the_newest_verified_tag(tmp_path):
    folder = job(tmp_path, {1: "verified", 2: "verified", 3: "rejected"}, stopped_for="sdc")
    plan = checkpoints._plan(folder)
    assert plan["load"] == "global_step2" and plan["step"] == 2
    assert open(os.path.join(folder, "latest")).read() == "global_step2"
    assert sorted(os.listdir(folder)) == ["global_step1", "global_step2", "latest", LABELS_FILE, SET_ASIDE]
    assert os.listdir(os.path.join(folder, SET_ASIDE))[0].startswith("global_step3-")
    labels = FrameworkCheckpoints(folder, writer=False)
    assert sorted(labels.entries) == [1, 2] and labels.stopped_for is None


def test_a_newer_tag_without_a_label_is_deepspeeds_choice_unless_the_job_stopped_for_sdc(tmp_path):
    """A tag SCOUT did not label (saved while it was off, or its labelling failed) that latest names is not
    abandoned to be overwritten by the next save; after an SDC stop it is set aside with the newer tags."""
    folder = job(tmp_path / "a", {10: "verified", 20: "latest"}, latest="global_step30")
    os.makedirs(os.path.join(folder, "global_step30"))
    assert checkpoints._plan(folder) is None and open(os.path.join(folder, "latest")).read() == "global_step30"
    folder = job(tmp_path / "b", {10: "verified", 20: "rejected"}, stopped_for="sdc", latest="global_step30")
    os.makedirs(os.path.join(folder, "global_step30"))
    assert checkpoints._plan(folder)["load"] == "global_step10"
    assert sorted(p.split("-")[0] for p in os.listdir(os.path.join(folder, SET_ASIDE))) == [
        "global_step20", "global_step30"]


def test_a_load_is_repeatable(tmp_path):
    """A second load of the folder (an evaluation job with the same config, or a relaunch that failed before
    its first save) loads what the first did, and moves nothing."""
    folder = job(tmp_path, {950: "verified", 1000: "latest"}, latest="global_step1000")
    labels = FrameworkCheckpoints(folder, writer=True)
    labels.ended()
    assert [checkpoints._plan(folder)["load"] for _ in range(2)] == ["global_step1000"] * 2
    assert not os.path.exists(os.path.join(folder, SET_ASIDE))


def test_nothing_safe_sets_latest_aside(tmp_path):
    folder = job(tmp_path, {1: "latest"}, stopped_for="sdc")
    plan = checkpoints._plan(folder)
    assert plan["load"] is None and not os.path.exists(os.path.join(folder, "latest"))


def test_a_folder_without_labels_is_deepspeeds_own_choice(tmp_path):
    os.makedirs(tmp_path / "global_step5")
    assert checkpoints._plan(str(tmp_path)) is None and os.path.isdir(tmp_path / "global_step5")


def test_loads_that_are_not_this_jobs_restart_are_left_to_deepspeed():
    from types import SimpleNamespace

    engine = SimpleNamespace(load_universal_checkpoint=lambda: False, use_node_local_storage=lambda: False)
    assert checkpoints._no_plan(engine, None) is None
    assert "tag" in checkpoints._no_plan(engine, "global_step7")
    universal = SimpleNamespace(load_universal_checkpoint=lambda: True, use_node_local_storage=lambda: False)
    assert "universal" in checkpoints._no_plan(universal, None)
    local = SimpleNamespace(load_universal_checkpoint=lambda: False, use_node_local_storage=lambda: True)
    assert "node-local" in checkpoints._no_plan(local, None)


def test_an_explicit_tag_labelled_rejected_is_refused_unless_the_config_allows_it(tmp_path):
    """A script that always passes a tag (`--resume-tag`) must not restore the state an SDC verdict rejected."""
    import contextlib
    from types import SimpleNamespace

    import pytest

    from scout_core.checkpoint.durable import RejectedCheckpointError
    from scout_core.config import load

    folder = job(tmp_path, {1: "verified", 2: "verified", 3: "rejected"}, stopped_for="sdc")
    loaded = []
    for allowed in (False, True):
        config = load(values={"checkpoint.load_rejected": allowed})
        handle = SimpleNamespace(config=config, rank=0, checkpoint_io=lambda _what: contextlib.nullcontext(),
                                 certify_framework_checkpoints=lambda: None)
        engine = SimpleNamespace(save_checkpoint=None, load_checkpoint=lambda d, tag=None, **_k: loaded.append(tag),
                                 load_universal_checkpoint=lambda: False, use_node_local_storage=lambda: False)
        checkpoints.install(handle, engine)
        engine.load_checkpoint(folder, "global_step2")  # verified: loaded as asked
        if allowed:
            engine.load_checkpoint(folder, "global_step3")
        else:
            with pytest.raises(RejectedCheckpointError, match="tag global_step3 is labelled rejected"):
                engine.load_checkpoint(folder, "global_step3")
    assert loaded == ["global_step2", "global_step2", "global_step3"]


class _Handle:
    """What install() uses of a ScoutHandle, with the real labels."""

    def __init__(self):
        from scout_core.checkpoint.certify import Certifier
        from scout_core.config import ScoutConfig

        self.config, self.rank, self.framework_checkpoints = ScoutConfig(), 0, None
        self.certifier = Certifier(static=True)
        self.continued = []

    def checkpoint_io(self, _what):
        import contextlib

        return contextlib.nullcontext()

    def certify_framework_checkpoints(self):
        pass

    def label_framework_checkpoints(self, folder):
        self.framework_checkpoints = FrameworkCheckpoints(folder, writer=True)
        return self.framework_checkpoints

    def continue_from(self, step, *, verified):
        self.continued.append((step, verified))


def test_the_folder_a_run_loaded_from_is_labelled_until_it_saves_elsewhere(tmp_path):
    """A relaunch from a normal end (1000, unverified) stopped by an SDC verdict before its first save: the
    verdict must reach the folder it loaded from, or the next relaunch loads 1000 again as a normal end."""
    from types import SimpleNamespace

    from scout_core.checkpoint.certify import Action, FailureKind

    folder = job(tmp_path / "run", {950: "verified", 1000: "latest"}, latest="global_step1000")
    FrameworkCheckpoints(folder, writer=True).ended()
    handle = _Handle()
    engine = SimpleNamespace(save_checkpoint=lambda d, tag=None, **_k: None, global_steps=1000,
                             load_checkpoint=lambda d, tag=None, **_k: ("global_step1000", {}),
                             load_universal_checkpoint=lambda: False, use_node_local_storage=lambda: False)
    checkpoints.install(handle, engine)
    engine.load_checkpoint(folder)
    assert handle.framework_checkpoints.folder == folder and handle.continued == [(1000, 950)]
    cert = handle.certifier
    cert.verified = 950  # what continue_from sets: the trust of the state loaded
    handle.framework_checkpoints.on_boundary(1005, Action.RECOVER, cert, failure=FailureKind.SDC, stopping=True)
    assert checkpoints._plan(folder)["load"] == "global_step950"
    other = str(tmp_path / "elsewhere")  # a run that saves to another folder than it loaded from labels that one
    engine.global_steps = 1010
    engine.save_checkpoint(other)
    assert handle.framework_checkpoints.folder == other
    engine.save_checkpoint(str(tmp_path / "third"))
    assert handle.framework_checkpoints.folder == other  # one folder for good
