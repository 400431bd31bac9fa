"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.testing.launcher)."""

from scout_core.testing.launcher import prepare_parent

prepare_parent()
