"""``scout try lightning``: a new user's first run, as the README's first screen gives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from scout_core.testing.tryout_check import check_tryout


@pytest.mark.parametrize("fault", ["sdc", "hang"])
def test_scout_try_lightning_names_the_faulty_rank_at_the_shipped_settings(tmp_path, fault):
    check_tryout("lightning", fault, tmp_path, root=Path(__file__).resolve().parents[3])
