"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.testing.launcher)."""

from pathlib import Path

import pytest

from scout_core.testing.cells import load_cells
from scout_core.testing.launcher import prepare_parent

prepare_parent()

# The cells whose target imports a framework into this process (TorchTitan, Megatron-Core, DeepSpeed, transformers,
# Lightning) run after every other test, so the core cells' and guards' ranks fork from a parent without the
# frameworks, also where pytest-xdist hands tests out in this order (each worker runs its share in order). The
# plugins' guards come last in test_cells.py for the same reason; the torchrun and observer tests, in the files
# after it, may run in a process that imported a framework (they did before).
_FRAMEWORK_TARGETS = {"titan_cells", "megatron_cells", "deepspeed_cells", "hf_cells", "lightning_cells"}
_SPECS = load_cells(Path(__file__).resolve().parents[1] / "configs" / "cells.yaml")


def _imports_a_framework(item: pytest.Item) -> bool:
    name = getattr(item, "callspec", None) and item.callspec.params.get("name")
    return bool(name) and _SPECS[name].target.split(":")[0].rsplit(".", 1)[-1] in _FRAMEWORK_TARGETS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of test_cells.py but ``test_cell_passes`` is a guard (a cell re-run with one mechanism removed,
    which must turn red): marked ``guards``. The frameworks' cells go last (a stable sort: otherwise in order)."""
    for item in items:
        if item.path.name == "test_cells.py" and getattr(item, "originalname", "") != "test_cell_passes":
            item.add_marker(pytest.mark.guards)
    items.sort(key=_imports_a_framework)


@pytest.fixture
def forked_observers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observers forked from their trainers (``observer.start_method: fork``) for a test that patches the
    observer's own code: a fresh interpreter would not see the patch."""
    from scout_core.progress import spawn
    from scout_core.progress.observer import fork_for

    monkeypatch.setattr(spawn, "spawn_observer", lambda spec, callback: fork_for(spec))
