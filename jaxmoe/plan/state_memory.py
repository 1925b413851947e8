"""Bytes per device of the training state, from its shapes and specs (the step's peak:
:mod:`jaxmoe.plan.memory`).

**The state** (:func:`memory_per_device`): nothing is traced or allocated; with and
without ZeRO (``train.zero``, :mod:`jaxmoe.parallel.zero`). Exact: XLA's argument sizes
agree to the byte.

- ``parameters``: the state's parameters on one device: whole local blocks, or under ZeRO
  the float32 shards (the master copy).
- ``optimizer``: the AdamW moments and counts, the gradient-sync state, the placement
  table, the step counter and the model state, on one device.
- ``gradients``: the gradients alive at once: one per element of the local blocks
  (accumulated whole until the sync; so under ZeRO-1 too, which reduce-scatters them
  after the backward pass), or under ZeRO-3 the shards plus the largest block's whole
  gradients (each block's are reduce-scattered as its backward pass ends).
- ``gathered``: the parameters the step computes with, gathered in their gather dtypes:
  none without ZeRO (the model reads the state's); under ZeRO-1 every parameter, from the
  start of the step to its backward pass; under ZeRO-3 those outside the blocks plus one
  block's (each block's are released after its forward and its backward pass; a
  schedule that prefetches a block's gather adds one more block per block of lead).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxmoe.config import Config
from jaxmoe.parallel.grad_sync.base import local_shape
from jaxmoe.parallel.zero import OUTSIDE_BLOCKS
from jaxmoe.train.resolved import Run, resolve


@dataclass(frozen=True)
class StateMemory:
    """Bytes per device of the state and of what the step adds to it (module docstring)."""

    parameters: int
    optimizer: int
    gradients: int
    gathered: int

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.gradients + self.gathered

    def to_json(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def _local_bytes(shapes: Any, specs: Any, axes: dict[str, int], dtypes: Any = None) -> int:
    """Bytes of one device's blocks of ``shapes`` laid out by ``specs`` (in ``dtypes``, a
    tree of dtype names like ``shapes``, where given)."""
    shape_leaves, treedef = jax.tree.flatten(shapes)
    spec_leaves = treedef.flatten_up_to(specs)
    dtype_leaves = (
        [leaf.dtype for leaf in shape_leaves] if dtypes is None else treedef.flatten_up_to(dtypes)
    )
    total = 0
    for shape, spec, dtype in zip(shape_leaves, spec_leaves, dtype_leaves, strict=True):
        local = local_shape(tuple(shape.shape), spec, axes)
        total += math.prod(local) * jnp.dtype(dtype).itemsize
    return total


def memory_per_device(run: Config | Run) -> StateMemory:
    """The bytes per device of a run's training state and step (module docstring); a
    configuration is resolved first."""
    if isinstance(run, Config):
        run = resolve(run)
    axes = run.axis_sizes
    shapes, specs = run.state_shapes, run.specs
    per_field = {
        name: _local_bytes(getattr(shapes, name), getattr(specs, name), axes)
        for name in shapes._fields
        if getattr(shapes, name) is not None
    }
    parameters = per_field.pop("params")
    plan = run.zero
    if plan is None:  # the state's parameters are the local blocks (a pipeline's included)
        return StateMemory(parameters, sum(per_field.values()), parameters, 0)
    model_specs = plan.model_specs  # in the state's structure (stacked under a pipeline)
    whole = _local_bytes(shapes.params, model_specs, axes)
    gathered_units = {
        unit: _local_bytes(
            plan.unit(shapes.params, index),
            plan.unit(model_specs, index),
            axes,
            plan.unit(plan.gather_dtypes, index),
        )
        for unit, index in plan.units(shapes.params)
    }
    if plan.stage == 1:
        return StateMemory(parameters, sum(per_field.values()), whole, sum(gathered_units.values()))
    blocks = [size for unit, size in gathered_units.items() if unit != OUTSIDE_BLOCKS]
    whole_blocks = [
        _local_bytes(plan.unit(shapes.params, index), plan.unit(model_specs, index), axes)
        for _, index in plan.units(shapes.params)
        if index is not None
    ]
    return StateMemory(
        parameters,
        sum(per_field.values()),
        parameters + max(whole_blocks, default=0),
        gathered_units[OUTSIDE_BLOCKS] + max(blocks, default=0),
    )
