"""Session-wide pytest hooks."""

from __future__ import annotations

import sys

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print a failure's reason as it happens: CI stops at its wall-clock limit, and a summary that pytest only
    writes at the end would then never be seen."""
    if report.failed:
        text = report.longreprtext
        sys.stderr.write(f"\n--- {report.nodeid} failed ({report.when}):\n{text[-6000:]}\n---\n")
        sys.stderr.flush()
