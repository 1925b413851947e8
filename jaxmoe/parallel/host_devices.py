"""The CPU (host) platform's device count, set before JAX starts its backends."""

from __future__ import annotations

import os


def ensure_host_devices(count: int) -> None:
    """Give the CPU platform ``count`` devices unless XLA_FLAGS already sets it.

    Must run before JAX creates its backends. It only shapes the CPU (host) platform, so
    on a GPU machine the GPUs stay the devices a run uses.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
