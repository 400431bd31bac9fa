"""The package's layout rules: the core never imports a plugin or a framework, and production modules never import
the test machinery (``scout_core.testing``); only the ``scout cells`` command reaches it, lazily."""

from __future__ import annotations

import ast
from pathlib import Path

import scout_core

PACKAGE = Path(scout_core.__file__).parent
FORBIDDEN_EVERYWHERE = ("scout_torchtitan", "scout_megatron", "scout_deepspeed", "torchtitan", "megatron",
                        "deepspeed")


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _violations(path: Path) -> list[str]:
    rel = path.relative_to(PACKAGE.parent)
    production = "testing" not in rel.parts and rel.name != "cli.py"
    bad = []
    for name, line in _imports(path):
        if name.split(".")[0] in FORBIDDEN_EVERYWHERE:
            bad.append(f"{rel}:{line} imports {name}")
        if production and (name == "scout_core.testing" or name.startswith("scout_core.testing.")):
            bad.append(f"{rel}:{line} imports the test machinery ({name})")
    return bad


def test_production_modules_never_import_the_test_machinery_or_a_plugin():
    bad = [v for path in sorted(PACKAGE.rglob("*.py")) for v in _violations(path)]
    assert bad == []


def test_the_rule_finds_a_violation(tmp_path, monkeypatch):
    """The check above can fail: a production module importing the injector is named."""
    fake = PACKAGE / "replay" / "engine.py"
    source = fake.read_text() + "\nfrom scout_core.testing.inject import Injector\nimport deepspeed\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else _read(self))
    found = _violations(fake)
    assert any("test machinery" in v for v in found) and any("imports deepspeed" in v for v in found)


_read = Path.read_text
