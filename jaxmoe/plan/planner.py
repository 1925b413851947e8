"""The mapping planner (``jaxmoe plan``): every parallel mapping of a model on N devices,
estimated and ranked.

For each valid mapping (:mod:`jaxmoe.plan.mappings`) the per-device train step is
traced on an abstract mesh of N devices (no devices are needed, so N may exceed this
host's) and estimated as ``jaxmoe schedule`` estimates it: the scheduler's cost model
and two-stream simulator on a device profile, for each schedule asked for; the
fastest counts. Per device it also counts the memory (:class:`MemoryPerDevice`), and
the MFU is the model FLOPs of a step (:mod:`jaxmoe.train.model_flops`, nothing
dropped) over step time x devices x the profile's peak. Mappings whose memory
exceeds the profile's device memory are dropped; the rest are ranked, best MFU first.

Estimates are kept on disk (``$XDG_CACHE_HOME/jaxmoe/plan``), keyed by the mapped
configuration, the profile, the schedule and a digest of this package's and the
scheduler's sources and the JAX versions, so any change to the program or the cost
model estimates afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

import scheduling
from jaxmoe.config import Config, ConfigError
from jaxmoe.parallel.mesh import abstract_mesh
from jaxmoe.plan.layer_extrapolation import block_count, extrapolate, extrapolates, with_blocks
from jaxmoe.plan.mappings import Mapping, MappingSpace, enumerate_mappings
from jaxmoe.train.memory import memory_per_device
from jaxmoe.train.mfu import mfu
from jaxmoe.train.model_flops import model_flops
from jaxmoe.train.scheduled import capture_train_step, op_cost_cache, schedule_policy
from jaxmoe.train.state import TrainState, abstract_train_state
from scheduling import (
    Program,
    aval_bytes,
    batch_inputs,
    build_report,
    cost_model,
    plan,
    saved_for_backward,
)

# Modules that only present estimates: left out of the estimate cache's key.
PRESENTATION = frozenset({"cli.py", "plan_table.py"})
MEMORY_METHOD = (
    "per device: parameters, optimizer state (AdamW moments and counts, the gradient-sync "
    "state, the placement table) and the step counter are the local shards the captured "
    "step receives; gradients are one per local parameter element; activations are the "
    "forward values the backward pass reads in the captured program (its residuals, "
    "alive together when the backward pass begins). The total is their sum, an upper "
    "bound on these parts at once (activations are freed as gradients appear), without "
    "XLA's working buffers and fusions. Under train.zero (jaxmoe/train/memory.py): the "
    "parameters and optimizer state are the shards; ZeRO-1 keeps one gradient per local "
    "parameter element (reduce-scattered after the backward pass) and its gathered "
    "parameters are among the activations the backward pass reads; ZeRO-3 keeps the "
    "gradient shards plus one block's whole gradients, and adds to the parameters those "
    "gathered outside the blocks and one block's (released after its forward and its "
    "backward pass)."
)


@dataclass(frozen=True)
class MemoryPerDevice:
    """Bytes per device (see :data:`MEMORY_METHOD`)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def to_json(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclass(frozen=True)
class StepTime:
    """One schedule's simulated step (seconds)."""

    step: float
    compute: float
    communication: float
    exposed_communication: float


@dataclass(frozen=True)
class MappingEstimate:
    mapping: Mapping
    memory: MemoryPerDevice
    times: dict[str, StepTime]  # schedule -> its simulated step
    mfu: float  # of the fastest schedule
    fits: bool  # memory.total within the profile's device memory (or it is not known)

    @property
    def schedule(self) -> str:
        return min(self.times, key=lambda name: self.times[name].step)

    @property
    def best(self) -> StepTime:
        return self.times[self.schedule]

    def to_json(self) -> dict[str, Any]:
        return {
            "mapping": self.mapping.to_json(),
            "schedule": self.schedule,
            "step_seconds": self.best.step,
            "mfu": self.mfu,
            "memory_bytes": self.memory.to_json(),
            "fits": self.fits,
            "by_schedule": {name: dataclasses.asdict(t) for name, t in self.times.items()},
        }


@dataclass(frozen=True)
class PlanResult:
    preset: str
    devices: int
    profile: scheduling.DeviceProfile
    schedules: tuple[str, ...]
    model_flops_per_step: float
    space: MappingSpace
    estimates: list[MappingEstimate]  # ranked: those that fit, best MFU first, then the rest
    extrapolated: bool = False  # estimated from one- and two-block traces
    peak_flops_per_s: float = 0.0  # the profile's for the model's dtype (the MFU's peak)

    @property
    def ranked(self) -> list[MappingEstimate]:
        return [e for e in self.estimates if e.fits]

    @property
    def over_memory(self) -> list[MappingEstimate]:
        return [e for e in self.estimates if not e.fits]

    def to_json(self, command: str = "") -> dict[str, Any]:
        return {
            "command": command,
            "preset": self.preset,
            "devices": self.devices,
            "profile": self.profile.name,
            "peak_flops_per_s": self.peak_flops_per_s,
            "memory_capacity_bytes": self.profile.memory_capacity_bytes or None,
            "schedules": list(self.schedules),
            "model_flops_per_step": self.model_flops_per_step,
            "memory_method": MEMORY_METHOD,
            "depth": "extrapolated from one- and two-block traces"
            if self.extrapolated
            else "traced whole",
            "ranked": [{"rank": i + 1, **e.to_json()} for i, e in enumerate(self.ranked)],
            "over_memory": [e.to_json() for e in self.over_memory],
            "skipped": [
                {"mapping": c.mapping.to_json(), "reason": c.reason} for c in self.space.skipped
            ],
        }


def state_memory(
    program: Program, state: TrainState, config: Config | None = None
) -> MemoryPerDevice:
    """The memory per device of the captured step ``program``, whose first argument has
    the structure of ``state`` (of ``config``, whose ``train.zero`` it follows)."""
    leaves = [len(jax.tree.leaves(field)) for field in state]
    if sum(leaves) >= len(program.inputs):
        raise ValueError("the program's inputs are not (state, batch)")
    sizes, offset = {}, 0
    for name, count in zip(TrainState._fields, leaves, strict=True):
        sizes[name] = sum(aval_bytes(v.aval) for v in program.inputs[offset : offset + count])
        offset += count
    parameters = sizes.pop("params")
    gradients = parameters
    if config is not None and config.train.zero:
        zero = memory_per_device(config)
        gradients = zero.gradients
        if config.train.zero == 3:
            parameters += zero.gathered
    return MemoryPerDevice(
        parameters=parameters,
        gradients=gradients,
        optimizer=sum(sizes.values()),
        activations=saved_for_backward(program).bytes,
    )


def _source_digest() -> str:
    """Of everything an estimate depends on besides its inputs: the code and JAX (the
    command line and the table's layout aside)."""
    import jaxmoe

    digest = hashlib.sha256()
    for package in (jaxmoe, scheduling):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".json") and path.name not in PRESENTATION:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    for name in ("jax", "jaxlib", "flax", "optax"):
        digest.update(f"{name}={importlib.metadata.version(name)}".encode())
    return digest.hexdigest()


