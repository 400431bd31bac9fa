"""The restart plan on a ModelCheckpoint folder: ``last.ckpt`` made to hold the checkpoint SCOUT chose (what
Lightning's ``ckpt_path="last"`` then loads), the newer files set aside; the callback's refusals."""

from __future__ import annotations

import json
import os

import pytest

from scout_core.checkpoint.durable import LABELS_FILE, SET_ASIDE, FrameworkCheckpoints, RejectedCheckpointError
from scout_core.config import ConfigError
from scout_lightning import checkpoints
from scout_lightning.callback import ScoutCallback, _closure_first, _model_of


def job(folder, labels, stopped_for=None, last=None):
    os.makedirs(folder, exist_ok=True)
    for step in labels:
        (folder / f"epoch=0-step={step}.ckpt").write_bytes(f"state of step {step}".encode())
    (folder / "last.ckpt").write_bytes(f"state of step {last or max(labels)}".encode())
    entries = {str(s): {"label": lab, "path": str(folder / f"epoch=0-step={s}.ckpt"), "saved_unix": 0.0}
               for s, lab in labels.items()}
    (folder / LABELS_FILE).write_text(json.dumps({"checkpoints": entries, "stopped_for": stopped_for}))
    return str(folder)


def aside(folder):
    return sorted(n.split(".ckpt")[0] for n in os.listdir(os.path.join(folder, SET_ASIDE)))


def test_after_an_sdc_stop_last_holds_the_newest_verified_checkpoint(tmp_path):
    folder = job(tmp_path, {20: "verified", 40: "verified", 60: "rejected"}, stopped_for="sdc")
    plan = checkpoints._plan(folder, [], [], str(tmp_path / "last.ckpt"))
    assert plan["step"] == 40
    assert (tmp_path / "last.ckpt").read_bytes() == b"state of step 40"
    assert (tmp_path / "epoch=0-step=40.ckpt").read_bytes() == b"state of step 40"  # a copy: Lightning rewrites last
    assert not os.path.samefile(tmp_path / "last.ckpt", tmp_path / "epoch=0-step=40.ckpt")
    assert aside(folder) == ["epoch=0-step=60", "last"]
    labels = FrameworkCheckpoints(folder, writer=False)
    assert sorted(labels.entries) == [20, 40] and labels.stopped_for is None


def test_without_a_verdict_stop_last_is_lightnings_own_choice(tmp_path):
    """A normal end (or a crash no verdict explains) goes on from Lightning's newest file, even where last.ckpt holds
    a step no step file was kept for (ModelCheckpoint(monitor=..., save_top_k=k, save_last=True))."""
    folder = job(tmp_path, {40: "verified", 60: "latest"}, last=200)
    FrameworkCheckpoints(folder, writer=True).ended()
    assert checkpoints._plan(folder, [], [], str(tmp_path / "last.ckpt")) is None
    assert (tmp_path / "last.ckpt").read_bytes() == b"state of step 200"
    crashed = tmp_path / "crash"
    assert checkpoints._plan(job(crashed, {40: "verified"}), [], [], str(crashed / "last.ckpt")) is None


def test_after_a_verdict_every_unlabelled_file_leaves_and_the_resolved_path_holds_the_choice(tmp_path):
    """last.ckpt holding a step past the kept files, a save on an exception (OnExceptionCheckpoint, in a folder of its
    own) and another ModelCheckpoint's last.ckpt: all leave Lightning's reach, and the chosen file is copied to the
    path "last" resolved to, wherever that is."""
    other, errors = tmp_path / "best", tmp_path / "errors"
    for where, name in ((other, "last.ckpt"), (errors, "on_exception.ckpt")):
        where.mkdir()
        (where / name).write_bytes(b"state of step 210")
    folder = job(tmp_path / "main", {40: "verified", 60: "verified"}, stopped_for="sdc", last=200)
    exception = str(errors / "on_exception.ckpt")
    plan = checkpoints._plan(folder, [str(other)], [exception], exception)
    assert plan["step"] == 60 and (errors / "on_exception.ckpt").read_bytes() == b"state of step 60"
    assert aside(folder) == ["last"] and aside(other) == ["last"] and aside(errors) == ["on_exception"]
    assert not (tmp_path / "main" / "last.ckpt").exists() and not (other / "last.ckpt").exists()


def test_nothing_safe_sets_every_file_aside(tmp_path):
    folder = job(tmp_path, {20: "latest", 40: "rejected"}, stopped_for="sdc")
    assert checkpoints._plan(folder, [], [], str(tmp_path / "last.ckpt"))["load"] is None
    assert not (tmp_path / "last.ckpt").exists() and not (tmp_path / "epoch=0-step=20.ckpt").exists()


def test_a_verdict_logged_without_a_stop_still_steers_last_and_a_file_no_one_steers_is_refused(tmp_path):
    """on_verdict: log rejects what was saved after the verdict without stopping: "last" must not load it either.
    A path outside the checkpoint folders (an hpc_ckpt) is not one SCOUT can vouch for: the plan refuses it."""
    folder = job(tmp_path, {20: "verified", 40: "rejected"})
    assert checkpoints._plan(folder, [], [], str(tmp_path / "last.ckpt"))["step"] == 20
    folder = job(tmp_path / "b", {20: "verified", 40: "rejected"}, stopped_for="sdc")
    with pytest.raises(RuntimeError, match="does not steer"):
        checkpoints._plan(folder, [], [], str(tmp_path / "hpc_ckpt_1.ckpt"))
    assert checkpoints._plan(folder, [], [], None) is None  # Lightning loads nothing: a fresh start


