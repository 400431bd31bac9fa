"""The restart plan on a Trainer's output_dir: newer checkpoint-N folders set aside, so that
``resume_from_checkpoint=True`` (the Trainer's ``get_last_checkpoint``) finds the one SCOUT chose."""

from __future__ import annotations

import json
import os

import pytest
from transformers.trainer_utils import get_last_checkpoint

from scout_core.checkpoint.durable import LABELS_FILE, SET_ASIDE, FrameworkCheckpoints
from scout_core.config import ConfigError
from scout_hf import checkpoints
from scout_hf.callback import ScoutCallback


def job(folder, labels, stopped_for=None, extra=()):
    os.makedirs(folder, exist_ok=True)
    for step in [*labels, *extra]:
        os.makedirs(os.path.join(folder, f"checkpoint-{step}"))
    entries = {str(s): {"label": lab, "path": os.path.join(folder, f"checkpoint-{s}"), "saved_unix": 0.0}
               for s, lab in labels.items()}
    with open(os.path.join(folder, LABELS_FILE), "w") as fh:
        json.dump({"checkpoints": entries, "stopped_for": stopped_for}, fh)
    return str(folder)


def test_after_an_sdc_stop_the_trainer_finds_the_newest_verified_folder(tmp_path):
    folder = job(tmp_path, {20: "verified", 40: "verified", 60: "rejected", 80: "rejected"}, stopped_for="sdc")
    assert get_last_checkpoint(folder).endswith("checkpoint-80")  # what the Trainer would load without SCOUT
    plan = checkpoints._plan(folder)
    assert plan["load"] == "checkpoint-40" and plan["step"] == 40
    assert get_last_checkpoint(folder) == os.path.join(folder, "checkpoint-40")
    assert sorted(n.split("-2")[0] for n in os.listdir(os.path.join(folder, SET_ASIDE))) == [
        "checkpoint-60", "checkpoint-80"]
    labels = FrameworkCheckpoints(folder, writer=False)
    assert sorted(labels.entries) == [20, 40] and labels.stopped_for is None


def test_nothing_safe_leaves_the_trainer_no_folder(tmp_path):
    folder = job(tmp_path, {20: "latest", 40: "rejected"}, stopped_for="sdc")
    assert checkpoints._plan(folder)["load"] is None
    assert get_last_checkpoint(folder) is None  # resume_from_checkpoint=True then says it found none


def test_a_newer_folder_without_a_label_is_the_trainers_choice_unless_the_job_stopped_for_sdc(tmp_path):
    folder = job(tmp_path / "a", {20: "verified", 40: "latest"}, extra=[60])
    assert checkpoints._plan(folder) is None and get_last_checkpoint(folder).endswith("checkpoint-60")
    folder = job(tmp_path / "b", {20: "verified", 40: "rejected"}, stopped_for="sdc", extra=[60])
    assert checkpoints._plan(folder)["load"] == "checkpoint-20"
    assert get_last_checkpoint(folder).endswith("checkpoint-20")


def test_a_folder_without_labels_is_left_alone(tmp_path):
    os.makedirs(tmp_path / "checkpoint-5")
    assert checkpoints._plan(str(tmp_path)) is None and os.path.isdir(tmp_path / "checkpoint-5")


def test_a_named_folder_labelled_rejected_is_refused_unless_the_config_allows_it(tmp_path):
    from scout_core.checkpoint.durable import RejectedCheckpointError

    folder = job(tmp_path, {20: "verified", 40: "rejected"}, stopped_for="sdc")
    checkpoints.refuse_rejected_load(os.path.join(folder, "checkpoint-20"), 20, allowed=False)
    with pytest.raises(RejectedCheckpointError, match="checkpoint-40 is labelled rejected"):
        checkpoints.refuse_rejected_load(os.path.join(folder, "checkpoint-40"), 40, allowed=False)
    checkpoints.refuse_rejected_load(os.path.join(folder, "checkpoint-40"), 40, allowed=True)


def test_the_callback_reads_its_config_when_built_and_refuses_scouts_own_snapshots(tmp_path):
    assert ScoutCallback(overrides=["replay.cadence.hidden=5"]).config.replay.cadence.hidden == 5
    with pytest.raises(ConfigError, match="no_such_key|not_a_key"):
        ScoutCallback(overrides=["replay.not_a_key=1"])
    with pytest.raises(ConfigError, match="checkpoint-N folders"):
        ScoutCallback(overrides=["checkpoint.enabled=true"])
    path = tmp_path / "scout.yaml"
    path.write_text("replay:\n  cadence:\n    hidden: 7\n")
    assert ScoutCallback(str(path)).config.replay.cadence.hidden == 7
    assert ScoutCallback(ScoutCallback(str(path)).config, overrides=["replay.cadence.output=3"]).config.replay \
        .cadence.output == 3


