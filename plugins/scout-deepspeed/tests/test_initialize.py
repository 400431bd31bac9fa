"""``scout_deepspeed.initialize``: the section validated before DeepSpeed builds anything, nothing installed without
it, and SCOUT closed with the engine or at exit (a failure is not a normal end)."""

from __future__ import annotations

from types import SimpleNamespace

import deepspeed
import pytest

from scout_core.config import ConfigError, ScoutConfig
from scout_deepspeed import entry


class _Engine:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.destroyed = 0

    def destroy(self) -> None:
        self.destroyed += 1


@pytest.fixture
def built(monkeypatch):
    """deepspeed.initialize and the attach replaced by recorders: what initialize calls, and with what."""
    calls: dict[str, list] = {"deepspeed": [], "attach": []}

    def fake_initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                        lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
                        collate_fn=None, config=None, mesh_param=None, config_params=None):
        calls["deepspeed"].append(config)
        return _Engine(config if isinstance(config, dict) else {}), None, None, None

    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    monkeypatch.setattr(entry, "attach", lambda engine, config=None: calls["attach"].append(config))
    return calls


def test_a_bad_section_stops_the_launch_before_deepspeed_builds_anything(built):
    with pytest.raises(ConfigError, match=r'"scout\.replay\.cadence\.hidden"'):
        entry.initialize(model=None, config={"scout": {"enabled": True, "replay": {"cadence": {"hidden": -2}}}})
    assert built["deepspeed"] == []


@pytest.mark.parametrize("config", [{}, {"scout": {"enabled": False}}, {"train_batch_size": 8}])
def test_without_an_enabled_section_nothing_is_installed(built, config):
    engine, *_ = entry.initialize(model=None, config=config)
    assert built["deepspeed"] == [config] and built["attach"] == [] and entry.handle_of(engine) is None


def test_the_section_is_read_from_the_config_file_deepspeed_reads(built, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"scout": {"enabled": true, "replay": {"cadence": {"hidden": 7}}}}')
    entry.initialize(args=SimpleNamespace(deepspeed_config=str(path)), model=None)
    (config,) = built["attach"]
    assert isinstance(config, ScoutConfig) and config.replay.cadence.hidden == 7


def test_an_exit_without_engine_destroy_is_not_taken_for_a_normal_end():
    """An exit handler cannot tell sys.exit(0) from sys.exit(1) after a caught error: it closes as a failure."""
    closed: list = []
    handle = SimpleNamespace(close=lambda failed=None: closed.append(failed))
    entry._close_at_exit(lambda: handle)()
    entry._close_at_exit(lambda: None)()  # closed and collected already: nothing to do
    assert closed == [True]


def test_scouts_own_snapshots_are_refused_where_deepspeed_keeps_master_weights():
    import torch

    from scout_deepspeed.adapter import attach

    model = torch.nn.Linear(2, 2)
    wrapper = SimpleNamespace(optimizer=torch.optim.AdamW(model.parameters()))  # ZeRO's wrapper holds the torch one
    engine = SimpleNamespace(module=model, optimizer=wrapper, zero_optimization_stage=lambda: 2, config={})
    config = ScoutConfig()
    config.checkpoint.enabled = True
    with pytest.raises(ConfigError, match=r'"scout\.checkpoint\.enabled".*ZeRO stage 2'):
        attach(engine, config=config)


def test_only_the_scripts_own_destroy_is_a_normal_end(monkeypatch):
    """engine.destroy() closes SCOUT; DeepSpeed's finalizer calls destroy() too, whenever the engine is collected
    (after main() returned an error status): that close is taken for a failure."""
    from scout_deepspeed import adapter, checkpoints

    closed: list = []

    class Handle:
        def close(self, failed=None) -> None:
            closed.append(failed)

    monkeypatch.setattr(adapter, "attach", lambda engine, config=None: Handle())
    monkeypatch.setattr(checkpoints, "install", lambda handle, engine: lambda: None)

    class Engine(_Engine):
        def __del__(self) -> None:  # as DeepSpeedEngine.__del__ does
            self.destroy()

    explicit = Engine({})
    entry.attach(explicit, ScoutConfig())
    explicit.destroy()
    collected = Engine({})
    entry.attach(collected, ScoutConfig())
    collected.__del__()
    assert closed == [None, True]
