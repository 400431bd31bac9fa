"""Draws docs/architecture.md's picture of the parts from the code: which part imports which.

``python docs/draw_architecture.py`` rewrites the mermaid block between the markers of docs/architecture.md;
tests/test_layout.py fails when the checked-in picture is not the one the code draws.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
START, END = "<!-- architecture-graph:start -->", "<!-- architecture-graph:end -->"

# Each part of the picture, and the modules (dotted prefixes under scout_core) it stands for; first match wins.
PARTS: dict[str, tuple[str, ...]] = {
    "enable / assembly": ("runtime", "assembly", "restart_rendezvous"),
    "handle": ("handle", "handle_view", "observer_link"),
    "parts (one rank's SCOUT)": ("parts",),
    "step boundary": ("boundary",),
    "live control": ("live_control", "control"),
    "adapter": ("adapter", "extra_state"),
    "config": ("config", "config_schema"),
    "topology, groups": ("topology", "groups"),
    "C3 consensus": ("consensus", "consensus_rules", "confirmation", "persistence"),
    "signatures": ("signature",),
    "wire, private folders, crash-safe files": ("wire", "private_dir", "durable_files"),
    "hang path (progress/)": ("progress",),
    "replay/": ("replay",),
    "moe/": ("moe",),
    "checkpoint/": ("checkpoint",),
    "records, actions, metrics": ("report", "report_html", "actions", "metrics", "run_log"),
    "scout CLI": ("cli", "tryout"),
    "plugin support": ("plugin_support",),
}


# Parts nearly every other part reads: their arrows are left out of the picture (the page says so).
EVERYWHERE = ("config", "records, actions, metrics")


def part_of(module: str) -> str | None:
    """The part a module under scout_core belongs to (None: the test machinery, drawn apart)."""
    rest = module.split(".")[1:]
    if not rest or rest[0] in ("testing", "__init__", "__main__"):  # the package's re-exports; test machinery
        return None
    for part, prefixes in PARTS.items():
        if rest[0] in prefixes:
            return part
    raise KeyError(f"{module} belongs to no part of the picture: add it to PARTS in {Path(__file__).name}")


def _imports(path: Path, module: str) -> set[str]:
    """scout_core modules imported at run time (not only for type checking), relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            found.add(name)
            found |= {f"{name}.{a.name}" for a in node.names if _is_module(f"{name}.{a.name}")}
    return {m for m in found if m.split(".")[0] == "scout_core"}


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def edges() -> list[tuple[str, str]]:
    """(importer, imported) between parts, each pair once, sorted."""
    pairs = set()
    for path in sorted((ROOT / "scout_core").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        src = part_of(module)
        for imported in _imports(path, module):
            dst = part_of(imported)
            if src and dst and src != dst and dst not in EVERYWHERE:
                pairs.add((src, dst))
    return sorted(pairs)


def mermaid() -> str:
    ids = {part: f"P{i}" for i, part in enumerate(PARTS)}
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'  {ids[p]}["{p}"]' for p in PARTS]
    lines += [f"  {ids[a]} --> {ids[b]}" for a, b in edges()]
    return "\n".join([*lines, "```"])


def block() -> str:
    return f"{START}\n{mermaid()}\n{END}"


def current(page: str) -> str:
    """The block checked into the page."""
    head, _, rest = page.partition(START)
    return START + rest.partition(END)[0] + END


def main() -> int:
    page = PAGE.read_text()
    PAGE.write_text(page.replace(current(page), block()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
