"""Model FLOPs utilisation: a device's peak, and MFU = model FLOPs / (seconds x devices x peak).

The model FLOPs are :func:`jaxmoe.plan.model_flops.model_flops`. The peak is
``train.peak_tflops`` when given; otherwise the dense (no sparsity) tensor-core
peak of the device that runs, from the datasheet figures below, for the compute
dtype (``model.dtype``). A float32 model counts against TF32 where the GPU has
it: JAX computes float32 matmuls with TF32 on recent NVIDIA GPUs unless told
otherwise (https://docs.jax.dev/en/latest/201/precision.html; set
``train.peak_tflops`` if a run asks for full float32 precision). On a device
that is not in the table (a CPU host, say) there is no peak, and so no MFU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jaxmoe.config import Config
from jaxmoe.plan.model_flops import ModelFlops, model_flops


@dataclass(frozen=True)
class DevicePeak:
    """Dense peaks of the devices whose ``device_kind`` matches ``pattern``."""

    pattern: str  # a regular expression, searched case-insensitively
    bfloat16_tflops: float
    float32_tflops: float  # TF32 tensor cores where the device has them


# First match wins: a variant before its family. NVIDIA's datasheets give tensor-core
# figures with 2:4 sparsity; the dense peak is half of them.
DEVICE_PEAKS = (
    # NVIDIA HGX B200 specifications: BF16 4.5 and TF32 2.2 PFLOPS per GPU with sparsity
    # (as in scheduling/profiles/b200-8x-nvlink-3200g.json).
    DevicePeak(r"\bB200\b", 2250.0, 1100.0),
    # NVIDIA H200 NVL datasheet: BF16 1,671 and TF32 835 TFLOPS with sparsity.
    DevicePeak(r"\bH200 NVL\b", 835.5, 417.5),
    # NVIDIA H200 (SXM) datasheet: BF16 1,979 and TF32 989 TFLOPS with sparsity.
    DevicePeak(r"\bH200\b", 989.5, 494.5),
    # NVIDIA H100 datasheet, PCIe: BF16 1,513 and TF32 756 TFLOPS with sparsity.
    DevicePeak(r"\bH100\b.*\bPCIe\b", 756.5, 378.0),
    # NVIDIA H100 datasheet, SXM ("H100 80GB HBM3"): BF16 1,979 and TF32 989 TFLOPS with
    # sparsity (as in scheduling/profiles/h100-8x-nvlink-3200g.json).
    DevicePeak(r"\bH100\b.*\b(HBM3|SXM)", 989.5, 494.5),
    # NVIDIA A100 datasheet (SXM4 and PCIe, 40 and 80 GB): BF16 312, TF32 156 TFLOPS dense.
    DevicePeak(r"\bA100\b", 312.0, 156.0),
    # NVIDIA Tesla V100 datasheet: FP32 15.7 (SXM2) and 14 (PCIe) TFLOPS. No TF32, and no
    # bfloat16 tensor cores: XLA computes bfloat16 matmuls there in float32.
    DevicePeak(r"\bV100-SXM2\b", 15.7, 15.7),
    DevicePeak(r"\bV100-PCIE\b", 14.0, 14.0),
)


def datasheet_peak_tflops(device_kind: str, dtype: str) -> float | None:
    """The dense peak of one ``device_kind`` (as ``jax.Device.device_kind`` names it) for
    ``dtype`` (``model.dtype``), or None for a device not in :data:`DEVICE_PEAKS`."""
    for peak in DEVICE_PEAKS:
        if re.search(peak.pattern, device_kind, re.IGNORECASE):
            return peak.bfloat16_tflops if dtype == "bfloat16" else peak.float32_tflops
    return None


def peak_flops_per_s(config: Config, device_kind: str) -> tuple[float, str] | None:
    """One device's peak FLOP/s and where it comes from, or None where it is unknown."""
    if config.train.peak_tflops is not None:
        return config.train.peak_tflops * 1e12, "--train.peak_tflops"
    tflops = datasheet_peak_tflops(device_kind, config.model.dtype)
    if tflops is None:
        return None
    return tflops * 1e12, f"the {config.model.dtype} datasheet peak of {device_kind}"


