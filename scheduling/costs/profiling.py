"""Measured op costs: each distinct op timed on the current backend, cached on disk.

An op is identified by its primitive, its parameters and the shapes and dtypes
of its operands. It is compiled alone, as ``chain`` copies on distinct operands
in one executable, and as a single copy; each is run ``warmup`` times, then
timed ``repeats`` times to completion. The op's cost is the difference of the
medians over ``chain - 1``: what one more copy adds, without the dispatch of
the executable, which a step pays once and not once per op. The copies are
independent, so a runtime that runs independent ops at once may overlap some
of them; on the whole mesh (below) the cores are busy anyway.

Given the program's ``mesh`` (all of its devices local), the op runs on every
device of it at once. Fake CPU devices share the host's cores, so an op of one
device in a step runs as slowly as it does when all of them run it (8 fake
devices on 2 cores: several times as slowly as alone). Without a mesh, or on
an accelerator with one device per chip, the op runs on one device.

Results are cached per backend and concurrency in a JSON file, so a program is
profiled once per machine. What cannot run alone keeps the analytic estimate:
collectives and ops that read a mesh axis (they need the whole mesh), and ops
whose parameters cannot be written down stably (a sub-program). Standalone
timing has no fusion with neighbours, so on a fusing backend it is an upper
bound for small elementwise ops.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scheduling.costs.cost_model import FREE_PRIMITIVES, FUSIBLE, CostModel
from scheduling.costs.link_model import CollectiveCurves
from scheduling.profiles import DeviceProfile
from scheduling.program import jax_adapter
from scheduling.program.capture import Op

# Parameters that may name mesh axes (strings): such ops only run inside the whole-mesh
# shard_map. Reductions use ``axes`` for array dimensions (integers); those run alone.
_AXIS_PARAMETERS = ("axis_name", "axes")


def _names_mesh_axes(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, tuple | list) and any(isinstance(v, str) for v in value)


def _stable(value: Any) -> str | None:
    """A text form of a parameter that is the same in every process, or None."""
    if isinstance(value, str | int | float | bool | type(None)):
        return repr(value)
    if isinstance(value, tuple | list):
        parts = [_stable(v) for v in value]
        return None if None in parts else "(" + ",".join(parts) + ")"
    if isinstance(value, np.dtype) or (hasattr(value, "dtype") and not hasattr(value, "shape")):
        return str(value)
    text = repr(value)
    return None if " at 0x" in text else text  # object identities differ between runs


def op_key(op: Op) -> str | None:
    """What identifies an op's cost; None when it cannot be profiled alone."""
    if op.is_collective or op.is_opaque:
        return None
    if any(_names_mesh_axes(op.eqn.params.get(name)) for name in _AXIS_PARAMETERS):
        return None
    params = []
    for name in sorted(op.eqn.params):
        text = _stable(op.eqn.params[name])
        if text is None:
            return None
        params.append(f"{name}={text}")
    operands = [f"{a.aval.dtype}{list(a.aval.shape)}" for a in op.inputs]
    return f"{op.primitive}|{';'.join(params)}|{','.join(operands)}"


def _example_operand(aval: Any, rng: np.random.Generator) -> jax.Array:
    dtype = np.dtype(aval.dtype)
    if dtype == np.bool_:
        return jnp.asarray(rng.random(aval.shape) < 0.5)
    if np.issubdtype(dtype, np.integer):
        # Small non-negative values: valid as indices for gathers and scatters.
        return jnp.asarray(rng.integers(0, 2, aval.shape).astype(dtype))
    return jnp.asarray(rng.standard_normal(aval.shape).astype(dtype))


def is_local(mesh: jax.sharding.Mesh) -> bool:
    """Every device of ``mesh`` belongs to this process (ops can run on all of them)."""
    local = set(jax.local_devices())
    return all(device in local for device in mesh.devices.flat)


