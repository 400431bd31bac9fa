"""The hang cells' ``on_incident`` callback: a module-level function, so a spawned observer imports it by path.

Light on purpose (no torch): each observer imports it at start. The file it appends to comes from the
environment the observer inherits from its trainer (set per rank before ``enable()``).
"""

from __future__ import annotations

import os

from scout_core.report import Incident, JsonlSink

CALLBACK_FILE_ENV = "SCOUT_CELL_CALLBACK_FILE"


def record_incident(inc: Incident) -> None:
    """Append the verdict to this rank's callback file (the cell checks every observer ran its callback)."""
    JsonlSink(os.environ[CALLBACK_FILE_ENV], fsync=False).emit(inc)