def mfu(model_flops_per_step: float, step_seconds: float, devices: int, peak: float) -> float:
    """Model FLOPs utilisation of a step: its model FLOPs over what ``devices`` devices
    of ``peak`` FLOP/s each could compute in ``step_seconds``."""
    return model_flops_per_step / (step_seconds * devices * peak)


@dataclass(frozen=True)
class MfuMeter:
    """The MFU of each training step of one run, from its measured time."""

    flops: ModelFlops
    devices: int
    peak_flops_per_s: float  # of one device
    peak_source: str

    def __call__(self, step_seconds: float, dropped_fraction: float) -> float:
        return mfu(
            self.flops.train_step(dropped_fraction),
            step_seconds,
            self.devices,
            self.peak_flops_per_s,
        )

    def describe(self) -> str:
        return (
            f"mfu: {self.flops.train_step() / 1e9:.4g} GFLOP of model FLOPs per step (with "
            f"nothing dropped) on {self.devices} devices of {self.peak_flops_per_s / 1e12:g} "
            f"TFLOP/s ({self.peak_source})"
        )


def mfu_meter(config: Config, devices: int, device_kind: str) -> MfuMeter | None:
    """The meter for a run on ``devices`` devices of ``device_kind``, or None where no peak
    is known (then the metrics have no ``mfu``)."""
    peak = peak_flops_per_s(config, device_kind)
    if peak is None:
        return None
    return MfuMeter(model_flops(config), devices, *peak)


def no_peak_message(config: Config, device_kind: str) -> str:
    return (
        f"mfu: no peak known for {device_kind!r} ({config.model.dtype}): the metrics have no "
        "mfu; give --train.peak_tflops to add it"
    )


@dataclass(frozen=True)
class EstimatedMfu:
    """MFU of the scheduler's simulated step, against its device profile's peak."""

    model_flops_per_step: float  # every routed assignment kept
    devices: int
    peak_flops_per_s: float  # the profile's
    profile: str
    step_seconds: float  # as scheduled
    baseline_step_seconds: float  # unscheduled
    ideal_step_seconds: float

    def of(self, step_seconds: float) -> float:
        return mfu(self.model_flops_per_step, step_seconds, self.devices, self.peak_flops_per_s)

    def line(self) -> str:
        def percent(seconds: float) -> str:
            return f"{100 * self.of(seconds):.3g}%"

        return (
            f"estimated MFU {percent(self.step_seconds)} (unscheduled "
            f"{percent(self.baseline_step_seconds)}, ideal {percent(self.ideal_step_seconds)}): "
            f"{self.model_flops_per_step / 1e9:.6g} GFLOP of model FLOPs per step (nothing "
            f"dropped), {self.devices} devices at {self.peak_flops_per_s / 1e12:g} TFLOP/s "
            f"each (profile '{self.profile}')"
        )


def estimated_mfu(config: Config, report: Any, devices: int) -> EstimatedMfu:
    """The estimated MFU of a step that the scheduler planned for ``config`` (``report``:
    its :class:`scheduling.ScheduleReport`) on ``devices`` devices.

    The peak is ``schedule.profile``'s for ``model.dtype`` (its half-precision
    peak for bfloat16 where it gives one), the figure the step's matmuls were costed at.
    """
    profile = config.schedule.device_profile
    return EstimatedMfu(
        model_flops_per_step=model_flops(config).train_step(),
        devices=devices,
        peak_flops_per_s=profile.peak_flops_per_s(config.model.dtype),
        profile=profile.name,
        step_seconds=report.step_seconds,
        baseline_step_seconds=report.baseline_step_seconds,
        ideal_step_seconds=report.ideal_step_seconds,
    )
