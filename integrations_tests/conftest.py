"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.testing.launcher)."""

import pytest

from scout_core.testing.launcher import prepare_parent

prepare_parent()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of test_cells.py but ``test_cell_passes`` is a guard (a cell re-run with one mechanism removed,
    which must turn red): marked ``guards``."""
    for item in items:
        if item.path.name == "test_cells.py" and getattr(item, "originalname", "") != "test_cell_passes":
            item.add_marker(pytest.mark.guards)


@pytest.fixture
def forked_observers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observers forked from their trainers (``observer.start_method: fork``) for a test that patches the
    observer's own code: a fresh interpreter would not see the patch."""
    from scout_core.progress import spawn
    from scout_core.progress.observer import fork_for

    monkeypatch.setattr(spawn, "spawn_observer", lambda spec, callback: fork_for(spec))
