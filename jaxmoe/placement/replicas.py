"""Expert placement: which expert each expert slot holds, as a runtime table.

Each device of an expert group has ``slots_per_device`` slots. The first
``experts_per_device`` are its home slots: they hold its own experts, whose
parameters and optimizer state live there and never move. The rest are replica
slots, described by the *replica table* ``[expert_axis, replica_slots]`` int32
(entry ``-1``: an empty slot). The table is an array input of the step, so a new
placement never recompiles.

A replica's weights are not state of their own: the step gathers them from
the home shards (``all_gather`` over the expert axis, then a take by the table).
Differentiating through that gather sums every replica's gradient into its
home expert (the transpose of ``all_gather`` is a reduce-scatter), so the
optimizer updates each expert once and the replicas are identical by
construction.

Replica slots assume the all_to_all dispatcher and whole experts on each device
(``parallel.expert_tensor=1``); the configuration refuses the other combinations.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config.layout import EXPERT
from jaxmoe.parallel.mesh import role_axes

EMPTY = -1


def static_placement(num_experts: int, expert_axis: int, slots_per_device: int) -> np.ndarray:
    """The replica table that spreads copies evenly over the experts: device ``d``'s replica
    slots hold the experts that follow its own, ``(d + 1) * experts_per_device + r`` mod
    ``num_experts``. Every expert gets the same number of copies when the experts per device
    divide the replica slots, and no device holds two copies of one expert while it can be
    avoided."""
    local = num_experts // expert_axis
    spare = slots_per_device - local
    device = np.arange(expert_axis)[:, None]
    slot = np.arange(spare)[None, :]
    return (((device + 1) * local + slot) % num_experts).astype(np.int32)


def slot_experts(replica_table: jax.Array, num_experts: int) -> jax.Array:
    """``[expert_axis * slots_per_device]``: the expert each global slot holds (-1: empty).

    Global slot ``d * slots_per_device + j`` is slot ``j`` of device ``d``; its home slots
    come first.
    """
    expert_axis = replica_table.shape[0]
    home = jnp.arange(num_experts, dtype=jnp.int32).reshape(expert_axis, -1)
    return jnp.concatenate([home, replica_table.astype(jnp.int32)], axis=1).reshape(-1)


def replicas_per_expert(replica_table: Any, num_experts: int) -> Any:
    """Copies of each expert (home included), ``[..., num_experts]``; numpy or jax."""
    xp = jnp if isinstance(replica_table, jax.Array) else np
    table = xp.asarray(replica_table)
    counts = (table[..., None] == xp.arange(num_experts)).sum(axis=(-3, -2))
    return counts + 1


def replica_weights(home: jax.Array, replica_table: jax.Array) -> jax.Array:
    """This device's replica weights ``[replica_slots, ...]`` from the home shards.

    ``home`` is ``[experts_per_device, ...]`` inside a manual expert axis (every expert
    outside one). Empty slots get zeros; no assignment is sent to them.
    """
    expert_axes = role_axes(EXPERT)
    if expert_axes and jax.lax.axis_size(expert_axes) > 1:
        every_expert = jax.lax.all_gather(home, expert_axes, axis=0, tiled=True)
        row = replica_table[jax.lax.axis_index(expert_axes)]
    else:
        every_expert, row = home, replica_table[0]
    taken = jnp.take(every_expert, jnp.maximum(row, 0), axis=0)
    filled = (row >= 0).reshape(-1, *([1] * (home.ndim - 1)))
    return jnp.where(filled, taken, jnp.zeros_like(taken))


def slot_weights(home: jax.Array, replica_table: jax.Array | None) -> jax.Array:
    """``[slots_per_device, ...]``: this device's home experts, then its replica slots."""
    if replica_table is None:
        return home
    return jnp.concatenate([home, replica_weights(home, replica_table)])
