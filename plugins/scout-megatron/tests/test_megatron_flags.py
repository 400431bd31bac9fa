"""The flags: SCOUT through Megatron's own argument parser, with the plugin's extra_args_provider."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from scout_core.config import ConfigError, ScoutConfig, schema_keys
from scout_core.testing.plugins import check_plugin_contract, check_readme_block
from scout_megatron.entry import scout_args_provider
from scout_megatron.flags import add_scout_args, config_from_args, flag_of


def megatron_parse(*flags: str, provider=None) -> argparse.Namespace:
    """Megatron's own parser (every Megatron flag), with the plugin's provider, as a launch parses it."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        return parse_args(scout_args_provider(provider))
    finally:
        sys.argv = saved


def test_scout_flags_reach_scouts_configuration_beside_megatrons_own():
    args = megatron_parse("--scout", "--scout-replay-cadence-hidden", "7", "--scout-topology-shape", "d=2", "t=2",
                          "--scout-observer-enabled", "false", "--tensor-model-parallel-size", "2")
    cfg = config_from_args(args)
    assert isinstance(cfg, ScoutConfig) and cfg.replay.cadence.hidden == 7 and cfg.topology.shape == {"d": 2, "t": 2}
    assert cfg.observer.enabled is False and cfg.replay.cadence.output == ScoutConfig().replay.cadence.output
    assert args.tensor_model_parallel_size == 2


def test_without_the_switch_nothing_is_installed():
    assert config_from_args(megatron_parse()) is None
    assert config_from_args(megatron_parse("--scout-replay-cadence-hidden", "3")) is None


def test_every_schema_key_is_a_flag():
    parser = add_scout_args(argparse.ArgumentParser())
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {flag_of(k.key) for k in schema_keys()} | {"--scout", "--scout-config"} <= flags
    assert flag_of("observer.silence_threshold_s") == "--scout-observer-silence-threshold-s"


