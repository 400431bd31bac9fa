import sys

from scout_core.cli import main

sys.exit(main())
