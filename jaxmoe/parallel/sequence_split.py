"""Which positions of a row each device holds: two chunks of its context group, then a
slice of those for its tensor group.

The devices of a context group, and the tensor group of each of them, hold the same rows
(:func:`~jaxmoe.parallel.mesh.token_spec`); together they are the row's *sequence
group*, and each keeps its own share of the positions:

- **context parallelism** (``parallel.context`` C) cuts a row into ``2C`` equal chunks
  and gives device ``c`` of the context group chunks ``c`` and ``2C - 1 - c``, in that
  order (the zig-zag split of Megatron-Core and torchtitan). Under a causal mask the
  early chunk needs few keys and the late one many, so every device does the same
  attention work. Its positions increase, so a causal mask by index over its two chunks
  is causal by position.
- **sequence parallelism** (``parallel.tensor`` T) gives each device of the tensor group
  a contiguous slice of those ``seq_len / C`` positions; a tensor-parallel region
  gathers them back (:mod:`jaxmoe.parallel.tensor_parallel`).

Everything computed position by position (embeddings, norms, the FFNs and MoE layers,
the loss) runs on a device's share; attention sees its context share
(:mod:`jaxmoe.layers.context_attention`) and the routing groups that span the sequence
group gather it back in position order (:func:`gather_positions`; its transpose,
:func:`sum_own_positions`, sums the members' full-length values back into each one's
share). The group's devices are numbered context-major, as the mesh orders their axes.
With one device per group every function is the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config.layout import CONTEXT, TENSOR
from jaxmoe.parallel.mesh import role_axes, role_size

SEQUENCE_AXIS = 1  # of [rows, seq, ...] activations


def context_size() -> int:
    """Devices in this device's context group (1 outside a manual region)."""
    return role_size(CONTEXT)


def context_index() -> jax.Array | int:
    """This device's place in its context group."""
    return jax.lax.axis_index(role_axes(CONTEXT)) if context_size() > 1 else 0


def sequence_group_axes() -> tuple[str, ...]:
    """The mesh axes of the sequence group, context-major (the order of its numbering)."""
    return role_axes(CONTEXT) + role_axes(TENSOR)


def sequence_group_size() -> int:
    """Devices holding the same rows, each its share of the positions."""
    return context_size() * role_size(TENSOR)


def sequence_group_index() -> jax.Array | int:
    """This device's place in its sequence group."""
    return jax.lax.axis_index(sequence_group_axes()) if sequence_group_size() > 1 else 0


def zigzag_order(length: int, parts: int) -> np.ndarray:
    """The positions of a row of ``length`` as the ``parts`` devices of a context group hold
    them, device after device: chunks ``c`` and ``2 parts - 1 - c`` of device ``c``."""
    chunks = np.arange(length).reshape(2 * parts, length // (2 * parts))
    return np.concatenate([np.concatenate([chunks[c], chunks[-1 - c]]) for c in range(parts)])


def context_chunks(x: jax.Array, index, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """Device ``index``'s two chunks (of its context group's ``2C``) of the full-length
    ``x`` along ``axis``, concatenated; ``x`` itself with one device."""
    parts = context_size()
    if parts == 1:
        return x
    length = x.shape[axis]
    if length % (2 * parts):
        raise ValueError(f"a sequence of {length} does not split into {2 * parts} chunks")
    chunk = length // (2 * parts)
    take = lambda c: jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis)
    return jnp.concatenate([take(index), take(2 * parts - 1 - index)], axis=axis)


def context_slice(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """This device's two chunks of the full-length ``x`` along ``axis``: the positions its
    attention covers."""
    return context_chunks(x, context_index(), axis)


def sequence_slice(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """This device's share of the full-length ``x`` along ``axis``: its context chunks, then
    its tensor slice of them."""
    x = context_slice(x, axis)
    tensor = role_size(TENSOR)
    if tensor == 1:
        return x
    length = x.shape[axis]
    if length % tensor:
        raise ValueError(f"a sequence of {length} does not split over {tensor} tensor devices")
    local = length // tensor
    index = jax.lax.axis_index(role_axes(TENSOR))
    return jax.lax.dynamic_slice_in_dim(x, index * local, local, axis)


def gather_positions(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """The inverse of :func:`sequence_slice` over the group: every device's share, the whole
    row in position order, on every device of the sequence group."""
    if sequence_group_size() == 1:
        return x
    gathered = jax.lax.all_gather(x, sequence_group_axes(), axis=axis, tiled=True)
    if context_size() == 1:
        return gathered
    order = zigzag_order(gathered.shape[axis], context_size())
    return jnp.take(gathered, jnp.asarray(np.argsort(order)), axis=axis)


def sum_own_positions(x: jax.Array, axis: int = SEQUENCE_AXIS) -> jax.Array:
    """The transpose of :func:`gather_positions`: every device's full-length ``x`` (in
    position order) summed over the sequence group, this device's share of the sum (one
    ``psum_scatter``)."""
    if sequence_group_size() == 1:
        return x
    if context_size() > 1:  # back to the order the devices' shares were gathered in
        x = jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], context_size())), axis=axis)
    return jax.lax.psum_scatter(x, sequence_group_axes(), scatter_dimension=axis, tiled=True)
