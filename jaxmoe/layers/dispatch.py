"""Assigning routed tokens to expert slots, and gathering the results back.

Each routing group has ``capacity`` slots per expert, a buffer of
``[num_experts * capacity, d]``. Every (token, choice) assignment gets a slot
index into it, or is dropped.

The dropping rule (capacity mode). Assignments are ranked by choice first,
then by token position: all first choices of the group in token order, then
all second choices, and so on. Each expert takes assignments in that order
until its ``capacity`` slots are full; the rest are dropped. So a first choice
is never dropped to make room for a second choice, and an earlier token is
never dropped to make room for a later one. A token whose every choice is
dropped passes through the layer unchanged (the residual connection).

Dropless mode uses ``capacity = group_size``: an expert can receive each
token at most once, so nothing is ever dropped and shapes stay static (this
is what runs on CPU, where ``ragged_all_to_all`` does not). The price is
memory and bytes: the dispatch buffer, each all-to-all and the expert GEMMs
cover ``num_experts * group_size`` slots per group, ``num_experts / top_k``
times the ``group_size * top_k`` assignments that carry tokens. The ragged dropless
dispatch (``moe.dropless_dispatch ragged``, :mod:`jaxmoe.layers.ragged`) moves and
computes only the routed rows instead; with replicas it splits an expert's
assignments over its copies from each step's counts (:mod:`jaxmoe.placement.copy_split`),
or deals them round-robin by :func:`replica_slots` (the research baseline:
``ExperimentalOptions(replica_split="round_robin")``, :mod:`jaxmoe.experimental`).

With replicas (:func:`plan_replicated_dispatch`) the buffer has ``capacity``
slots per *expert slot*, and an expert with ``n`` copies takes its assignments,
in the same priority order, round-robin over its copies: assignment ``r`` goes
to copy ``r mod n`` at position ``r // n``. So an expert keeps its first
``n * capacity`` assignments, its copies fill evenly, and with one copy each the
rule is the one above.

Under sequence parallelism (:mod:`jaxmoe.layers.routing_groups`) every device of a
tensor group plans its groups (whole sequences) alike from the group's gathered choices,
and sends either the assignments it keeps of its own tokens, packed into a buffer of its
own (:func:`local_plan`), or a share of every slot's places: the same assignments are
kept and dropped as on one device.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp


class DispatchPlan(NamedTuple):
    slot: jax.Array  # [groups, group_size, top_k] int32 in [0, E * C]; E * C means dropped
    kept: jax.Array  # [groups, group_size, top_k] bool


class DispatchStats(NamedTuple):
    """What a dispatch reports of this device's assignments, for the layer's stats."""

    dropped: jax.Array  # assignments dropped (for lack of capacity, or of buffer rows)
    # Over replica slots only: assignments kept per slot of the expert group, and
    # [num_experts, max_copies] what each expert would keep with 1, 2, ... copies.
    slot_load: jax.Array | None = None
    kept_by_copies: jax.Array | None = None


def _priority_rank(expert_index: jax.Array, num_experts: int) -> jax.Array:
    """``[G, S, k]``: how many assignments to the same expert come before each one, in
    priority order (choice-major, then token order)."""
    groups, group_size, top_k = expert_index.shape
    one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32)  # [G, S, k, E]
    by_priority = one_hot.transpose(0, 2, 1, 3).reshape(groups, top_k * group_size, num_experts)
    position_in_expert = jnp.cumsum(by_priority, axis=1) - 1
    position = jnp.sum(position_in_expert * by_priority, axis=-1)  # [G, k * S]
    return position.reshape(groups, top_k, group_size).transpose(0, 2, 1)


def plan_dispatch(expert_index: jax.Array, num_experts: int, capacity: int) -> DispatchPlan:
    """Slot of every assignment under the rule in the module docstring."""
    chex.assert_rank(expert_index, 3)
    chex.assert_type(expert_index, int)
    position = _priority_rank(expert_index, num_experts)
    kept = position < capacity
    dropped_slot = num_experts * capacity
    slot = jnp.where(kept, expert_index * capacity + position, dropped_slot)
    return DispatchPlan(slot=slot.astype(jnp.int32), kept=kept)


def plan_replicated_dispatch(
    expert_index: jax.Array, slot_expert: jax.Array, num_experts: int, capacity: int
) -> DispatchPlan:
    """Slots of every assignment when expert slot ``i`` holds expert ``slot_expert[i]``
    (-1: empty; every expert needs at least one slot). Buffer: ``capacity`` per slot."""
    chex.assert_rank([expert_index, slot_expert], [3, 1])
    chex.assert_type([expert_index, slot_expert], int)
    num_slots = slot_expert.shape[0]
    rank = _priority_rank(expert_index, num_experts)
    target, position = _round_robin(expert_index, rank, slot_expert, num_experts)
    kept = position < capacity
    slot = jnp.where(kept, target * capacity + position, num_slots * capacity)
    return DispatchPlan(slot=slot.astype(jnp.int32), kept=kept)


def _round_robin(
    expert_index: jax.Array, rank: jax.Array, slot_expert: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array]:
    """The slot of each assignment of priority ``rank`` under its expert (copy ``rank mod
    copies``) and its position among that copy's assignments (``rank // copies``)."""
    num_slots = slot_expert.shape[0]
    holds = jax.nn.one_hot(slot_expert, num_experts, dtype=jnp.int32)  # [slots, E]; -1: none
    copies = jnp.sum(holds, axis=0)  # [E]
    copy_index = jnp.sum((jnp.cumsum(holds, axis=0) - 1) * holds, axis=1)  # [slots]
    # slot_of[e, c]: the slot of expert e's copy c (in slot order); empty slots index past
    # the end (a negative index would wrap) and are dropped.
    held = jnp.where(slot_expert >= 0, slot_expert, num_experts)
    slot_of = (
        jnp.zeros((num_experts, num_slots), jnp.int32)
        .at[held, copy_index]
        .set(jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
    )
    expert_copies = jnp.maximum(copies[expert_index], 1)
    return slot_of[expert_index, rank % expert_copies], rank // expert_copies


def replica_slots(expert_index: jax.Array, slot_expert: jax.Array, num_experts: int) -> jax.Array:
    """The expert slot of every assignment ``[G, S, k]`` when nothing drops (ragged
    dropless dispatch, ``ExperimentalOptions(replica_split="round_robin")``): an expert's
    assignments go round-robin over its copies in priority order, as
    :func:`plan_replicated_dispatch` places them without a capacity."""
    chex.assert_rank([expert_index, slot_expert], [3, 1])
    rank = _priority_rank(expert_index, num_experts)
    slot, _ = _round_robin(expert_index, rank, slot_expert, num_experts)
    return slot.astype(jnp.int32)


def local_plan(
    slot_index: jax.Array, kept: jax.Array, num_slots: int, capacity: int
) -> DispatchPlan:
    """This device's share of a group's plan, packed into a buffer of its own.

    Under sequence parallelism a routing group (whole sequences) is planned identically
    on every device of the tensor group, each holding some of its tokens.
    ``slot_index [G, S, k]`` is the expert slot (the expert, or a replica slot) of each
    assignment of this device's tokens under that plan and ``kept`` whether the plan
    keeps it; each kept assignment gets the next free position of its slot in a buffer
    of ``capacity`` per slot, in priority order (choice-major, then token order), so
    the device dispatches its own tokens only. ``capacity`` must bound the kept
    assignments of any slot: ``min(group capacity, S)`` does (a token sends at most one
    assignment to each slot).
    """
    chex.assert_equal_shape((slot_index, kept))
    index = jnp.where(kept, slot_index, num_slots)  # dropped ones rank among themselves
    position = _priority_rank(index, num_slots + 1)
    slot = jnp.where(kept, slot_index * capacity + position, num_slots * capacity)
    return DispatchPlan(slot=slot.astype(jnp.int32), kept=kept)


def dispatch(x: jax.Array, plan: DispatchPlan, num_slots: int) -> jax.Array:
    """Place tokens ``[G, S, d]`` in their slots: ``[G, num_slots, d]``; empty slots are 0.

    Each slot gathers the token that fills it (the plan's slots inverted, in integers),
    rather than each token being scattered into a buffer of zeros: the backward pass then
    sums each token's slots into a buffer of tokens, and no buffer of slots is made from
    zeros in either pass. XLA merges equal buffers of zeros (``docs/xla_notes.md``): the
    forward pass's and the backward pass's would be one, alive from one to the other."""
    chex.assert_rank(x, 3)
    chex.assert_shape(
        plan.slot, (*x.shape[:2], None), custom_message="plan slots [groups, tokens, top_k]"
    )

    def gather_group(tokens: jax.Array, slot: jax.Array) -> jax.Array:
        count, top_k = slot.shape
        # The token of each slot, ``count`` where none fills it (a kept assignment has a
        # slot of its own; a dropped one points past the last and is dropped here).
        token = jnp.repeat(jnp.arange(count, dtype=jnp.int32), top_k)  # token-major
        source = jnp.full((num_slots,), count, jnp.int32)
        source = source.at[slot.reshape(-1)].set(token, mode="drop")
        return tokens.at[source].get(mode="fill", fill_value=0)

    return jax.vmap(gather_group)(x, plan.slot)


def combine(expert_output: jax.Array, plan: DispatchPlan, weight: jax.Array) -> jax.Array:
    """Weighted sum over each token's kept choices: ``[G, num_slots, d] -> [G, S, d]``.

    A dropped choice points one past the last slot, which gathers zeros.
    """
    chex.assert_rank(expert_output, 3)
    chex.assert_equal_shape((plan.slot, weight))
    chex.assert_equal_shape_prefix((expert_output, plan.slot), 1)

    def gather_group(outputs: jax.Array, slot: jax.Array) -> jax.Array:
        return outputs.at[slot].get(mode="fill", fill_value=0)  # [S, k, d]

    gathered = jax.vmap(gather_group)(expert_output, plan.slot)
    return jnp.einsum("gskd,gsk->gsd", gathered, weight.astype(gathered.dtype))
