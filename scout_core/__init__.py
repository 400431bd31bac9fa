"""SCOUT core: localize hangs, stragglers and silent data corruption by strict-majority consensus."""

__version__ = "0.1.0"