def test_attach_refuses_what_replay_cannot_pair_and_is_idle_in_a_single_process():
    from torch import nn

    from scout_hf.prepared import _unsupported

    assert "FSDP1" in _unsupported("FSDP", nn.Linear(2, 2), None)
    from types import SimpleNamespace

    assert "tp_size" in _unsupported("MULTI_GPU", nn.Linear(2, 2), SimpleNamespace(tp_size=2))
    assert "HSDP" in _unsupported("MULTI_GPU", nn.Linear(2, 2), SimpleNamespace(dp_replicate_size=2,
                                                                                 dp_shard_size=2))
    assert _unsupported("MULTI_CPU", nn.Linear(2, 2), None) is None
    assert "XLA" in _unsupported("XLA", nn.Linear(2, 2), None)


def test_only_train_resume_from_checkpoint_true_makes_the_restart_plan(monkeypatch):
    """A fresh start or a folder the user names moves nothing (the named one is loaded as named, unless rejected)."""
    from types import SimpleNamespace

    from scout_hf import callback

    planned, trained = [], []
    monkeypatch.setattr(callback, "plan_restart", lambda folder: planned.append(folder) or {"load": None})
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir="out"),
                              train=lambda resume_from_checkpoint=None, **kw: trained.append(resume_from_checkpoint))
    cb = ScoutCallback()
    callback._plan_before_resume(cb, trainer)
    trainer.train()
    trainer.train(resume_from_checkpoint="out/checkpoint-40")
    trainer.train(None)
    assert planned == [] and cb.restart_plan is None
    trainer.train(resume_from_checkpoint=True)
    trainer.train(True)
    assert planned == ["out", "out"] and trained == [None, "out/checkpoint-40", None, True, True]


@pytest.mark.parametrize("kind", ["GPT2", "Llama", "Mistral", "Qwen2", "Bert"])
def test_the_blocks_embedding_and_head_of_common_model_classes_are_found_by_structure(kind):
    """transformers' own classes from small configs (nothing downloaded): the repeated blocks, the token embedding
    and the output head SCOUT replays (BERT's under .bert and .cls, found through the model's declared
    get_input_embeddings / get_output_embeddings)."""
    import torch
    import transformers

    from scout_core.adapter import torch_adapter

    small = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 64}
    if kind == "GPT2":
        config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    elif kind == "Bert":
        config = transformers.BertConfig(**small)
    else:
        config = getattr(transformers, f"{kind}Config")(**small, num_key_value_heads=2)
    head = "MaskedLM" if kind == "Bert" else "CausalLM"
    model = getattr(transformers, f"{kind}For{head}" if kind != "GPT2" else "GPT2LMHeadModel")(config)
    adapter = torch_adapter(model, torch.optim.AdamW(model.parameters()))
    assert len(adapter.layers) == 2 and adapter.layer_names[0].endswith(".0")
    assert adapter.embedding is model.get_input_embeddings() and adapter.output is model.get_output_embeddings()


def test_a_run_that_starts_elsewhere_after_a_verdict_stop_abandons_the_stopped_run(tmp_path):
    """resume_from_checkpoint="out/checkpoint-40" (or a fresh start) after an SDC stop: the stopped run's newer folders
    leave, and the stop no longer stands, so a later resume_from_checkpoint=True does not roll this run back."""
    folder = job(tmp_path, {20: "verified", 40: "verified", 60: "rejected"}, stopped_for="sdc")
    assert checkpoints._adopt(folder, 40) == {"step": 40, "set_aside": 1}
    labels = FrameworkCheckpoints(folder, writer=False)
    assert sorted(labels.entries) == [20, 40] and labels.stopped_for is None
    assert get_last_checkpoint(folder).endswith("checkpoint-40")
    assert checkpoints._adopt(folder, None) is None  # nothing stands any more
    fresh = job(tmp_path / "fresh", {20: "verified", 40: "rejected"}, stopped_for="sdc")
    assert checkpoints._adopt(fresh, None) == {"step": None, "set_aside": 2} and get_last_checkpoint(fresh) is None
