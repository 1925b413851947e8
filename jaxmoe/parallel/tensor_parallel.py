"""The collectives of Megatron tensor parallelism with sequence parallelism.

Outside the tensor-parallel regions (attention, the dense FFN) every device of a tensor
group holds its own contiguous slice of the sequence (of its context group's share of it:
:mod:`jaxmoe.parallel.sequence_split`), ``[rows, seq_len / tensor, d]``. A region is
entered with :func:`gather_sequence` (``all_gather`` along the sequence, so the
column-parallel projection sees every position) and left with :func:`scatter_sequence`
(``psum_scatter``: the row-parallel projection's partial sums are added up and each
device keeps its own slice).

The group is the mesh axes of the ``tensor`` role (:mod:`jaxmoe.config.layout`),
linearised in mesh order; the slice
(:func:`~jaxmoe.parallel.sequence_split.sequence_slice`), the gather and the scatter all
use that one tuple, so they agree on which device owns which slice. With a group of one
device (no tensor parallelism, or outside a shard_map) every function is the identity:
no collective is emitted and the program is unchanged.
"""

from __future__ import annotations

import jax

from jaxmoe.config.layout import TENSOR
from jaxmoe.parallel.mesh import role_axes, role_size
from jaxmoe.parallel.sequence_split import SEQUENCE_AXIS


def tensor_group_size() -> int:
    """Devices in this device's tensor group (1 outside a manual region)."""
    return role_size(TENSOR)


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
