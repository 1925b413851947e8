"""The device mesh: built from the folded layout, and the mesh axes of each role.

The mesh's axes are the common refinement of the attention layout (data x
tensor) and the MoE layout (expert data x expert x expert tensor), as
:mod:`jaxmoe.config.layout` derives them. Without tensor or expert-tensor
parallelism it is ``(data, expert)``: ``data`` replicates the model and
``expert`` shards the experts. Under a pipeline the ``pipeline`` axis comes first
(each of its indices a stage), the axes of one stage's devices after it. Layers find
the axes of their groups with :func:`role_axes` at trace time, so the same code runs
on every layout and, with no mesh, on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from jaxmoe.config import ConfigError, ParallelConfig
from jaxmoe.config.layout import ATTENTION_DATA, axes_for_role, mesh_axes

DATA_AXIS = "data"
EXPERT_AXIS = "expert"


def mesh_axis_sizes(parallel: ParallelConfig) -> dict[str, int]:
    """Mesh axis name -> size, in mesh order (outermost first)."""
    axes = mesh_axes(
        parallel.data,
        parallel.tensor,
        parallel.expert,
        parallel.expert_tensor,
        parallel.pipeline,
        parallel.context,
    )
    return {axis.name: axis.size for axis in axes}


def mesh_axis_names(parallel: ParallelConfig) -> tuple[str, ...]:
    return tuple(mesh_axis_sizes(parallel))


def token_spec(mesh: Mesh) -> PartitionSpec:
    """Spec of a ``[batch, ...]`` array of token rows on ``mesh``: batch split over the data
    axes, replicated over the context and tensor axes (each device takes its share of the
    positions: :mod:`jaxmoe.parallel.sequence_split`)."""
    return PartitionSpec(axes_for_role(ATTENTION_DATA, tuple(mesh.axis_names)))


def role_axes(role: str) -> tuple[str, ...]:
    """The manual mesh axes forming this device's group of ``role`` (see
    :mod:`jaxmoe.config.layout`), at trace time; ``()`` outside a shard_map (one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = mesh.manual_axes
    return tuple(name for name in axes_for_role(role, mesh.axis_names) if name in manual)


def role_size(role: str) -> int:
    """Devices in this device's group of ``role`` (1 outside a shard_map)."""
    axes = role_axes(role)
    return jax.lax.axis_size(axes) if axes else 1


def build_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The folded mesh over ``devices`` (default: every device of every process).

    Devices are numbered in the given order; the innermost axes group neighbours,
    so on a multi-host cluster the tensor and expert groups stay inside a host
    where they fit in one.
    """
    devices = list(jax.devices() if devices is None else devices)
    if parallel.num_devices != len(devices):
        stages = "parallel.pipeline x " if parallel.pipeline > 1 else ""
        sizes = f"{parallel.pipeline} x " if parallel.pipeline > 1 else ""
        raise ConfigError(
            f"{stages}parallel.data x parallel.expert x parallel.expert_tensor = {sizes}"
            f"{parallel.data} x {parallel.expert} x {parallel.expert_tensor} = "
            f"{parallel.num_devices}, but there are {len(devices)} devices: choose axis sizes "
            f"whose product is {len(devices)}"
        )
    sizes = mesh_axis_sizes(parallel)
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes), axis_types=(jax.sharding.AxisType.Explicit,) * len(sizes))


def abstract_mesh(parallel: ParallelConfig) -> AbstractMesh:
    """The folded mesh's axes and sizes without devices: enough to trace a step (and so
    to capture and cost it) for a device count that this host does not have."""
    sizes = mesh_axis_sizes(parallel)
    return AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Explicit,) * len(sizes)
    )
