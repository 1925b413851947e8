"""Measured op costs: each distinct op timed on the current backend, cached on disk.

An op is identified by its primitive, its parameters and the shapes and dtypes
of its operands. It is compiled alone (``jit`` of one equation), run
``warmup`` times, then timed ``repeats`` times to completion; the median is
its cost. Results are cached per backend in a JSON file, so a program is
profiled once per machine.

What cannot run alone keeps the analytic estimate: collectives and ops that
read a mesh axis (they need the whole mesh), and ops whose parameters cannot
be written down stably (a sub-program). Standalone timing includes one
dispatch and no fusion with neighbours, so on a fusing backend it is an upper
bound for small elementwise ops.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scheduling import jax_adapter
from scheduling.capture import Op
from scheduling.cost import CostModel, DeviceProfile
from scheduling.link_model import CollectiveCurves

# Parameters that name mesh axes: such ops only run inside the whole-mesh shard_map.
_AXIS_PARAMETERS = ("axis_name", "axes")


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
    if any(name in op.eqn.params for name in _AXIS_PARAMETERS):
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


class OpProfiler:
    """Times ops on this backend; ``cache_dir`` keeps results between runs."""

    def __init__(self, cache_dir: str | Path | None = None, *, warmup: int = 2, repeats: int = 5):
        self.backend = jax.default_backend()
        self.warmup = warmup
        self.repeats = repeats
        self.path = None if cache_dir is None else Path(cache_dir) / f"ops-{self.backend}.json"
        self.table: dict[str, float] = {}
        if self.path is not None and self.path.exists():
            self.table = json.loads(self.path.read_text())
        self.measured = 0  # ops timed by this profiler (not from the cache)

    def seconds(self, op: Op) -> float | None:
        """Median seconds of ``op`` alone, or None when it cannot be profiled alone."""
        key = op_key(op)
        if key is None:
            return None
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        if digest not in self.table:
            self.table[digest] = self._time(op)
            self.measured += 1
        return self.table[digest]

    def _time(self, op: Op) -> float:
        rng = np.random.default_rng(0)
        operands = [_example_operand(a.aval, rng) for a in op.inputs]
        run = jax.jit(lambda *args: jax_adapter.bind_equation(op.eqn, args))
        for _ in range(self.warmup):
            jax.block_until_ready(run(*operands))
        timings = []
        for _ in range(self.repeats):
            started = time.perf_counter()
            jax.block_until_ready(run(*operands))
            timings.append(time.perf_counter() - started)
        return statistics.median(timings)

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.table, indent=0, sort_keys=True) + "\n")


class ProfiledCostModel(CostModel):
    """Measured compute costs where an op runs alone; the analytic model elsewhere."""

    def __init__(
        self,
        profile: DeviceProfile,
        axis_sizes: dict[str, int],
        profiler: OpProfiler,
        curves: CollectiveCurves | None = None,
    ):
        super().__init__(profile, axis_sizes, curves)
        self.profiler = profiler

    def compute_seconds(self, op: Op) -> float:
        measured = self.profiler.seconds(op)
        return super().compute_seconds(op) if measured is None else measured
