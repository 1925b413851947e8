"""Device profiles: one device's throughputs and its links, by name or from a file.

A profile is the hardware half of the cost model. :data:`PROFILES` holds
first-order datasheet figures (good enough to rank placements, not
measurements): three single-device profiles written here and the multi-node
clusters of the files in ``scheduling/profiles/``, each of which names its
sources. A profile file of one's own (the same JSON) is named by its path
(:func:`device_profile`).

No JAX here: a policy, and a configuration holding one, names its profile before
anything compiles.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from scheduling import names

# Operand dtypes that run at a profile's half-precision peak (NumPy dtype names), and at
# its 8-bit float peak.
HALF_PRECISION = frozenset({"bfloat16", "float16"})
EIGHT_BIT = frozenset({"float8_e4m3fn", "float8_e5m2"})


@functools.cache
def _dtype_name(dtype: Any) -> str:
    """``dtype``'s NumPy name ("" for JAX's extended dtypes); asked once per dtype, since
    NumPy builds the name anew each time it is read."""
    import numpy as np  # only when costing, where JAX (and NumPy) are loaded

    try:
        return np.dtype(dtype).name
    except TypeError:
        return ""


@dataclass(frozen=True)
class DeviceProfile:
    """Throughputs of one device and its links to the others.

    Flat (``devices_per_node == 0``): every collective runs over ``link_bytes_per_s``
    per device. Hierarchical: devices come in nodes of ``devices_per_node`` (consecutive
    device ids); ``link_bytes_per_s`` is each device's link inside its node (NVLink),
    and the devices of a node share ``node_link_bytes_per_s`` to the other nodes.
    """

    name: str
    flops_per_s: float
    memory_bytes_per_s: float
    op_overhead_s: float
    link_bytes_per_s: float
    link_latency_s: float
    devices_per_node: int = 0
    node_link_bytes_per_s: float = 0.0
    node_link_latency_s: float = 0.0
    # The compiler fuses elementwise ops into the kernels around them (XLA on GPU): they
    # cost their memory traffic but no launch overhead of their own.
    fused_elementwise: bool = False
    # One device's memory (bytes); 0: not known (nothing can be said to fit or not).
    memory_capacity_bytes: float = 0.0
    # The matmul peak with 16-bit float operands (bfloat16, float16); 0: ``flops_per_s``.
    half_precision_flops_per_s: float = 0.0
    # The matmul peak with 8-bit float operands (float8_e4m3fn, float8_e5m2); 0: the
    # 16-bit peak (a device without FP8 tensor cores multiplies them widened).
    fp8_flops_per_s: float = 0.0
    # The fraction of the peak a matmul reaches, by its FLOPs: points ``(flops, fraction)``
    # in increasing FLOPs, interpolated in log FLOPs and held flat past either end; empty:
    # the peak (1.0). Small products are memory-bound, which the roofline says already.
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    # The target runs the ops of a one-kernel scope (``scheduling.names.ONE_KERNEL_SCOPE``:
    # the attention core, as cuDNN's flash attention) as one kernel.
    fused_kernels: bool = False

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "memory_bytes_per_s", "link_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DeviceProfile.{name} must be > 0")
        for name in (
            "op_overhead_s",
            "link_latency_s",
            "node_link_latency_s",
            "memory_capacity_bytes",
            "half_precision_flops_per_s",
            "fp8_flops_per_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceProfile.{name} must be >= 0")
        # Read from JSON (a profile file, a run's config.json) the points are lists.
        points = tuple(tuple(point) for point in self.matmul_efficiency)
        object.__setattr__(self, "matmul_efficiency", points)
        if any(len(p) != 2 or p[0] <= 0 or not 0 < p[1] <= 1 for p in points) or any(
            b[0] <= a[0] for a, b in itertools.pairwise(points)
        ):
            raise ValueError(
                "DeviceProfile.matmul_efficiency must be (flops, fraction) points, FLOPs "
                "increasing and > 0, fractions in (0, 1]"
            )
        if self.devices_per_node < 0:
            raise ValueError("DeviceProfile.devices_per_node must be >= 0 (0: one flat link)")
        if self.devices_per_node and self.node_link_bytes_per_s <= 0:
            raise ValueError(
                "DeviceProfile.node_link_bytes_per_s must be > 0 when devices_per_node is set"
            )

    def peak_flops_per_s(self, dtype: Any) -> float:
        """The compute peak for operands of ``dtype`` (16-bit and 8-bit floats have their
        own; JAX's extended dtypes, such as PRNG keys, are not NumPy dtypes and count as
        full width)."""
        name = _dtype_name(dtype)
        if name in EIGHT_BIT and self.fp8_flops_per_s:
            return self.fp8_flops_per_s
        if (name in HALF_PRECISION or name in EIGHT_BIT) and self.half_precision_flops_per_s:
            return self.half_precision_flops_per_s
        return self.flops_per_s

    def matmul_fraction(self, flops: float) -> float:
        """The fraction of the peak a matmul of ``flops`` reaches (``matmul_efficiency``)."""
        points = self.matmul_efficiency
        if not points:
            return 1.0
        if flops <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if flops <= x1:
                t = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + t * (y1 - y0)
        return points[-1][1]

    def with_link(self, bytes_per_s: float, latency_s: float | None = None) -> DeviceProfile:
        return replace(
            self,
            link_bytes_per_s=bytes_per_s,
            link_latency_s=self.link_latency_s if latency_s is None else latency_s,
        )


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from a hardware profile file: JSON with the fields of :class:`DeviceProfile`
    (plus ``description`` and ``sources``, which say where each figure comes from)."""
    data = json.loads(Path(path).read_text())
    known = {f.name for f in fields(DeviceProfile)}
    unknown = set(data) - known - {"description", "sources"}
    if unknown:
        raise ValueError(f"{path}: unknown profile fields {sorted(unknown)}")
    return DeviceProfile(**{name: value for name, value in data.items() if name in known})