class OpProfiler:
    """Times ops on this backend; ``cache_dir`` keeps results between runs."""

    def __init__(
        self,
        cache_dir: str | Path | None = None,
        *,
        warmup: int = 2,
        repeats: int = 5,
        chain: int = 8,
        mesh: jax.sharding.Mesh | None = None,
    ):
        if chain < 2:
            raise ValueError("OpProfiler.chain must be >= 2: the cost is what a copy adds")
        if mesh is not None and mesh.devices.size > 1:
            if not is_local(mesh):
                raise ValueError(
                    "OpProfiler.mesh: every device of the mesh must be local to run ops on all "
                    "of them at once; pass None to time ops on one device"
                )
        else:
            mesh = None
        self.backend = jax.default_backend()
        self.warmup = warmup
        self.repeats = repeats
        self.chain = chain
        self.mesh = mesh
        suffix = "" if mesh is None else f"-x{mesh.devices.size}"
        self.path = (
            None if cache_dir is None else Path(cache_dir) / f"ops-{self.backend}{suffix}.json"
        )
        self.table: dict[str, float] = {}
        if self.path is not None and self.path.exists():
            self.table = json.loads(self.path.read_text())
        self.measured = 0  # ops timed by this profiler (not from the cache)

    def seconds(self, op: Op) -> float | None:
        """Seconds one more copy of ``op`` adds, or None when it cannot be profiled alone."""
        key = op_key(op)
        if key is None:
            return None
        digest = hashlib.sha256(f"{key}|chain={self.chain}".encode()).hexdigest()[:24]
        if digest not in self.table:
            self.table[digest] = self._time(op)
            self.measured += 1
        return self.table[digest]

    def _time(self, op: Op) -> float:
        rng = np.random.default_rng(0)
        operand_sets = [
            [_example_operand(a.aval, rng) for a in op.inputs] for _ in range(self.chain)
        ]
        executable = self._executable(op)  # compiled once per number of copies
        single = self._median(executable, operand_sets[:1])
        chained = self._median(executable, operand_sets)
        # Never quite free: noise can make the difference vanish for the smallest ops.
        return max(chained - single, 0.05 * single) / (self.chain - 1)

    def _executable(self, op: Op):
        def run(operand_sets):
            # Distinct operands per copy: XLA would merge copies of one op on equal inputs.
            return [jax_adapter.bind_equation(op.eqn, operands) for operands in operand_sets]

        if self.mesh is None:
            return jax.jit(run)
        # The program's own mesh: the op's equation was traced against its axes.
        replicated = jax.sharding.PartitionSpec()
        return jax.jit(
            jax.shard_map(
                run, mesh=self.mesh, in_specs=replicated, out_specs=replicated, check_vma=False
            )
        )

    def _median(self, executable, operand_sets: list[list[jax.Array]]) -> float:
        for _ in range(self.warmup):
            jax.block_until_ready(executable(operand_sets))
        timings = []
        for _ in range(self.repeats):
            started = time.perf_counter()
            jax.block_until_ready(executable(operand_sets))
            timings.append(time.perf_counter() - started)
        return statistics.median(timings)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed into place: a process reading the cache while another
        # saves it sees the old table or the new one, never half of one.
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(self.table, indent=0, sort_keys=True) + "\n")
        os.replace(partial, self.path)


class ProfiledCostModel(CostModel):
    """Measured compute costs where an op runs alone; the analytic model elsewhere.

    Two kinds of op keep the analytic cost even when they could be timed alone,
    because alone they do not cost what they cost in the compiled step: layout
    ops (free: views), and, on a profile with ``fused_elementwise``, the ops XLA
    fuses into their neighbours (their memory traffic, no launch of their own).
    """

    def __init__(
        self,
        profile: DeviceProfile,
        axis_sizes: dict[str, int],
        profiler: OpProfiler,
        curves: CollectiveCurves | None = None,
        device_ids: Sequence[int] | None = None,
    ):
        super().__init__(profile, axis_sizes, curves, device_ids)
        self.profiler = profiler

    def compute_seconds(self, op: Op) -> float:
        if op.primitive in FREE_PRIMITIVES or (
            self.profile.fused_elementwise and op.primitive in FUSIBLE
        ):
            return super().compute_seconds(op)
        measured = self.profiler.seconds(op)
        return super().compute_seconds(op) if measured is None else measured
