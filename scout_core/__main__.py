"""``python -m scout_core``: the ``scout`` command."""
import sys

from scout_core.cli import main

sys.exit(main())
