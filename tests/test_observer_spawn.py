"""The spawned observer's inputs: its callback by import path, its spec as JSON, the start method's choice."""

from __future__ import annotations

import functools
import json

import pytest

from scout_core.config import ConfigError, load
from scout_core.progress.control import ControlPlane
from scout_core.progress.spawn import callback_path, named_callback, resolve_callback, spec_from_wire, spec_to_wire
from scout_core.progress.spec import ObserverSpec
from scout_core.report import Incident


def module_level_callback(inc: Incident) -> None:
    pass


class Holder:
    @staticmethod
    def static_callback(inc: Incident) -> None:
        pass

    def method(self, inc: Incident) -> None:
        pass


def test_only_callbacks_that_import_back_to_themselves_have_a_path() -> None:
    assert callback_path(None) is None
    assert callback_path(module_level_callback) == f"{__name__}:module_level_callback"
    assert callback_path(Holder.static_callback) == f"{__name__}:Holder.static_callback"
    assert callback_path(lambda inc: None) is None
    assert callback_path(Holder().method) is None  # bound: the instance cannot cross
    assert callback_path(functools.partial(module_level_callback)) is None

    def nested(inc: Incident) -> None:
        pass

    assert callback_path(nested) is None
    nested.__module__ = "__main__"
    assert callback_path(nested) is None  # the training script is not importable in the observer


def test_a_callback_path_resolves_or_says_why() -> None:
    assert resolve_callback(f"{__name__}:module_level_callback") is module_level_callback
    assert callback_path(f"{__name__}:Holder.static_callback") == f"{__name__}:Holder.static_callback"
    with pytest.raises(ValueError, match="module:function"):
        resolve_callback("no_colon_here")
    with pytest.raises(ModuleNotFoundError):
        resolve_callback("scout_no_such_module:f")
    with pytest.raises(AttributeError):
        resolve_callback(f"{__name__}:missing")
    with pytest.raises(ValueError, match="not a callable"):
        resolve_callback(f"{__name__}:__name__")
    with pytest.raises(ValueError, match="training script"):
        resolve_callback("__main__:notify")


def test_an_installed_package_is_importable_from_any_working_directory(tmp_path, monkeypatch) -> None:
    """Found by an import hook (an editable install's) or on sys.path: where the trainer runs does not matter."""
    from scout_core.report import read_incidents

    monkeypatch.chdir(tmp_path)
    assert callback_path(read_incidents) == "scout_core.report:read_incidents"


def test_the_spec_crosses_as_json_and_comes_back_equal() -> None:
    spec = ObserverSpec(run_id="r", launch="l", rank=3, world_size=4, record_path="/dev/shm/x",
                        control=ControlPlane(host="127.0.0.1", port=1234, kind="daemon", secret="s3cret"),
                        peer_groups=[[0, 1], [2, 3]], hosts={0: "a", 3: "b"}, devices={0: "cpu", 3: "cpu"},
                        silence_threshold_s=5.0, gather_timeout_s=10.0, startup_timeout_s=30.0, jsonl_path=None,
                        on_incident=module_level_callback, exclusions_path="/tmp/x.json", start_method="spawn")
    wire = json.loads(json.dumps(spec_to_wire(spec, callback="m:f")))
    assert wire["callback"] == "m:f" and "on_incident" not in wire["spec"]
    back = spec_from_wire(wire)
    assert back.on_incident is None
    back.on_incident = spec.on_incident
    assert back == spec


def test_start_method_is_spawn_by_default_and_checked() -> None:
    assert load(None, []).observer.start_method == "spawn"
    assert load(None, ["observer.start_method=fork"]).observer.start_method == "fork"
    with pytest.raises(ConfigError, match="start_method"):
        load(None, ["observer.start_method=thread"])


def test_a_path_the_user_gave_is_the_path_the_observer_imports() -> None:
    """A partial or a callable instance has no ``__qualname__`` that finds it again; named by the user, it
    crosses by that name."""
    import sys
    import types

    module = types.ModuleType("scout_test_named_callbacks")
    module.notify = functools.partial(module_level_callback)  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        assert callback_path(resolve_callback("scout_test_named_callbacks:notify")) is None  # not named by a user
        fn = named_callback("scout_test_named_callbacks:notify")
        assert callback_path(fn) == "scout_test_named_callbacks:notify"
    finally:
        del sys.modules[module.__name__]


def test_a_module_loaded_from_a_file_path_is_not_importable_in_the_observer(tmp_path) -> None:
    import importlib.util
    import sys

    source = tmp_path / "hidden" / "scout_test_dynmod.py"
    source.parent.mkdir()
    source.write_text("def cb(inc):\n    pass\n")
    spec = importlib.util.spec_from_file_location("scout_test_dynmod", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scout_test_dynmod"] = module
    try:
        spec.loader.exec_module(module)
        assert callback_path(module.cb) is None  # forked instead: the observer could not import it
        assert callback_path(module.cb) is None  # and again: resolving it once does not vouch for it
    finally:
        del sys.modules["scout_test_dynmod"]


def test_the_wire_of_a_large_job_crosses_whole(tmp_path) -> None:
    """The spec of a 100k-rank job is MBs: written to an in-memory file before the child starts, never a pipe
    the trainer could block on."""
    import os

    from scout_core.progress.spawn import _wire_file

    groups = [list(range(i, i + 1000)) for i in range(0, 100_000, 1000)]
    wire = {"spec": {"peer_groups": groups}, "callback": None, "sys_path": []}
    fd = _wire_file(wire)
    with os.fdopen(fd, "rb") as fh:
        assert json.loads(fh.read()) == wire


def test_without_memfd_the_wire_goes_through_a_private_unlinked_file(monkeypatch) -> None:
    """Pythons built against glibc < 2.27 have no memfd_create."""
    import os

    from scout_core.progress.spawn import _wire_file

    monkeypatch.delattr(os, "memfd_create")
    wire = {"spec": {"x": 1}, "callback": None, "sys_path": []}
    fd = _wire_file(wire)
    assert os.fstat(fd).st_nlink == 0 and os.fstat(fd).st_mode & 0o777 == 0o600
    with os.fdopen(fd, "rb") as fh:
        assert json.loads(fh.read()) == wire
