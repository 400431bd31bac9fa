"""Typed configuration: defaults file, overrides and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from scout_core.config import ConfigError, ScoutConfig, load, to_yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ROOT / "configs" / "scout.yaml"


def test_defaults_file_matches_schema():
    assert load(DEFAULTS) == ScoutConfig()
    on_disk = OmegaConf.to_container(OmegaConf.load(DEFAULTS))
    assert on_disk == OmegaConf.to_container(OmegaConf.create(to_yaml(ScoutConfig())))


def test_overrides_apply_in_order(tmp_path):
    user = tmp_path / "job.yaml"
    user.write_text("replay:\n  cadence:\n    hidden: 50\nobserver:\n  store_port: 29600\n")
    cfg = load(user, ["replay.cadence.hidden=7", "consensus.kappa=4.5"])
    assert cfg.replay.cadence.hidden == 7
    assert cfg.replay.cadence.embedding == 20
    assert cfg.observer.store_port == 29600
    assert cfg.consensus.kappa == 4.5


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("observer.silence_thresold_s=3", "observer.silence_thresold_s", "not in"),
        ("consensus.kappa=fast", "consensus.kappa", "Float"),
        ("observer.store_port=70000", "observer.store_port", "<= 65535"),
        ("observer.enabled=maybe", "observer.enabled", "bool"),
        ("replay.cadence.hidden=-1", "replay.cadence.hidden", ">= 0"),
        ("consensus.kappa=0", "consensus.kappa", "> 0"),
        ("consensus.min_ratio=0.9", "consensus.min_ratio", ">= 1.0"),
        ("consensus.mad_floor_fraction=2", "consensus.mad_floor_fraction", "<= 1"),
        ("checkpoint.keep_generations=1", "checkpoint.keep_generations", ">= 2"),
        ("topology.order=[d,s,t,p,c]", "topology.order", "permutation"),
        ("report.log_level=LOUD", "report.log_level", "WARNING"),
        ("replay.input_variants=[1.0,-2.0]", "replay.input_variants", "positive"),
        ("observer.silence_threshold_s=nan", "observer.silence_threshold_s", "finite"),
    ],
)
def test_bad_values_name_key_and_allowed(override, key, allowed):
    with pytest.raises(ConfigError) as err:
        load(DEFAULTS, [override])
    assert key in str(err.value) and allowed in str(err.value)


def test_unknown_top_level_section(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("replays:\n  enabled: true\n")
    with pytest.raises(ConfigError, match="replays"):
        load(bad)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("replay: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(broken)
    with pytest.raises(ConfigError, match="key.path=value"):
        load(None, ["replay.enabled"])


def test_configuration_reference_is_current():
    from scout_core.config import markdown_reference

    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == markdown_reference(), "regenerate: python -c 'from scout_core.config import " \
        "markdown_reference as m; open(\"docs/configuration.md\", \"w\").write(m())'"


@pytest.mark.parametrize("override", ["replay.enabled=false", "replay.cadence.embedding=0"])
def test_snapshots_without_replay_checks_are_refused(override):
    off = [override] if override.startswith("replay.enabled") else [
        f"replay.cadence.{r}=0" for r in ("embedding", "hidden", "output", "optimizer", "expert")]
    with pytest.raises(ConfigError, match="checkpoint.enabled: certified snapshots are taken at replay checks"):
        load(None, ["checkpoint.enabled=true", *off])
    load(None, ["checkpoint.enabled=false", *off])  # fine without snapshots


def test_resolve_takes_a_config_a_yaml_path_or_nothing_with_overrides_on_top(tmp_path):
    """What a plugin's callback is handed (``ScoutCallback(config, overrides=...)``)."""
    from scout_core.config import ConfigError, ScoutConfig, resolve

    assert resolve(None) == ScoutConfig()
    path = tmp_path / "scout.yaml"
    path.write_text("replay:\n  cadence:\n    hidden: 7\n")
    assert resolve(str(path), ["replay.cadence.output=3"]).replay.cadence.output == 3
    cfg = resolve(resolve(path), ["replay.cadence.embedding=2"])
    assert (cfg.replay.cadence.hidden, cfg.replay.cadence.embedding) == (7, 2)
    with pytest.raises(ConfigError):
        resolve(ScoutConfig(), ["replay.cadence.hidden=-1"])
    with pytest.raises(TypeError, match="YAML file's path"):
        resolve({"replay": {}})
