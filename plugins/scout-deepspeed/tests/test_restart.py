"""The restart plan on DeepSpeed's checkpoint folder: the chosen tag in `latest`, newer tags set aside."""

import os

from scout_core.checkpoint.durable import LABELS_FILE, SET_ASIDE, FrameworkCheckpoints
from scout_deepspeed import checkpoints


def job(tmp_path, labels, stopped_for=None, latest="global_step3"):
    folder = str(tmp_path)
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
        handle = SimpleNamespace(config=config, rank=0, checkpoint_io=lambda _what: contextlib.nullcontext())
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
