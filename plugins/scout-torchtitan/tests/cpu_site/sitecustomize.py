"""Test machinery only: put on ``PYTHONPATH`` for ``torchrun ... -m torchtitan.train`` on this CPU machine.

``python -m torchtitan.train`` imports TorchTitan's triton kernels before it reads a flag, and this host has no
triton; every process of the launch gets scout_torchtitan.cpu's stand-ins and the host device type first.
"""

from scout_torchtitan import cpu

cpu.use_cpu()
