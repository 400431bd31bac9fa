"""Test machinery for the framework plugins: the contract every plugin keeps (its entry point and its version
gate) and the generated tables of its README, each checked in one place.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

from scout_core.cli import PLUGIN_GROUP

__all__ = ["check_plugin_contract", "check_readme_block", "import_with_version", "registered_plugin"]


def import_with_version(module: str, framework: str, version: str) -> ModuleType:
    """Import ``module`` afresh while ``importlib.metadata`` reports ``framework`` at ``version`` (its version gate
    runs again); the module imported before is put back whatever happens, so the session keeps using it."""
    real = metadata.version
    saved = sys.modules.pop(module)
    try:
        with mock.patch.object(metadata, "version", lambda name: version if name == framework else real(name)):
            return importlib.import_module(module)
    finally:
        sys.modules[module] = saved


def registered_plugin(name: str) -> Any:
    """The object plugin ``name`` registers in the ``scout.plugins`` entry-point group, loaded as ``scout plugins``
    loads it (KeyError: no plugin of that name is installed)."""
    found = {ep.name: ep for ep in metadata.entry_points(group=PLUGIN_GROUP)}
    return found[name].load()


def check_plugin_contract(module: str, entry: str, *, framework: str, supported: str, outside: str) -> None:
    """Assert what every plugin promises: ``entry`` in the ``scout.plugins`` group is ``module``'s ``plugin``, naming
    ``framework`` at a version of its tested range ``supported`` (``>=0.19,<0.20``); and ``module`` imported with
    ``framework`` at ``outside`` raises ImportError naming both the range and that version."""
    plugin = registered_plugin(entry)
    assert plugin is importlib.import_module(module).plugin
    lowest = supported.split(",")[0].removeprefix(">=")
    assert plugin.framework == framework and plugin.supported == supported, plugin
    assert plugin.framework_version.startswith(lowest), plugin.framework_version
    try:
        import_with_version(module, framework, outside)
    except ImportError as exc:
        expected = f"supports {framework} {supported}; {framework} {outside} is installed"
        assert expected in str(exc), f"{exc!s} does not say {expected!r}"
    else:
        raise AssertionError(f"{module} imported with {framework} {outside}: its version gate let it through "
                             f"(tested range {supported})")


def check_readme_block(readme: Path, generator: str, *, begin: str = "FLAGS_BEGIN", end: str = "FLAGS_END",
                       generate: str = "flags_reference") -> None:
    """Assert that ``readme``'s generated block, from module ``generator``'s ``begin`` marker through its ``end``
    marker, is what ``generator.generate()`` writes now (a plugin's flag or reference table)."""
    module = importlib.import_module(generator)
    first, last = getattr(module, begin), getattr(module, end)
    text = readme.read_text()
    block = text[text.index(first):text.index(last) + len(last)] + "\n"
    assert block == getattr(module, generate)(), (
        f"{readme}: the generated block is stale; regenerate it with "
        f"python -c \"from {generator} import {generate} as f; print(f(), end='')\"")
