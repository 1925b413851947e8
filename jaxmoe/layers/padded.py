"""Padded dispatch: ``capacity`` slots per expert and routing group, exchanged by ``all_to_all``.

Each routing group's assignments get places in per-expert slots by the dropping rule of
:mod:`jaxmoe.layers.dispatch`, ``capacity`` each (dropless: ``group_size``, so nothing
drops). Then, as Megatron-Core's alltoall dispatcher: permute into the slots;
``all_to_all`` over the expert group; with expert-tensor parallelism, ``all_gather`` the
received slots over the expert-tensor group (its members must see the same tokens), each
member computes its slice of the hidden dimension, and a tiled ``psum_scatter`` returns to
each member the summed outputs of its own slots (``b_out`` added once, after the sum);
``all_to_all`` back; combine by weight. Bytes per device and direction: about ``tokens x
top_k x capacity_factor x d`` for the exchange (dropless: ``tokens x num_experts x d``),
times ``expert_tensor`` for the gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax

from jaxmoe.config import capacity_per_expert
from jaxmoe.config.layout import EXPERT_TENSOR
from jaxmoe.layers.dispatch import DispatchPlan, DispatchStats, combine, dispatch, plan_dispatch
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.router import RouterOutput
from jaxmoe.layers.routing_groups import RoutingGroups
from jaxmoe.parallel.collectives import dispatch_to_experts, return_from_experts
from jaxmoe.parallel.mesh import role_axes, role_size
from jaxmoe.parallel.sequence_split import gather_positions, sum_own_positions


class SlotPlan(NamedTuple):
    """Where this device's assignments go: places in its buffer of slots, or not sent."""

    places: DispatchPlan  # [groups, positions, top_k]: place in the buffer, or not sent
    weight: jax.Array  # [groups, positions, top_k]: the combine weights
    num_slots: int  # expert slots of the expert group: the experts, or with replicas more
    capacity: int  # places per slot in this device's buffer
    group_capacity: int  # places per slot of a whole routing group
    dropped: jax.Array  # the plan's drops among this device's own positions
    # The rows gathered over the sequence group when the positions are the whole groups'
    # (this device sends its share of every slot: jaxmoe.layers.routing_groups); else None.
    gathered_rows: int | None = None
    replica_table: jax.Array | None = None


class Sent(NamedTuple):
    rows: jax.Array  # [local slots, sources x groups x capacity, d]: the experts' input
    plan: SlotPlan


def plan_slots(
    route: RouterOutput,
    groups: RoutingGroups,
    capacity_factor: float | None,
    num_slots: int,
    plan_groups: Callable[[jax.Array, int], DispatchPlan],
    replica_table: jax.Array | None = None,
) -> SlotPlan:
    """The places of this device's assignments, ``plan_groups(choices, capacity)``
    placing whole groups in ``num_slots`` slots of ``capacity`` places."""
    top_k = route.expert_index.shape[-1]
    capacity = capacity_per_expert(groups.size, top_k, capacity_factor, num_slots)
    group_plan = plan_groups(groups.choices, capacity)
    own = groups.device_plan(group_plan, num_slots, capacity)
    weight = route.combine_weight
    if own.whole_groups:
        weight = gather_positions(weight)
    weight = weight.reshape(groups.count, -1, top_k)
    gathered_rows = groups.rows if own.whole_groups else None
    return SlotPlan(
        own.places, weight, num_slots, own.capacity, capacity, own.dropped, gathered_rows,
        replica_table,
    )  # fmt: skip


def grouped_tokens(x: jax.Array, plan: SlotPlan) -> jax.Array:
    """The tokens the plan's places index, ``[groups, positions, d]``: this device's own,
    or the whole groups' gathered over the sequence group."""
    if plan.gathered_rows is not None:
        x = gather_positions(x)
    return x.reshape(*plan.weight.shape[:2], x.shape[-1])


def own_positions(combined: jax.Array, plan: SlotPlan) -> jax.Array:
    """Combined outputs ``[groups, positions, d]`` -> this device's positions: where the
    plan's positions are the whole groups', each member combined the assignments it sent,
    and the sequence group sums them into each member's share."""
    if plan.gathered_rows is None:
        return combined
    return sum_own_positions(combined.reshape(plan.gathered_rows, -1, combined.shape[-1]))


def to_expert_major(slots: jax.Array, num_slots: int, capacity: int) -> jax.Array:
    """``[G, num_slots * C, d] -> [num_slots, G * C, d]``."""
    groups, _, width = slots.shape
    slots = slots.reshape(groups, num_slots, capacity, width).transpose(1, 0, 2, 3)
    return slots.reshape(num_slots, groups * capacity, width)


def to_group_major(slots: jax.Array, groups: int, capacity: int) -> jax.Array:
    """Inverse of :func:`to_expert_major`."""
    num_slots, _, width = slots.shape
    slots = slots.reshape(num_slots, groups, capacity, width).transpose(1, 0, 2, 3)
    return slots.reshape(groups, num_slots * capacity, width)


def apply_experts(
    experts: Experts, received: jax.Array, replica_table: jax.Array | None = None
) -> jax.Array:
    """The local experts on ``[local_slots, tokens, d]``, the hidden dimension split over the
    expert-tensor group: gather every member's tokens, compute this device's hidden slice,
    reduce-scatter the partial outputs back to their members, add ``b_out`` once."""
    if role_size(EXPERT_TENSOR) == 1:
        return experts(received, replica_table)
    axes = role_axes(EXPERT_TENSOR)
    gathered = jax.lax.all_gather(received, axes, axis=1, tiled=True)
    partial = experts.partial_output(gathered, replica_table)
    summed = jax.lax.psum_scatter(partial, axes, scatter_dimension=1, tiled=True)
    return summed + experts.output_bias(replica_table)


@dataclass(frozen=True)
class PaddedDispatch:
    """Capacity slots of the experts, exchanged by ``all_to_all`` (the module docstring)."""

    num_experts: int
    capacity_factor: float | None  # None: dropless, ``group_size`` places per expert

    def plan(
        self, route: RouterOutput, groups: RoutingGroups, replica_table: jax.Array | None
    ) -> SlotPlan:
        del replica_table  # one slot per expert
        return plan_slots(
            route,
            groups,
            self.capacity_factor,
            self.num_experts,
            lambda choices, capacity: plan_dispatch(choices, self.num_experts, capacity),
        )

    def send(self, x: jax.Array, plan: SlotPlan) -> Sent:
        buffer = dispatch(grouped_tokens(x, plan), plan.places, plan.num_slots * plan.capacity)
        expert_major = to_expert_major(buffer, plan.num_slots, plan.capacity)
        return Sent(dispatch_to_experts(expert_major), plan)

    def run_experts(self, experts: Experts, sent: Sent) -> jax.Array:
        return apply_experts(experts, sent.rows, sent.plan.replica_table)

    def combine(self, outputs: jax.Array, sent: Sent) -> jax.Array:
        plan = sent.plan
        returned = return_from_experts(outputs)
        grouped = to_group_major(returned, plan.weight.shape[0], plan.capacity)
        return own_positions(combine(grouped, plan.places, plan.weight), plan)

    def stats(self, groups: RoutingGroups, sent: Sent) -> DispatchStats:
        del groups
        return DispatchStats(dropped=sent.plan.dropped)