class EstimateCache:
    """Estimates on disk, one file per (mapped config, profile, schedule, method: traced
    whole or extrapolated from shallow traces)."""

    def __init__(self, root: Path | None):
        self.root = root
        self._digest = _source_digest() if root is not None else ""

    def _path(self, config: Config, schedule: str, method: str) -> Path:
        assert self.root is not None
        key = json.dumps([config.to_dict(), schedule, method, self._digest], sort_keys=True)
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def load(
        self, config: Config, schedule: str, method: str
    ) -> tuple[MemoryPerDevice, StepTime] | None:
        if self.root is None:
            return None
        try:
            data = json.loads(self._path(config, schedule, method).read_text())
            return MemoryPerDevice(**data["memory"]), StepTime(**data["time"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(
        self,
        config: Config,
        schedule: str,
        method: str,
        memory: MemoryPerDevice,
        time: StepTime,
    ):
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        record = {"memory": dataclasses.asdict(memory), "time": dataclasses.asdict(time)}
        self._path(config, schedule, method).write_text(json.dumps(record) + "\n")


def _with_schedule(config: Config, schedule: str, profile: str) -> Config:
    return dataclasses.replace(
        config, schedule=dataclasses.replace(config.schedule, name=schedule, profile=profile)
    )


def _traced_estimate(
    config: Config, schedules: Sequence[str], profile: str
) -> tuple[MemoryPerDevice, dict[str, StepTime]]:
    """Memory per device and each schedule's simulated step, from one trace of the step."""
    mesh = abstract_mesh(config.parallel)
    program, sharded = capture_train_step(config, mesh)
    memory = state_memory(program, abstract_train_state(config), config)
    batch = batch_inputs(program, sharded.batch_argnums)
    times = {}
    for schedule in schedules:
        policy = schedule_policy(_with_schedule(config, schedule, profile))
        cost = cost_model(policy, mesh)
        report = build_report(plan(program, policy, cost, batch), cost, policy, program)
        times[schedule] = StepTime(
            report.step_seconds,
            report.compute_seconds,
            report.communication_seconds,
            report.exposed_communication_seconds,
        )
    return memory, times


def estimate_mapping(
    config: Config,
    schedules: Sequence[str],
    profile: str,
    cache: EstimateCache,
    *,
    extrapolate_layers: bool = True,
) -> tuple[MemoryPerDevice, dict[str, StepTime]]:
    """Memory per device and the simulated step of each schedule, for a mapped config.

    Nothing is traced when every schedule is cached. Otherwise the step is traced once
    for all schedules, or, with ``extrapolate_layers`` and a model of at least
    :data:`~jaxmoe.plan.layer_extrapolation.MIN_BLOCKS` repeating blocks, once with
    one block and once with two, and the figures are extrapolated to the model's depth
    (:mod:`jaxmoe.plan.layer_extrapolation`)."""
    method = "extrapolated" if extrapolate_layers and extrapolates(config) else "traced"
    keyed = {s: _with_schedule(config, s, profile) for s in schedules}
    found = {s: cache.load(keyed[s], s, method) for s in schedules}
    if all(found.values()):
        memory = next(iter(found.values()))[0]  # type: ignore[index]
        return memory, {s: hit[1] for s, hit in found.items()}  # type: ignore[index]
    if method == "traced":
        memory, times = _traced_estimate(config, schedules, profile)
    else:
        blocks = block_count(config)
        assert blocks is not None
        one = _traced_estimate(with_blocks(config, 1), schedules, profile)
        two = _traced_estimate(with_blocks(config, 2), schedules, profile)
        memory = extrapolate(one[0], two[0], blocks)
        times = {s: extrapolate(one[1][s], two[1][s], blocks) for s in schedules}
    for schedule in schedules:
        cache.save(keyed[schedule], schedule, method, memory, times[schedule])
    return memory, times


def check_plan_inputs(config: Config, devices: int, profile: str, schedules: Sequence[str]):
    """Every input of a plan, refused with one ConfigError line before anything is traced."""
    if not schedules:
        raise ConfigError("--schedule: name at least one schedule")
    if profile not in scheduling.PROFILES:
        raise ConfigError(
            f"--profile {profile!r}: choose one of {', '.join(sorted(scheduling.PROFILES))}"
        )
    for schedule in schedules:
        _with_schedule(config, schedule, profile)  # the train config validates both


def plan_mappings(
    config: Config,
    preset: str,
    devices: int,
    profile: str,
    schedules: Sequence[str] = ("none",),
    *,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
    memory_capacity_bytes: float | None = None,
    extrapolate_layers: bool = True,
) -> PlanResult:
    """Estimate and rank every valid mapping of ``config``'s model on ``devices`` devices.

    Raises ConfigError (before tracing anything) for a bad input, or when no mapping is
    valid. ``cache_dir``: where estimates are kept (None: nowhere).
    ``memory_capacity_bytes``: the memory a device offers (default: the profile's).
    ``extrapolate_layers``: estimate deep models from one- and two-block traces (see
    :func:`estimate_mapping`)."""
    check_plan_inputs(config, devices, profile, schedules)
    device = scheduling.PROFILES[profile]
    space = enumerate_mappings(config, devices, device.devices_per_node)
    if not space.valid:
        reasons = space.skipped_summary()
        raise ConfigError(
            f"no valid mapping of preset {preset!r} on {devices} devices; "
            f"{len(space.skipped)} refused, most often: {reasons[0] if reasons else 'none'}"
        )
    if memory_capacity_bytes is not None:
        device = dataclasses.replace(device, memory_capacity_bytes=memory_capacity_bytes)
    capacity = device.memory_capacity_bytes
    cache = EstimateCache(cache_dir)
    flops = model_flops(config).train_step()
    peak = device.peak_flops_per_s(config.model.dtype)
    estimates = []
    for index, candidate in enumerate(space.valid):
        assert candidate.config is not None
        memory, times = estimate_mapping(
            candidate.config, schedules, profile, cache, extrapolate_layers=extrapolate_layers
        )
        step = min(t.step for t in times.values())
        estimates.append(
            MappingEstimate(
                mapping=candidate.mapping,
                memory=memory,
                times=times,
                mfu=mfu(flops, step, devices, peak),
                fits=not capacity or memory.total <= capacity,
            )
        )
        if progress is not None:
            progress(
                f"[{index + 1}/{len(space.valid)}] {candidate.mapping.label()}: "
                f"{step * 1e3:.3f} ms, {memory.total / 1e9:.3f} GB"
            )
    estimates.sort(key=lambda e: (not e.fits, -e.mfu, e.memory.total))
    extrapolated = extrapolate_layers and extrapolates(config)
    return PlanResult(
        preset, devices, device, tuple(schedules), flops, space, estimates, extrapolated, peak
    )


def default_cache_dir() -> Path:
    return op_cost_cache() / "plan"
