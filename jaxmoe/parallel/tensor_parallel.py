"""The collectives of Megatron tensor parallelism with sequence parallelism.

Outside the tensor-parallel regions (attention, the dense FFN) every device of
a tensor group holds its own contiguous slice of the sequence,
``[rows, seq_len / tensor, d]``. A region is entered with
:func:`gather_sequence` (``all_gather`` along the sequence, so the
column-parallel projection sees every position) and left with
:func:`scatter_sequence` (``psum_scatter``: the row-parallel projection's
partial sums are added up and each device keeps its own slice).

The group is the mesh axes of the ``tensor`` role (:mod:`jaxmoe.config.layout`),
linearised in mesh order; the slice index, the gather and the scatter all use
that one tuple, so they agree on which device owns which slice. With a group
of one device (no tensor parallelism, or outside a shard_map) every function
is the identity: no collective is emitted and the program is unchanged.
"""

from __future__ import annotations

import jax

from jaxmoe.config.layout import TENSOR
from jaxmoe.parallel.mesh import role_axes, role_size

SEQUENCE_AXIS = 1  # of [rows, seq, ...] activations


def tensor_group_size() -> int:
    """Devices in this device's tensor group (1 outside a manual region)."""
    return role_size(TENSOR)


def sequence_shard_index() -> jax.Array | int:
    """This device's position in its tensor group: the index of its sequence slice."""
    if tensor_group_size() == 1:
        return 0
    return jax.lax.axis_index(role_axes(TENSOR))


def sequence_slice(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """This device's contiguous slice of a full-sequence array along ``axis``."""
    group = tensor_group_size()
    if group == 1:
        return x
    length = x.shape[axis]
    if length % group:
        raise ValueError(f"a sequence of {length} does not split over {group} tensor devices")
    local = length // group
    return jax.lax.dynamic_slice_in_dim(x, sequence_shard_index() * local, local, axis)


def gather_sequence(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """Enter a tensor-parallel region: ``[.., seq / tensor, ..]`` slices -> the full
    sequence on every device of the group (its transpose is :func:`scatter_sequence`)."""
    if tensor_group_size() == 1:
        return x
    return jax.lax.all_gather(x, role_axes(TENSOR), axis=axis, tiled=True)


def scatter_sequence(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """Leave a tensor-parallel region: sum the group's partial results over the full
    sequence and keep this device's slice (its transpose is :func:`gather_sequence`)."""
    if tensor_group_size() == 1:
        return x
    return jax.lax.psum_scatter(x, role_axes(TENSOR), scatter_dimension=axis, tiled=True)