PROFILE_FILES = names.PROFILE_DIRECTORY

PROFILES: dict[str, DeviceProfile] = {
    # A100 SXM: 156 TFLOP/s TF32 and 312 TFLOP/s BF16 dense, 1.55 TB/s and 40 GB of HBM2
    # (the 40 GB model's figures); 200 Gbit/s network per GPU.
    "a100": DeviceProfile(
        "a100",
        156e12,
        1.55e12,
        5e-6,
        25e9,
        10e-6,
        memory_capacity_bytes=40e9,
        half_precision_flops_per_s=312e12,
    ),
    # V100 SXM2: 125 TFLOP/s fp16 tensor cores, 0.9 TB/s and 32 GB of HBM2; 100 Gbit/s
    # per node of 8.
    "v100": DeviceProfile(
        "v100", 125e12, 0.9e12, 5e-6, 100e9 / 8 / 8, 10e-6, memory_capacity_bytes=32e9
    ),
    # One core of a CPU host running fake devices, joined by a 300 Mbit/s shaped link.
    "cpu": DeviceProfile("cpu", 20e9, 10e9, 5e-6, 300e6 / 8, 100e-6),
    # Multi-node clusters, from the files in scheduling/profiles/ (sources inside).
    **{p.name: p for p in map(load_profile, sorted(PROFILE_FILES.glob("*.json")))},
}


def device_profile(profile: str | DeviceProfile) -> DeviceProfile:
    """The profile named (:data:`PROFILES`), the one a profile file describes (a path
    ending in ``.json``), or ``profile`` itself."""
    if isinstance(profile, DeviceProfile):
        return profile
    if profile in PROFILES:
        return PROFILES[profile]
    return load_profile(profile)


def profile_problem(profile: Any) -> str:
    """What is wrong with ``profile`` as a policy's profile ("" if nothing). A profile file
    is only named here (no I/O): it is read where it is used (:func:`device_profile`)."""
    if isinstance(profile, DeviceProfile) or (isinstance(profile, str) and profile in PROFILES):
        return ""
    if isinstance(profile, str) and profile.endswith(".json"):
        return ""
    return (
        f"choose one of {', '.join(names.PROFILES)}, a profile file (NAME.json) or a DeviceProfile"
    )
