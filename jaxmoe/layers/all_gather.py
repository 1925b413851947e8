"""All-gather dispatch (``moe.dispatcher all_gather``): Megatron-Core's allgather dispatcher.

The capacity slots are planned as in :mod:`jaxmoe.layers.padded`, so the same assignments
are kept and dropped. The MoE group (expert x expert-tensor axes) then all-gathers its
members' tokens, together with their routing decisions (places and combine weights, so
nothing is routed twice); each device fills the slots of its local experts from every
member's assignments, computes them (its hidden slice), weights each output by its
assignment's combine weight, and one ``psum_scatter`` over the MoE group sums every
token's partial outputs (over experts, choices and hidden slices) on the device that owns
the token. Over a group of one device both collectives are the identity. Bytes per device
and direction: ``tokens x (group - 1) x d``, whatever the capacity. Under sequence
parallelism with a capacity factor the tokens are the whole sequences' (gathered over the
sequence group first, each member sending a share of every slot's places:
:mod:`jaxmoe.layers.routing_groups`), so the gather carries ``sequence group`` times the
tokens a device holds, and the experts compute no more rows than under whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config.layout import EXPERT, EXPERT_TENSOR
from jaxmoe.layers.dispatch import DispatchPlan, combine, dispatch
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.padded import (
    PaddedDispatch,
    SlotPlan,
    grouped_tokens,
    own_positions,
    to_expert_major,
    to_group_major,
)
from jaxmoe.parallel.mesh import role_axes, role_size


class Gathered(NamedTuple):
    rows: jax.Array  # [local experts, members x groups x capacity, d]: the experts' input
    places: DispatchPlan  # every member's assignments, placed in this device's experts' slots
    weight: jax.Array  # [members x groups, positions, top_k]: their combine weights
    plan: SlotPlan  # this device's own assignments


def moe_group_axes() -> tuple[str, ...]:
    """The manual mesh axes of this device's MoE group (expert x expert tensor), in mesh
    order; ``()`` outside a shard_map or where the group is this device alone."""
    members = set(role_axes(EXPERT) + role_axes(EXPERT_TENSOR))
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(name for name in mesh.axis_names if name in members) if members else ()
    return axes if axes and jax.lax.axis_size(axes) > 1 else ()


def _gather(value: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Every member's ``value``: ``[G, ...] -> [members * G, ...]``."""
    if not axes:
        return value
    return jax.lax.all_gather(value, axes).reshape(-1, *value.shape[1:])


def _sum_to_owners(partial: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[members * G, ...]`` partial outputs -> this device's ``[G, ...]``, summed."""
    if not axes:
        return partial
    members = jax.lax.axis_size(axes)
    by_member = partial.reshape(members, -1, *partial.shape[1:])
    return jax.lax.psum_scatter(by_member, axes, scatter_dimension=0)


@dataclass(frozen=True)
class AllGatherDispatch(PaddedDispatch):
    """The padded dispatch's slots, reached by gathering the MoE group's tokens."""

    def send(self, x: jax.Array, plan: SlotPlan) -> Gathered:
        axes = moe_group_axes()
        capacity = plan.capacity
        local_experts = plan.num_slots // role_size(EXPERT)
        first_local = (
            jax.lax.axis_index(role_axes(EXPERT)) * local_experts if role_axes(EXPERT) else 0
        )
        grouped = grouped_tokens(x, plan)
        tokens, slot, weight = (
            _gather(value, axes) for value in (grouped, plan.places.slot, plan.weight)
        )
        # Member slots of the local experts, renumbered from 0; the rest point past the end.
        local_slot = slot - first_local * capacity
        mine = (local_slot >= 0) & (local_slot < local_experts * capacity)
        places = DispatchPlan(slot=jnp.where(mine, local_slot, local_experts * capacity), kept=mine)
        buffer = dispatch(tokens, places, local_experts * capacity)  # [M * G, L * C, d]
        return Gathered(to_expert_major(buffer, local_experts, capacity), places, weight, plan)

    def run_experts(self, experts: Experts, sent: Gathered) -> jax.Array:
        bias = experts.output_bias()
        if role_axes(EXPERT_TENSOR):  # the expert-tensor members share b_out: add it once
            bias = jnp.where(jax.lax.axis_index(role_axes(EXPERT_TENSOR)) == 0, bias, 0)
        return experts.partial_output(sent.rows) + bias

    def combine(self, outputs: jax.Array, sent: Gathered) -> jax.Array:
        outputs = to_group_major(outputs, sent.weight.shape[0], sent.plan.capacity)
        partial = combine(outputs, sent.places, sent.weight)  # [M * G, S, d]
        return own_positions(_sum_to_owners(partial, moe_group_axes()), sent.plan)
