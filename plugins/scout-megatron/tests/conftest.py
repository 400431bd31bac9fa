"""Megatron-Core on this CPU machine (Python 3.11, no triton): the test-only shim of integrations_tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: integrations_tests

from integrations_tests import megatron_cpu  # noqa: E402

megatron_cpu.allow_python_311()
megatron_cpu.stub_triton_ops()
