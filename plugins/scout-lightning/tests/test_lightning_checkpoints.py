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


def job(folder, labels, stopped_for=None):
    os.makedirs(folder, exist_ok=True)
    for step in labels:
        (folder / f"epoch=0-step={step}.ckpt").write_bytes(f"state of step {step}".encode())
    (folder / "last.ckpt").write_bytes(f"state of step {max(labels)}".encode())
    entries = {str(s): {"label": lab, "path": str(folder / f"epoch=0-step={s}.ckpt"), "saved_unix": 0.0}
               for s, lab in labels.items()}
    (folder / LABELS_FILE).write_text(json.dumps({"checkpoints": entries, "stopped_for": stopped_for}))
    return str(folder)


def test_after_an_sdc_stop_last_holds_the_newest_verified_checkpoint(tmp_path):
    folder = job(tmp_path, {20: "verified", 40: "verified", 60: "rejected"}, stopped_for="sdc")
    plan = checkpoints._plan(folder)
    assert plan["step"] == 40
    assert (tmp_path / "last.ckpt").read_bytes() == b"state of step 40"
    assert (tmp_path / "epoch=0-step=40.ckpt").read_bytes() == b"state of step 40"  # a copy: Lightning rewrites last
    assert not os.path.samefile(tmp_path / "last.ckpt", tmp_path / "epoch=0-step=40.ckpt")
    assert sorted(n.split(".ckpt")[0] for n in os.listdir(tmp_path / SET_ASIDE)) == ["epoch=0-step=60", "last"]
    labels = FrameworkCheckpoints(folder, writer=False)
    assert sorted(labels.entries) == [20, 40] and labels.stopped_for is None


def test_when_the_newest_is_the_one_to_load_nothing_moves(tmp_path):
    """A relaunch after a normal end goes on from the newest checkpoint not rejected: last.ckpt already holds it."""
    folder = job(tmp_path, {20: "verified", 40: "latest"})
    FrameworkCheckpoints(folder, writer=True).ended()
    assert checkpoints._plan(folder) is None and (tmp_path / "last.ckpt").read_bytes() == b"state of step 40"


def test_nothing_safe_sets_last_aside(tmp_path):
    folder = job(tmp_path, {20: "latest", 40: "rejected"}, stopped_for="sdc")
    assert checkpoints._plan(folder)["load"] is None and not (tmp_path / "last.ckpt").exists()


def test_a_named_file_labelled_rejected_is_refused_unless_the_config_allows_it(tmp_path):
    folder = job(tmp_path, {20: "verified", 40: "rejected"}, stopped_for="sdc")
    checkpoints.refuse_rejected_load(os.path.join(folder, "epoch=0-step=20.ckpt"), allowed=False)
    with pytest.raises(RejectedCheckpointError, match="step=40.ckpt is labelled rejected"):
        checkpoints.refuse_rejected_load(os.path.join(folder, "epoch=0-step=40.ckpt"), allowed=False)
    checkpoints.refuse_rejected_load(os.path.join(folder, "epoch=0-step=40.ckpt"), allowed=True)


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
        return model.weight.detach().clone(), seen

    plain, seen_plain = run(False)
    first, seen_first = run(True)
    assert torch.equal(plain, first)
    assert seen_plain == [False, True, True] and seen_first == [True, True, True]  # the hook sees this step's grads


def test_the_callback_refuses_scouts_own_snapshots_and_finds_the_model_inside_the_module():
    with pytest.raises(ConfigError, match="ModelCheckpoint"):
        ScoutCallback(overrides=["checkpoint.enabled=true"])
    from scout_lightning.tryout import build_module

    module = build_module()
    assert _model_of(module) is module.model
