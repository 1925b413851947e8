"""The expert-parallel exchange, and whether code runs inside a manual region.

Layers call these helpers instead of ``jax.lax`` directly, so that the same
code runs per device inside the whole-step ``shard_map`` (collectives are
explicit equations there) and on one device without a mesh (no collective).
"""

from __future__ import annotations

import jax

from jaxmoe.config.layout import EXPERT
from jaxmoe.parallel.mesh import role_axes, role_size


def manual_axes() -> frozenset[str]:
    """Mesh axes that are manual (bound by an enclosing shard_map) at trace time."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def expert_axis_size() -> int:
    """Devices in this device's expert group (1 outside a manual region)."""
    return role_size(EXPERT)


def dispatch_to_experts(buffer: jax.Array) -> jax.Array:
    """[num_experts, slots, d] per source device -> [local_experts, group * slots, d].

    Row block ``i`` of the expert dimension goes to device ``i`` of the expert
    group (numbered over the mesh axes of the expert role, :mod:`jaxmoe.config.layout`);
    each device receives the slots of its own experts from every device of the
    group, ordered by source device.
    """
    group = expert_axis_size()
    num_experts, slots, width = buffer.shape
    local_experts = num_experts // group
    if group == 1:
        return buffer
    parts = buffer.reshape(group, local_experts, slots, width)
    received = jax.lax.all_to_all(parts, role_axes(EXPERT), split_axis=0, concat_axis=0)
    return received.transpose(1, 0, 2, 3).reshape(local_experts, group * slots, width)


def return_from_experts(buffer: jax.Array) -> jax.Array:
    """Inverse of :func:`dispatch_to_experts`: ``[local_experts, group * slots, d]`` back to
    ``[num_experts, slots, d]`` on the source device."""
    group = expert_axis_size()
    if group == 1:
        return buffer
    local_experts, total_slots, width = buffer.shape
    slots = total_slots // group
    parts = buffer.reshape(local_experts, group, slots, width).transpose(1, 0, 2, 3)
    returned = jax.lax.all_to_all(parts, role_axes(EXPERT), split_axis=0, concat_axis=0)
    return returned.reshape(group * local_experts, slots, width)
