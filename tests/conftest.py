"""Test set-up: 8 fake CPU devices, set before jax is first imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): one worker per core, at most 4, to bound the memory:
    each worker compiles for 8 fake devices and some tests start processes of their own."""
    return max(1, min(os.cpu_count() or 1, 4))
