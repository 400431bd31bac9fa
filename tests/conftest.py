"""Warm the parent once: forked ranks then start in milliseconds (see scout_core.launcher)."""

from scout_core.launcher import prepare_parent

prepare_parent()
