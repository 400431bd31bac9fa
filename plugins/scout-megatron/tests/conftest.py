"""Megatron-Core on this CPU machine (Python 3.11, no triton): the plugin's CPU try-out support (scout_megatron.cpu)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: integrations_tests

from scout_megatron import cpu as megatron_cpu  # noqa: E402

megatron_cpu.allow_python_311()
megatron_cpu.stub_triton_ops()
