"""DeepSpeed on this CPU machine: its CPU accelerator, and the repository root importable (integrations_tests)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
