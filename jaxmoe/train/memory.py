"""Bytes per device of the training state and of what the step adds to it, from the
state's shapes and specs (nothing is traced or allocated): with and without ZeRO
(``train.zero``, :mod:`jaxmoe.parallel.zero`).

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
from jaxmoe.parallel.mesh import mesh_axis_sizes
from jaxmoe.train.state import (
    abstract_train_state,
    model_graphdef_and_specs,
    state_specs,
    zero_plan,
)


@dataclass(frozen=True)
class StateMemory:
    """Bytes per device (see the module docstring)."""

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


def memory_per_device(config: Config) -> StateMemory:
    """The bytes per device of ``config``'s training state and step (module docstring)."""
    axes = mesh_axis_sizes(config.parallel)
    shapes = abstract_train_state(config)
    specs = state_specs(config)
    per_field = {
        name: _local_bytes(getattr(shapes, name), getattr(specs, name), axes)
        for name in shapes._fields
        if getattr(shapes, name) is not None
    }
    parameters = per_field.pop("params")
    _, model_specs = model_graphdef_and_specs(config)
    whole = _local_bytes(shapes.params, model_specs, axes)
    plan = zero_plan(config)
    if plan is None:
        return StateMemory(parameters, sum(per_field.values()), whole, 0)
    gathered_units = {
        unit: _local_bytes(
            plan.unit(shapes.params, index),
            plan.unit(model_specs, index),
            axes,
            plan.unit(plan.gather_dtypes, index),
        )
        for unit, index in _units(shapes.params)
    }
    if plan.stage == 1:
        return StateMemory(parameters, sum(per_field.values()), whole, sum(gathered_units.values()))
    blocks = [size for unit, size in gathered_units.items() if unit != "outside"]
    whole_blocks = [
        _local_bytes(plan.unit(shapes.params, index), plan.unit(model_specs, index), axes)
        for unit, index in _units(shapes.params)
        if index is not None
    ]
    return StateMemory(
        parameters,
        sum(per_field.values()),
        parameters + max(whole_blocks, default=0),
        gathered_units["outside"] + max(blocks, default=0),
    )


def _units(params: Any) -> list[tuple[str, int | None]]:
    """The gather units: the parameters outside the blocks, then each block."""
    return [("outside", None)] + [(f"layer_{i}", i) for i in params.get("blocks", {})]
