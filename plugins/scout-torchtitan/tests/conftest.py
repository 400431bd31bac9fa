"""TorchTitan imports triton with its models; this CPU machine has none (scout_torchtitan.cpu)."""

from scout_torchtitan.cpu import stub_triton_kernels

stub_triton_kernels()
