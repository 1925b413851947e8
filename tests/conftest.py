"""Test set-up, before jax is first imported: 8 fake CPU devices, and XLA:CPU's backend
(LLVM) optimisation off.

Most of the suite's time is XLA compiling small training steps that then run for a few
steps: at ``--xla_backend_optimization_level=0`` they compile in about 60% of the CPU
time. The tests check what is computed, never how fast; the HLO passes (fusion, buffer
assignment, the memory analysis the memory tests read) are the same at every level, and
processes the tests start inherit the flags."""

import os

_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): one worker per core, at most 4, to bound the memory:
    each worker compiles for 8 fake devices and some tests start processes of their own."""
    return max(1, min(os.cpu_count() or 1, 4))