@pytest.mark.parametrize(("flags", "message"), [
    (("--scout-replay-cadence-hidden", "-1"),
     "argument --scout-replay-cadence-hidden: -1 is out of range; allowed: >= 0"),
    (("--scout-replay-cadence-hidden", "often"), "argument --scout-replay-cadence-hidden: invalid int value"),
    (("--scout-observer-enabled", "maybe"), "argument --scout-observer-enabled: 'maybe' is not a boolean"),
    (("--scout-actions-on-verdict", "panic"), "argument --scout-actions-on-verdict: 'panic'; allowed: log, stop"),
    (("--scout-topology-shape", "d"), "argument --scout-topology-shape: 'd' is not AXIS=SIZE"),
])
def test_a_bad_value_fails_at_megatrons_argument_parsing_naming_the_flag(capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        megatron_parse("--scout", *flags)
    err = " ".join(capsys.readouterr().err.split())
    assert stop.value.code == 2 and message in err, err


def test_the_config_file_is_read_and_the_flags_override_it(tmp_path, capsys):
    path = tmp_path / "scout.yaml"
    path.write_text("replay:\n  cadence:\n    hidden: 11\n    output: 3\n")
    cfg = config_from_args(megatron_parse("--scout", "--scout-config", str(path), "--scout-replay-cadence-hidden", "5"))
    assert cfg.replay.cadence.hidden == 5 and cfg.replay.cadence.output == 3
    path.write_text("replay:\n  cadense: {hidden: 1}\n")
    with pytest.raises(SystemExit):
        megatron_parse("--scout", "--scout-config", str(path))
    assert f"--scout-config {path}: replay.cadense" in " ".join(capsys.readouterr().err.split())


def test_the_scripts_own_provider_runs_first_and_is_kept():
    def own(parser):
        parser.add_argument("--my-flag", type=int, default=1)
        return parser

    args = megatron_parse("--scout", "--my-flag", "4", provider=own)
    assert args.my_flag == 4 and config_from_args(args) is not None


def test_config_from_args_names_the_flag_outside_argparse_too():
    args = add_scout_args(argparse.ArgumentParser()).parse_args(["--scout"])
    args.scout_replay_cadence_hidden = -2  # set after parsing, as a script might
    with pytest.raises(ConfigError, match=r"argument --scout-replay-cadence-hidden: -2 is out of range"):
        config_from_args(args)


def test_the_plugin_registers_and_refuses_an_unsupported_megatron_core():
    check_plugin_contract("scout_megatron", "megatron", framework="megatron-core", supported=">=0.19,<0.20",
                          outside="0.18.3")


def test_the_readme_lists_every_flag():  # generated from scout_core's schema by scout_megatron.flags
    check_readme_block(Path(__file__).resolve().parents[1] / "README.md", "scout_megatron.flags")


def test_a_misspelled_scout_flag_fails_even_where_megatron_ignores_unknown_flags(capsys):
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", "--scout", "--scout-replay-cadense-hidden", "3", "--someone-elses-flag"]
    try:
        with pytest.raises(SystemExit) as stop:
            parse_args(scout_args_provider(), ignore_unknown_args=True)
    finally:
        sys.argv = saved
    err = " ".join(capsys.readouterr().err.split())
    assert stop.value.code == 2 and "unrecognized SCOUT flag(s): --scout-replay-cadense-hidden" in err


def test_a_mapping_flag_replaces_the_files_mapping(tmp_path):
    path = tmp_path / "scout.yaml"
    path.write_text("topology:\n  shape: {d: 4, t: 2}\n")
    cfg = config_from_args(megatron_parse("--scout", "--scout-config", str(path), "--scout-topology-shape", "d=8"))
    assert cfg.topology.shape == {"d": 8}
    cfg = config_from_args(megatron_parse("--scout", "--scout-config", str(path)))
    assert cfg.topology.shape == {"d": 4, "t": 2}


def test_transformer_engine_is_probed_behind_a_guard(monkeypatch):
    """Transformer Engine imports only where CUDA is (without it, its import raises RuntimeError, not
    ImportError): the plugin's probe says "not here" for either, and gives the version where it imports."""
    import sys
    import types

    import scout_megatron

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed: ImportError
    assert scout_megatron.transformer_engine_version() is None
    monkeypatch.delitem(sys.modules, "transformer_engine")
    import builtins

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):
        if name == "transformer_engine":
            raise RuntimeError("CUDA is required")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", importing)
    assert scout_megatron.transformer_engine_version() is None
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.8.0"))
    assert scout_megatron.transformer_engine_version() == "2.8.0"


def test_data_fetches_are_marked_and_the_loader_keeps_its_own_attributes():
    """Megatron's data iterator inside its RerunDataIterator: each fetch is the data phase on SCOUT's hang path,
    and the loader's own attributes (``save_state`` for ``--dataloader-save``) stay reachable; a copy works."""
    import copy

    from megatron.core.rerun_state_machine import RerunDataIterator

    from scout_core.progress.record import Phase
    from scout_megatron.attach import mark_data

    marks = []

    class Tracker:
        def mark(self, phase):
            marks.append(phase)

    class Loader:
        def __init__(self):
            self.items = iter([1, 2])

        def __next__(self):
            return next(self.items)

        def save_state(self):
            return {"consumed": 1}

    class Handle:
        tracker = Tracker()

    data = mark_data(Handle(), [RerunDataIterator(Loader()), None])
    assert data[1] is None  # a rank that reads no data (tensor-parallel rank > 0)
    assert next(data[0]) == 1 and marks == [Phase.DATALOADER, Phase.COMPUTE]
    assert data[0].iterable.save_state() == {"consumed": 1}
    assert next(copy.copy(data[0].iterable)) == 2
    assert mark_data(Handle(), data[0]).iterable is data[0].iterable  # marked once
