"""The package's layout rules: the core never imports a plugin or a framework, and production modules (the core's
and the plugins') never reach the test machinery (``scout_core.testing``); only the ``scout`` command does, inside
its functions: its parser takes the ``scout cells`` commands from ``scout_core.testing.cells_cli`` (argparse only:
the runner, the launcher and torch are imported when a cells command runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import scout_core

PACKAGE = Path(scout_core.__file__).parent
ROOT = PACKAGE.parent
FRAMEWORKS = ("scout_torchtitan", "scout_megatron", "scout_deepspeed", "scout_hf", "scout_lightning", "torchtitan",
              "megatron", "deepspeed", "transformers", "accelerate", "lightning")
TESTING = "scout_core.testing"


def _module_of(path: Path) -> str:
    """The dotted name relative imports resolve against (scout_core's modules; the plugins' resolve among
    themselves, which never reaches scout_core)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(absolute module, line, at module level) of every import, relative ones resolved, plus every string
    constant naming the test machinery (importlib, lazy-import tables)."""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((module, node.lineno, id(node) in top))
            found += [(f"{module}.{alias.name}", node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and TESTING in node.value:
            found.append((node.value, node.lineno, False))
    return found


def _violations(path: Path, source: str | None = None) -> list[str]:
    rel = path.relative_to(ROOT)
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    in_core = rel.parts[0] == "scout_core"
    machinery = in_core and len(rel.parts) > 1 and rel.parts[1] == "testing"
    command = rel.as_posix() == "scout_core/cli.py"
    bad = []
    for name, line, top_level in _imports(path, tree):
        if in_core and name.split(".")[0] in FRAMEWORKS:
            bad.append(f"{rel}:{line} imports {name}")
        testing = name == TESTING or name.startswith(TESTING + ".")
        if testing and not machinery and not (command and not top_level):
            bad.append(f"{rel}:{line} reaches the test machinery ({name})")
    return bad


def _production_files() -> list[Path]:
    plugins = [p for p in (ROOT / "plugins").glob("*/scout_*/**/*.py")]
    return sorted(PACKAGE.rglob("*.py")) + sorted(plugins)


def test_production_modules_never_reach_the_test_machinery_or_a_plugin():
    files = _production_files()
    assert any("plugins" in p.parts for p in files), "the plugins' packages are scanned too"
    assert [v for path in files for v in _violations(path)] == []


def test_the_rule_finds_each_way_in():
    """The check above can fail: absolute, relative and dynamic imports of the machinery, a framework import,
    and a module-level import in the command are all named."""
    engine = PACKAGE / "replay" / "engine.py"
    for extra, expect in (("from scout_core.testing.inject import Injector", "test machinery"),
                          ("from ..testing.inject import Injector", "test machinery"),
                          ("import importlib\nimportlib.import_module('scout_core.testing.launcher')",
                           "test machinery"),
                          ("import deepspeed", "imports deepspeed")):
        found = _violations(engine, engine.read_text() + "\n" + extra + "\n")
        assert any(expect in v for v in found), extra
    cli = PACKAGE / "cli.py"
    assert _violations(cli, cli.read_text() + "\nfrom scout_core.testing.cells import load_cells\n")
    plugin = next(p for p in _production_files() if "plugins" in p.parts)
    assert _violations(plugin, plugin.read_text() + "\nfrom scout_core.testing import launcher\n")


# The size rules of the house: every room (a production module of the core, a plugin or the benchmarks) does one
# job in under 450 lines, says that job in a docstring of at most two lines first, and no function runs past 80.
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
MAX_SUMMARY_LINES = 2


def _rooms() -> list[Path]:
    return _production_files() + sorted((ROOT / "benchmarks").glob("*.py"))


def _size_violations(path: Path, source: str | None = None) -> list[str]:
    text = source if source is not None else path.read_text()
    rel = path.relative_to(ROOT)
    tree = ast.parse(text, filename=str(path))
    bad = []
    lines = len(text.splitlines())
    if lines >= MAX_MODULE_LINES:
        bad.append(f"{rel}: {lines} lines (under {MAX_MODULE_LINES})")
    doc = ast.get_docstring(tree, clean=True)
    if not doc:
        bad.append(f"{rel}: no module docstring saying its job")
    elif len(doc.split("\n\n")[0].splitlines()) > MAX_SUMMARY_LINES:
        bad.append(f"{rel}: the docstring's first paragraph is over {MAX_SUMMARY_LINES} lines")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                bad.append(f"{rel}:{node.lineno} {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
    return bad


def test_every_room_is_small_and_says_its_job():
    rooms = _rooms()
    assert any(p.parent.name == "benchmarks" for p in rooms) and any("plugins" in p.parts for p in rooms)
    assert [v for path in rooms for v in _size_violations(path)] == []


def test_the_size_rule_finds_each_breach():
    """The check above can fail: a long module, a long function, a missing or long docstring are each named."""
    room = PACKAGE / "signature.py"
    text = room.read_text()
    long_function = "\ndef _long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert any("_long is" in v for v in _size_violations(room, text + long_function))
    assert any("lines (under" in v for v in _size_violations(room, text + "\n" * MAX_MODULE_LINES))
    assert any("no module docstring" in v for v in _size_violations(room, "x = 1\n"))
    assert any("first paragraph" in v for v in _size_violations(room, '"""one\ntwo\nthree"""\n'))


def test_the_architecture_picture_is_the_codes():
    """docs/architecture.md's picture of the parts is what docs/draw_architecture.py draws from the imports now
    (run it after moving a module), and every module belongs to a part of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draw_architecture", ROOT / "docs" / "draw_architecture.py")
    draw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw)
    assert draw.current(draw.PAGE.read_text()) == draw.block(), "run python docs/draw_architecture.py"
    assert ("step boundary", "replay/") in draw.edges()