def test_a_run_that_starts_elsewhere_after_a_verdict_stop_abandons_the_stopped_run(tmp_path):
    """A file the user named (or a fresh start) after an SDC stop: the stopped run's newer files and last.ckpt leave,
    and the stop no longer stands, so a later "last" does not roll this run back for it."""
    folder = job(tmp_path, {20: "verified", 40: "verified", 60: "rejected"}, stopped_for="sdc")
    assert checkpoints._adopt(folder, str(tmp_path / "epoch=0-step=40.ckpt"), 40) == {"step": 40, "set_aside": 2}
    labels = FrameworkCheckpoints(folder, writer=False)
    assert sorted(labels.entries) == [20, 40] and labels.stopped_for is None and aside(folder) == [
        "epoch=0-step=60", "last"]
    assert checkpoints._adopt(folder, None, 0) is None  # nothing stands any more
    fresh = job(tmp_path / "fresh", {20: "verified", 40: "rejected"}, stopped_for="sdc")
    assert checkpoints._adopt(fresh, None, 0) == {"step": None, "set_aside": 3}


def test_a_last_only_checkpointer_after_a_verdict_loads_nothing(tmp_path):
    """save_top_k=0, save_last=True: no step file is labelled; after an SDC stop last.ckpt may hold the corruption."""
    folder = tmp_path
    (folder / "last.ckpt").write_bytes(b"state of step 300")
    (folder / LABELS_FILE).write_text(json.dumps({"checkpoints": {}, "stopped_for": "sdc"}))
    assert checkpoints._plan(str(folder), [], [], str(folder / "last.ckpt"))["load"] is None
    assert not (folder / "last.ckpt").exists()


def test_a_named_file_labelled_rejected_is_refused_unless_the_config_allows_it(tmp_path):
    """By the file's name in its folder: the labels hold the paths of the run that saved them."""
    folder = job(tmp_path, {20: "verified", 40: "rejected"}, stopped_for="sdc")
    checkpoints.refuse_rejected_load(os.path.join(folder, "epoch=0-step=20.ckpt"), allowed=False)
    with pytest.raises(RejectedCheckpointError, match="step=40.ckpt is labelled rejected"):
        checkpoints.refuse_rejected_load(os.path.join(folder, "epoch=0-step=40.ckpt"), allowed=False)
    checkpoints.refuse_rejected_load(os.path.join(folder, "epoch=0-step=40.ckpt"), allowed=True)
    os.symlink(os.path.join(folder, "epoch=0-step=40.ckpt"), os.path.join(folder, "linked.ckpt"))  # save_last="link"
    with pytest.raises(RejectedCheckpointError):
        checkpoints.refuse_rejected_load(os.path.join(folder, "linked.ckpt"), allowed=False)


def test_the_closure_runs_before_the_step_and_the_result_is_the_same():
    import torch

    def run(wrapped):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        seen = []
        opt.register_step_pre_hook(lambda o, *_: seen.append(model.weight.grad is not None))
        restore = _closure_first(opt) if wrapped else (lambda: None)

        def closure():
            opt.zero_grad(set_to_none=True)
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        restore()
        assert "step" not in vars(opt)
        if wrapped:  # an instance step already there (an LR scheduler's wrapper) is put back
            torch.optim.lr_scheduler.StepLR(opt, 1)
            before = opt.step
            _closure_first(opt)()
            assert opt.step is before
        return model.weight.detach().clone(), seen

    plain, seen_plain = run(False)
    first, seen_first = run(True)
    assert torch.equal(plain, first)
    assert seen_plain == [False, True, True] and seen_first == [True, True, True]  # the hook sees this step's grads


def test_the_callback_refuses_scouts_own_snapshots_and_finds_the_model_inside_the_module():
    import torch

    with pytest.raises(ConfigError, match="ModelCheckpoint"):
        ScoutCallback(overrides=["checkpoint.enabled=true"])
    from scout_lightning.tryout import build_module

    module = build_module()
    assert _model_of(module) is module.model
    module.loss = torch.nn.CrossEntropyLoss()  # a parameter-free child beside the model
    assert _model_of(module) is module.model


def test_only_a_path_the_user_did_not_name_makes_the_restart_plan(tmp_path, monkeypatch):
    """ckpt_path="last" (or None, where Lightning picks one itself) plans on every rank; a path the user named is
    loaded as named (refused at train start if labelled rejected) and moves nothing."""
    from types import SimpleNamespace

    planned = []
    monkeypatch.setattr(checkpoints, "checkpoint_folders", lambda trainer: [str(tmp_path)])
    monkeypatch.setattr(checkpoints, "exception_files", lambda trainer: [])
    monkeypatch.setattr(checkpoints.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(checkpoints.durable, "agreed_restart_plan",
                        lambda folder, plan, **kw: planned.append(folder) or {"step": 1})
    trainer = SimpleNamespace(_checkpoint_connector=SimpleNamespace(_user_managed=False))
    named = str(tmp_path / "last.ckpt")
    assert checkpoints.plan_restart(trainer, named, named) is None and planned == []
    setter = SimpleNamespace(_checkpoint_connector=SimpleNamespace(_user_managed=True))  # trainer.ckpt_path = ...
    assert checkpoints.plan_restart(setter, named, None) is None and planned == []
    assert checkpoints.plan_restart(trainer, named, "last") == {"step": 1}
    assert checkpoints.plan_restart(trainer, None, None) == {"step": 1}  # every rank takes part, whatever it resolved
    assert planned == [str(tmp_path)] * 2
