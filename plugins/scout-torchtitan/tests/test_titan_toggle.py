"""The toggle: SCOUT through TorchTitan's own argument parsing, with configuration alone."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import config_registry as llama3

from scout_core.config import ConfigError, ScoutConfig
from scout_core.testing.plugins import check_plugin_contract, check_readme_block
from scout_torchtitan.config import ScoutSection, to_core
from scout_torchtitan.config_registry import with_scout
from scout_torchtitan.trainer import ScoutTrainer


def parse(*flags: str):
    return ConfigManager().parse_args(["--module", "scout_torchtitan", "--config", "llama3_debugmodel", *flags])


def test_scout_flags_reach_the_section_and_everything_else_is_torchtitans():
    cfg = parse("--scout.enable", "--scout.replay.cadence.hidden", "20", "--training.steps", "3")
    assert isinstance(cfg, ScoutTrainer.Config)
    assert cfg.scout.enable and cfg.scout.replay.cadence.hidden == 20 and cfg.training.steps == 3
    base = llama3.llama3_debugmodel()
    assert cfg.model_spec.name == base.model_spec.name and cfg.optimizer == base.optimizer
    assert cfg.training.local_batch_size == base.training.local_batch_size
    core = to_core(cfg.scout)
    assert type(core) is ScoutConfig and core.replay.cadence.hidden == 20


def test_without_the_switch_scout_is_off_with_its_defaults():
    cfg = parse()
    assert cfg.scout.enable is False
    assert to_core(cfg.scout) == ScoutConfig()


def test_every_schema_key_is_a_flag():
    """The section is scout_core's schema itself, not a copy: a key added there is a flag here."""
    assert {f.name for f in dataclasses.fields(ScoutSection)} == {f.name for f in dataclasses.fields(ScoutConfig)} | {
        "enable"}


def test_a_bad_value_fails_at_parsing_naming_the_flag(capsys):
    """scout_core's validation runs as TorchTitan's parser builds the section; the parser prints it, exit 2."""
    with pytest.raises(SystemExit) as stop:
        parse("--scout.enable", "--scout.replay.cadence.hidden", "-1")
    err = " ".join(capsys.readouterr().err.split())
    assert stop.value.code == 2 and "--scout.replay.cadence.hidden: -1 is out of range; allowed: >= 0" in err
    with pytest.raises(ConfigError, match=r"--scout\.consensus\.kappa: 0\.0 is out of range"):
        ScoutSection(consensus=dataclasses.replace(ScoutConfig().consensus, kappa=0.0))


def test_an_unknown_key_fails_at_parsing(capsys):
    with pytest.raises(SystemExit):
        parse("--scout.replay.cadence.hiddn", "3")
    assert "hiddn" in capsys.readouterr().err


def test_a_users_own_registry_function_in_one_line():
    def my_config():
        cfg = llama3.llama3_debugmodel()
        cfg.training.steps = 7
        return cfg

    cfg = with_scout(my_config)()
    assert isinstance(cfg, ScoutTrainer.Config) and cfg.training.steps == 7 and cfg.scout.enable is False
    assert with_scout(my_config).__name__ == "my_config"


def test_an_unknown_config_name_lists_what_there_is():
    with pytest.raises(ValueError, match="llama3_debugmodel"):
        ConfigManager().parse_args(["--module", "scout_torchtitan", "--config", "no_such_config"])


def test_the_plugin_registers_and_refuses_an_unsupported_torchtitan():
    check_plugin_contract("scout_torchtitan", "torchtitan", framework="torchtitan", supported=">=0.3,<0.4",
                          outside="0.4.1")


def test_the_readme_lists_every_flag():  # generated from scout_core's schema by scout_torchtitan.config
    check_readme_block(Path(__file__).resolve().parents[1] / "README.md", "scout_torchtitan.config")


def test_the_override_carries_scout_into_an_unchanged_config():
    from torchtitan.config import apply_overrides

    from scout_torchtitan.checkpointer import ScoutCheckpointManager

    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports",
                                      'scout_torchtitan.override.scout={"replay.cadence.hidden": 7}',
                                      "--checkpoint.interval", "3"])
    assert type(cfg) is not ScoutTrainer.Config  # TorchTitan's own config, untouched by the plugin
    apply_overrides(cfg.override, cfg)  # as Trainer.__init__ does, before it builds anything
    assert isinstance(cfg.checkpoint, ScoutCheckpointManager.Config) and cfg.checkpoint.interval == 3
    assert cfg.checkpoint.scout.enable and cfg.checkpoint.scout.replay.cadence.hidden == 7


def test_a_bad_override_key_fails_naming_it():
    from torchtitan.config import apply_overrides

    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", "--override.imports",
                                      'scout_torchtitan.override.scout={"replay.cadence.hiddn": 7}'])
    with pytest.raises(ConfigError, match=r"scout_torchtitan\.override\.scout: .*hiddn"):
        apply_overrides(cfg.override, cfg)


def test_a_checkpoint_manager_scout_cannot_carry_fails_at_start_up():
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from scout_torchtitan.checkpointer import with_scout_checkpointer

    @dataclasses.dataclass(kw_only=True, slots=True)
    class OtherConfig(BaseCheckpointManager.Config):
        pass

    with pytest.raises(TypeError, match="OtherConfig"):
        with_scout_checkpointer(OtherConfig(), ScoutSection(enable=True))


def test_a_config_named_after_its_model_imports_no_other_model():
    """``--config llama3_8b`` looks in llama3's registry first: the lookup used to import every model before it,
    flux's with transformers, a second of CPU on every rank at startup."""
    code = ("import sys; from scout_torchtitan.cpu import stub_triton_kernels; stub_triton_kernels(); "
            "from torchtitan.config import ConfigManager; "
            "cfg = ConfigManager().parse_args(['--module', 'scout_torchtitan', '--config', 'llama3_debugmodel']); "
            "print(type(cfg).__name__, sorted(m for m in ('torchtitan.models.flux', 'transformers') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split()[-2:] == ["Config", "[]"], run.stdout + run.stderr
