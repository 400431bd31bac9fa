"""The "scout" section of a DeepSpeed config: validated by scout_core's schema, errors naming the JSON path."""

import json
from pathlib import Path

import pytest

import scout_deepspeed
from scout_core.config import ConfigError
from scout_core.testing.plugins import check_plugin_contract, check_readme_block
from scout_deepspeed.section import config_from_section, user_config

README = Path(__file__).resolve().parents[1] / "README.md"


def test_absent_or_disabled_installs_nothing():
    assert config_from_section(None) is None
    assert config_from_section({}) is None
    assert config_from_section({"enabled": False, "replay": {"cadence": {"hidden": 5}}}) is None


def test_enabled_section_becomes_scouts_config():
    cfg = config_from_section({"enabled": True, "replay": {"cadence": {"hidden": 5}},
                               "topology": {"shape": {"d": 4}}, "report": {"jsonl_path": None}})
    assert cfg.replay.cadence.hidden == 5 and cfg.topology.shape == {"d": 4} and cfg.report.jsonl_path is None


@pytest.mark.parametrize("section, path", [
    ({"enabled": True, "replay": {"cadense": {"hidden": 5}}}, '"scout.replay.cadense'),
    ({"enabled": True, "replay": {"cadence": {"hidden": -1}}}, '"scout.replay.cadence.hidden"'),
    ({"enabled": True, "replay": {"cadence": {"hidden": "often"}}}, '"scout.replay.cadence.hidden"'),
    ({"enabled": True, "actions": {"on_verdict": "panic"}}, '"scout.actions.on_verdict"'),
    ({"enabled": "yes"}, '"scout.enabled"'),
    ({"enabled": False, "observer": {"silence_threshold_s": 0}}, '"scout.observer.silence_threshold_s"'),
    ([1, 2], '"scout"'),
    ({"enabled": True, "replay": {"cadence": 5}}, '"scout.replay.cadence": must be an object'),
    ({"enabled": True, "replay": [1]}, '"scout.replay": must be an object'),
])
def test_a_bad_key_or_value_names_its_json_path(section, path):
    with pytest.raises(ConfigError) as err:
        config_from_section(section)
    assert path in str(err.value)


def test_the_config_deepspeed_uses_is_the_one_read(tmp_path):
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"scout": {"enabled": True}}))

    class Args:
        deepspeed_config = str(file)

    assert user_config(args=Args()) == {"scout": {"enabled": True}}
    assert user_config({"a": 1}, {"b": 2}, Args()) == {"a": 1}  # DeepSpeed's own order: config first
    assert user_config(None, {"b": 2}) == {"b": 2}
    assert user_config() is None
    with pytest.raises(ConfigError, match="cannot be read"):
        user_config(str(tmp_path / "missing.json"))


def test_configs_deepspeed_reads_are_read_alike(tmp_path):
    """HJSON (comments, trailing commas), base64 and the old --deepscale_config, as DeepSpeed accepts them."""
    import base64

    hjson_file = tmp_path / "ds.hjson"
    hjson_file.write_text('{\n  // SCOUT on\n  "scout": {"enabled": true,},\n}\n')
    assert user_config(str(hjson_file)) == {"scout": {"enabled": True}}
    encoded = base64.urlsafe_b64encode(json.dumps({"scout": {"enabled": True}}).encode()).decode()
    assert user_config(encoded) == {"scout": {"enabled": True}}

    class OldArgs:
        deepscale_config = str(hjson_file)

    assert user_config(args=OldArgs()) == {"scout": {"enabled": True}}


def test_readme_reference_is_current():
    check_readme_block(README, "scout_deepspeed.section", begin="REFERENCE_BEGIN", end="REFERENCE_END",
                       generate="reference")


def test_version_gate_names_both_versions():
    assert scout_deepspeed.check_version("0.19.8") == "0.19.8"
    with pytest.raises(scout_deepspeed.UnsupportedVersion, match=r">=0\.19,<0\.20; deepspeed 0\.18\.1 is installed"):
        scout_deepspeed.check_version("0.18.1")


def test_registered_as_a_scout_plugin():
    check_plugin_contract("scout_deepspeed", "deepspeed", framework="deepspeed", supported=">=0.19,<0.20",
                          outside="0.18.1")
