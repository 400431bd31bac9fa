"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.testing.launcher)."""

import pytest

from scout_core.testing.launcher import prepare_parent

prepare_parent()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of test_cells.py but ``test_cell_passes`` is a guard (a cell re-run with one mechanism removed,
    which must turn red): marked ``guards``, run by ``nox -s guards``."""
    for item in items:
        if item.path.name == "test_cells.py" and getattr(item, "originalname", "") != "test_cell_passes":
            item.add_marker(pytest.mark.guards)
