"""XLA flags set before JAX starts its backends: the CPU (host) platform's device count,
and the flags under which XLA:GPU keeps a scheduled step's plan."""

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


def ensure_xla_flags(flags: list[str]) -> None:
    """Add each of ``flags`` (``--name=value``) to XLA_FLAGS unless it already names it.

    Must run before JAX creates its backends. The scheduled steps need
    :func:`scheduling.xla_gpu_flags` on GPU (the latency-hiding scheduler, and what lets
    it keep the planned windows); other backends ignore them. A flag the caller's
    XLA_FLAGS already names keeps the caller's value."""
    current = os.environ.get("XLA_FLAGS", "")
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name not in current:
            current = f"{current} {flag}".strip()
    os.environ["XLA_FLAGS"] = current
