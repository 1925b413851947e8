"""The device mesh: axis names, their roles, and how it is built from the layout.

Two axes. ``data`` replicates the model; ``expert`` shards the experts. Tokens
(the batch dimension) are sharded over both, so every device holds distinct
tokens and the expert all-to-all runs within each ``expert`` group.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxmoe.config import ConfigError, ParallelConfig

DATA_AXIS = "data"
EXPERT_AXIS = "expert"
MESH_AXES = (DATA_AXIS, EXPERT_AXIS)
# The batch dimension is split over every axis: each device sees its own tokens.
TOKEN_AXES = (DATA_AXIS, EXPERT_AXIS)


def token_spec() -> PartitionSpec:
    """Spec of a [batch, ...] array of tokens: batch sharded over all mesh axes."""
    return PartitionSpec(TOKEN_AXES)


def mesh_axis_sizes(parallel: ParallelConfig) -> dict[str, int]:
    """Mesh axis name -> size, in mesh order."""
    return {DATA_AXIS: parallel.data, EXPERT_AXIS: parallel.expert}


def build_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, expert) mesh over ``devices`` (default: every device of every process).

    Neighbouring devices share an expert group, so on a multi-host cluster the
    all-to-all stays inside a host where the expert axis fits in one.
    """
    devices = list(jax.devices() if devices is None else devices)
    if parallel.num_devices != len(devices):
        raise ConfigError(
            f"parallel.data x parallel.expert = {parallel.data} x {parallel.expert} = "
            f"{parallel.num_devices}, but there are {len(devices)} devices: choose axis sizes "
            f"whose product is {len(devices)}"
        )
    grid = np.asarray(devices, dtype=object).reshape(parallel.data, parallel.expert)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Explicit,) * len(MESH_AXES))
