"""XLA flags set before JAX starts its backends: the CPU (host) platform's device count,
and what XLA:GPU needs of a run (the flags under which it keeps a scheduled step's plan,
and those under which it runs FP8 products as cuBLASLt FP8 GEMMs)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import scheduling.names

if TYPE_CHECKING:
    from jaxmoe.config import Config

# XLA flags under which XLA:GPU runs FP8 products (``model.fp8``) as cuBLASLt FP8 GEMMs:
# XLA's Triton GEMMs off. With them on (jax 0.11.2, an H200), compiling one expert
# block's FP8 forward and backward ran past 70 s, autotuning Triton's tilings of each FP8
# product; with them off it took 1.2 s, and a bfloat16 step's time stayed inside its
# spread (136.5 against 137.8 ms: experiments/results/gpu_check/).
FP8_XLA_GPU_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


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


def xla_flags_for(config: Config) -> list[str]:
    """The XLA flags ``config`` needs on GPU (other backends ignore them): the scheduler
    that keeps a scheduled step's windows, and cuBLASLt for FP8 products."""
    flags = []
    if config.schedule.name != "none":
        flags += scheduling.names.XLA_GPU_FLAGS
    if config.model.fp8 != "none":
        flags += FP8_XLA_GPU_FLAGS
    return flags
