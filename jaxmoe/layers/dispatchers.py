"""Token dispatchers: how routed tokens reach their experts and come back.

Both dispatchers start from the same routing (each device routes its own
tokens in routing groups and assigns capacity slots by the rule of
:mod:`jaxmoe.layers.dispatch`), so they keep and drop exactly the same
assignments, and both return each token's combined output to the device that
owns it. ``moe.dispatcher`` picks one, as Megatron-Core's
``--moe-token-dispatcher-type`` does:

**all_to_all** (the default). Megatron-Core's alltoall dispatcher, in its
order of operations: permute into per-expert slots; ``all_to_all`` over the
expert group; with expert-tensor parallelism, ``all_gather`` the received
slots over the expert-tensor group (its members must see the same tokens),
each member computes its slice of the hidden dimension, and a tiled
``psum_scatter`` over the expert-tensor group returns to each member the
summed outputs of its own slots (``b_out`` is added once, after the sum);
``all_to_all`` back; combine by weight. Bytes per device and direction:
about ``tokens x top_k x capacity_factor x d`` for the exchange (in dropless
mode ``tokens x num_experts x d``: the static buffer has ``group_size`` slots
per expert), times ``expert_tensor`` for the gather.

**all_gather**. Megatron-Core's allgather dispatcher: the MoE group (expert x
expert-tensor axes) all-gathers its members' tokens, together with their
routing decisions (slots and combine weights, so nothing is routed twice);
each device fills the capacity slots of its local experts from every
member's assignments, computes them (its hidden slice), weights each output
by its assignment's combine weight, and one ``psum_scatter`` over the MoE
group sums every token's partial outputs (over experts, choices and hidden
slices) on the device that owns the token. Bytes per device and direction:
``tokens x (group - 1) x d``, whatever the capacity. It moves fewer bytes than
all_to_all when the MoE group is small against ``top_k x capacity_factor x
expert_tensor`` (e.g. a group of 2 with top-2 routing), and always in dropless
mode with many experts; all_to_all wins for large expert groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config.layout import EXPERT, EXPERT_TENSOR
from jaxmoe.layers.dispatch import DispatchPlan, combine, dispatch
from jaxmoe.layers.experts import Experts
from jaxmoe.parallel.collectives import dispatch_to_experts, return_from_experts
from jaxmoe.parallel.mesh import role_axes, role_size


def _to_expert_major(slots: jax.Array, num_slots: int, capacity: int) -> jax.Array:
    """``[G, num_slots * C, d] -> [num_slots, G * C, d]``."""
    groups, _, width = slots.shape
    slots = slots.reshape(groups, num_slots, capacity, width).transpose(1, 0, 2, 3)
    return slots.reshape(num_slots, groups * capacity, width)


def _to_group_major(slots: jax.Array, groups: int, capacity: int) -> jax.Array:
    """Inverse of :func:`_to_expert_major`."""
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


def all_to_all_dispatch(
    experts: Experts,
    grouped: jax.Array,
    plan: DispatchPlan,
    combine_weight: jax.Array,
    num_slots: int,
    capacity: int,
    replica_table: jax.Array | None = None,
) -> jax.Array:
    """``[G, S, d]`` tokens routed by ``plan`` -> their combined outputs ``[G, S, d]``.

    The buffer has ``capacity`` slots for each of ``num_slots`` expert slots: the experts,
    or with a replica table every slot of the expert group
    (:mod:`jaxmoe.placement.replicas`)."""
    groups = grouped.shape[0]
    slots = dispatch(grouped, plan, num_slots * capacity)  # [G, slots * C, d]
    received = dispatch_to_experts(_to_expert_major(slots, num_slots, capacity))
    outputs = return_from_experts(apply_experts(experts, received, replica_table))
    return combine(_to_group_major(outputs, groups, capacity), plan, combine_weight)


def moe_group_axes() -> tuple[str, ...]:
    """The manual mesh axes of this device's MoE group (expert x expert tensor), in mesh
    order; ``()`` outside a shard_map."""
    members = set(role_axes(EXPERT) + role_axes(EXPERT_TENSOR))
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(name for name in mesh.axis_names if name in members) if members else ()


def all_gather_dispatch(
    experts: Experts,
    grouped: jax.Array,
    plan: DispatchPlan,
    combine_weight: jax.Array,
    num_experts: int,
    capacity: int,
) -> jax.Array:
    """Same contract as :func:`all_to_all_dispatch` (no replica table), by gathering every
    token of the MoE group and reduce-scattering the weighted outputs."""
    axes = moe_group_axes()
    if not axes or jax.lax.axis_size(axes) == 1:  # every expert is local
        return all_to_all_dispatch(experts, grouped, plan, combine_weight, num_experts, capacity)
    local_experts = experts.w_in.shape[0]
    first_local = jax.lax.axis_index(role_axes(EXPERT)) * local_experts if role_axes(EXPERT) else 0
    # Every member's tokens and routing decisions: [M, G, S, ...] -> [M * G, S, ...].
    tokens, slot, weight = (
        jax.lax.all_gather(value, axes).reshape(-1, *value.shape[1:])
        for value in (grouped, plan.slot, combine_weight)
    )
    # Member slots of the local experts, renumbered from 0; the rest point past the end.
    local_slot = slot - first_local * capacity
    mine = (local_slot >= 0) & (local_slot < local_experts * capacity)
    local_plan = DispatchPlan(slot=jnp.where(mine, local_slot, local_experts * capacity), kept=mine)
    slots = dispatch(tokens, local_plan, local_experts * capacity)  # [M * G, L * C, d]
    outputs = experts.partial_output(_to_expert_major(slots, local_experts, capacity))
    bias = experts.output_bias()
    if role_axes(EXPERT_TENSOR):  # the expert-tensor members share b_out: add it once
        bias = jnp.where(jax.lax.axis_index(role_axes(EXPERT_TENSOR)) == 0, bias, 0)
    outputs = _to_group_major(outputs + bias, tokens.shape[0], capacity)
    partial = combine(outputs, local_plan, weight)  # [M * G, S, d]
    partial = partial.reshape(-1, *grouped.shape)  # [M, G, S, d]
    return jax.lax.psum_scatter(partial, axes, scatter_dimension=0)
