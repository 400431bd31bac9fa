"""``scout_deepspeed.initialize``: the section validated before DeepSpeed builds anything, nothing installed without
it, and SCOUT closed with the engine or at exit (a failure is not a normal end)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import deepspeed
import pytest

from scout_core.config import ConfigError, ScoutConfig
from scout_deepspeed import entry


class _Engine:
    def __init__(self, config: dict, optimizer: object | None = "adam") -> None:
        self.config = config
        self.optimizer = optimizer
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


@pytest.mark.parametrize(("ds", "keeper"), [({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
                                            ({"bf16": {"enabled": True}}, "bf16")])
def test_snapshots_where_deepspeed_keeps_master_weights_are_refused_before_it_builds_anything(built, ds, keeper):
    config = {**ds, "optimizer": {"type": "AdamW"}, "scout": {"enabled": True, "checkpoint": {"enabled": True}}}
    with pytest.raises(ConfigError, match=r'"scout\.checkpoint\.enabled".*' + keeper):
        entry.initialize(model=None, config=config)
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
    from scout_core.handle import exit_closer

    exit_closer(lambda: handle)()
    exit_closer(lambda: None)()  # closed and collected already: nothing to do
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


@pytest.mark.parametrize(("layout", "named"), [({"mp_world_size": 2}, "tensor parallelism"),
                                               ({"sequence_parallel_size": 4}, "sequence parallelism (Ulysses")])
def test_layouts_whose_replay_would_span_other_peer_groups_are_refused(layout, named):
    """Tensor (an mpu, AutoTP) and sequence parallelism: a replayed block's collectives would span ranks in other
    peer groups, which the adapter does not pair; refused at attach rather than risk a hang."""
    import torch

    from scout_deepspeed.adapter import attach

    model = torch.nn.Linear(2, 2)
    engine = SimpleNamespace(module=model, optimizer=torch.optim.AdamW(model.parameters()),
                             zero_optimization_stage=lambda: 0, config={}, **layout)
    with pytest.raises(ConfigError, match=re.escape(f'"scout.enabled": SCOUT does not diagnose {named}')):
        attach(engine, config=ScoutConfig())


def test_a_pipeline_engine_is_refused():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from scout_deepspeed.adapter import _unsupported_layout

    assert "pipeline parallelism" in _unsupported_layout(PipelineEngine.__new__(PipelineEngine))


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


@pytest.mark.parametrize("section", [None, {"enabled": False}, {"enabled": False, "replay": {"enabled": True}}])
def test_attach_installs_nothing_where_the_engines_section_is_absent_or_disabled(monkeypatch, section):
    """The one call on the engine honours the toggle as initialize does: no section, or "enabled": false, nothing
    installed (it used to fall back to SCOUT's defaults)."""
    from scout_deepspeed import adapter

    monkeypatch.setattr(adapter, "attach", lambda *a, **k: pytest.fail("SCOUT was installed"))
    engine = _Engine({} if section is None else {"scout": section})
    assert entry.attach(engine) is None and entry.handle_of(engine) is None


@pytest.mark.parametrize("why", ["no_optimizer", "second_engine"])
def test_attach_skips_an_engine_it_cannot_diagnose_with_a_warning(monkeypatch, caplog, why):
    """An RLHF job's reference model (no optimizer) or a second training engine in the process: a warning and
    nothing attached, never an exception that stops the job."""
    from scout_core.runtime import ScoutHandle
    from scout_deepspeed import adapter

    monkeypatch.setattr(adapter, "attach", lambda *a, **k: pytest.fail("SCOUT was installed"))
    monkeypatch.setattr(ScoutHandle, "is_open", classmethod(lambda cls: why == "second_engine"))
    engine = _Engine({"scout": {"enabled": True}}, optimizer=None if why == "no_optimizer" else "adam")
    with caplog.at_level("WARNING", logger="scout_deepspeed"):
        assert entry.attach(engine) is None
    assert ("no optimizer" if why == "no_optimizer" else "another engine") in caplog.text


def test_optimizers_replay_cannot_reproduce_turn_the_optimizer_check_off():
    """Offload's DeepSpeedCPUAdam (its step count in C++), LAMB, the 1-bit optimizers: replay of a fresh instance on
    a slice would fail the self-check everywhere (and start a subprocess in every constructor)."""
    import torch

    from scout_deepspeed.adapter import _unreplayable

    params = [torch.nn.Parameter(torch.zeros(2))]
    cpu_adam = type("DeepSpeedCPUAdam", (torch.optim.Adam,), {"__module__": "deepspeed.ops.adam.cpu_adam"})
    assert "DeepSpeedCPUAdam" in _unreplayable(cpu_adam(params))
    from deepspeed.ops.adam.fused_adam import FusedAdam

    fused = FusedAdam.__new__(FusedAdam)  # its constructor builds the CUDA op; only the class matters here
    assert _unreplayable(fused) is None
    assert _unreplayable(torch.optim.AdamW(params)) is None and _unreplayable(torch.optim.SGD(params, lr=1)) is None
    # torch's own whose update spans the whole tensor (a fresh instance on a slice fails its self-check, or raises)
    assert "Adafactor" in _unreplayable(torch.optim.Adafactor(params))
    if hasattr(torch.optim, "Muon"):
        assert "Muon" in _unreplayable(torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]))
    mine = type("MyAdamW", (torch.optim.AdamW,), {"__module__": "my_trainer"})  # may change the update
    assert "MyAdamW" in _unreplayable(mine(params))
