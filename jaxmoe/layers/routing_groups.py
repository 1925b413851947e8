"""Routing groups: the tokens that share each expert's capacity, and this device's part.

Capacity is counted per routing group (``moe.group_size``; by default one whole sequence,
whatever the layout), and the load-balancing loss averages over groups. Under context
and tensor (sequence) parallelism a device holds only its share of each row's positions
(:mod:`jaxmoe.parallel.sequence_split`); a group of whole sequences is then planned from
the group's choices, gathered over the sequence group back into position order
(``[rows, seq_len, top_k]`` integers), identically on every member. Each member then
dispatches a part of that plan, whichever needs the smaller buffer (:meth:`RoutingGroups.
device_plan`):

- the assignments of its own positions (:func:`~jaxmoe.layers.dispatch.local_plan`), in
  ``min(capacity, local)`` places per slot: a slot's kept assignments may all be its own;
- or a share of every slot's places, ``ceil(capacity / parts)`` of them, filled from the
  whole groups' tokens gathered over the sequence group. It combines its share's outputs
  into whole rows, and the members sum those into each one's positions
  (:func:`~jaxmoe.parallel.sequence_split.sum_own_positions`): sequence parallelism's
  all-gather and reduce-scatter around a dense layer. With a capacity factor this is the
  smaller buffer (under a tensor group of 2, half the experts' rows and all-to-all bytes);
  dropless, ``capacity`` is the group's size and the own positions' buffer is as small.

Either way every kept assignment is dispatched once, by one member, so
``parallel.context``, ``parallel.tensor`` and ``parallel.expert_tensor`` never change
which tokens are dropped. A ``group_size`` that divides the runs a device's share is cut
into (:func:`~jaxmoe.config.layout.contiguous_positions`) needs no gather.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config.layout import contiguous_positions
from jaxmoe.layers.dispatch import DispatchPlan, local_plan
from jaxmoe.parallel.sequence_split import (
    context_size,
    gather_positions,
    sequence_group_index,
    sequence_slice,
)


class DevicePlan(NamedTuple):
    """What a device dispatches of its routing groups' plan."""

    places: DispatchPlan  # [groups, positions, top_k]: places in its buffer, or not its own
    capacity: int  # places per slot in its buffer
    whole_groups: bool  # places of the whole groups' positions (gathered), not its own
    dropped: jax.Array  # the plan's drops among this device's own positions


class RoutingGroups(NamedTuple):
    """This device's routing groups: every choice of each whole group, and its own part."""

    choices: jax.Array  # [groups, size, top_k]: the experts of each token of a whole group
    counts: jax.Array  # [groups, num_experts]: assignments routed to each expert, pre-drop
    rows: int  # rows of tokens this device holds
    local: int  # positions of a group this device holds
    parts: int  # devices a group is split over: its sequence group when gathered, else 1

    @property
    def count(self) -> int:
        return self.choices.shape[0]

    @property
    def size(self) -> int:
        return self.choices.shape[1]

    def device_plan(self, group_plan: DispatchPlan, num_slots: int, capacity: int) -> DevicePlan:
        """What this device dispatches of the whole groups' plan (``capacity`` places per
        slot): its own positions' assignments or a share of every slot's places, whichever
        buffer is smaller (the module docstring)."""
        if self.parts == 1:
            dropped = jnp.sum(~group_plan.kept, dtype=jnp.int32)
            return DevicePlan(group_plan, capacity, False, dropped)
        dropped = jnp.sum(~self._own(group_plan.kept), dtype=jnp.int32)
        share = -(-capacity // self.parts)
        local_capacity = min(capacity, self.local)
        if share < local_capacity:
            shared = self._share(group_plan, num_slots, capacity, share)
            return DevicePlan(shared, share, True, dropped)
        slot_index = jnp.where(group_plan.kept, group_plan.slot // capacity, num_slots)
        own = local_plan(
            self._own(slot_index), self._own(group_plan.kept), num_slots, local_capacity
        )
        return DevicePlan(own, local_capacity, False, dropped)

    def _share(
        self, group_plan: DispatchPlan, num_slots: int, capacity: int, share: int
    ) -> DispatchPlan:
        """This member's share of every slot's places: member ``i`` of the sequence group
        takes places ``[i * share, (i + 1) * share)`` of each slot, whoever's positions
        fill them, renumbered into a buffer of ``share`` places per slot."""
        slot, place = group_plan.slot // capacity, group_plan.slot % capacity
        first = sequence_group_index() * share
        mine = group_plan.kept & (place >= first) & (place < first + share)
        renumbered = jnp.where(mine, slot * share + place - first, num_slots * share)
        return DispatchPlan(slot=renumbered.astype(jnp.int32), kept=mine)

    def _own(self, a: jax.Array) -> jax.Array:
        """``[groups, size, k]`` -> this device's positions, ``[groups, local, k]``."""
        top_k = a.shape[-1]
        a = sequence_slice(a.reshape(self.rows, -1, top_k))
        return a.reshape(self.count, self.local, top_k)


def routing_groups(
    choices: jax.Array, num_experts: int, group_size: int | None, sequence: int
) -> RoutingGroups:
    """The routing groups of this device's tokens' ``choices [rows, positions, top_k]``.

    ``sequence``: the devices of its sequence group, each holding its share of the
    positions of the same rows (1: whole rows). ``group_size`` None: one whole
    sequence."""
    rows, positions, top_k = choices.shape
    size = group_size or positions * sequence
    if spans_the_sequence_group(rows, positions, sequence, size):
        # Whole sequences: every member plans the group's assignments alike from the
        # gathered choices and keeps those of its own positions.
        choices = gather_positions(choices)
        parts = sequence
    elif (rows * positions) % size:
        raise ValueError(
            f"moe.group_size={size} does not divide the {rows * positions} tokens on this device"
        )
    else:
        parts = 1
    grouped = choices.reshape(-1, size, top_k)
    counts = jnp.sum(jax.nn.one_hot(grouped, num_experts, dtype=jnp.int32), axis=(1, 2))
    return RoutingGroups(grouped, counts, rows, size // parts, parts)


def spans_the_sequence_group(rows: int, positions: int, sequence: int, group_size: int) -> bool:
    """Whether routing groups of ``group_size`` are whole sequences split over the sequence
    group (planned from gathered choices), rather than inside this device's tokens.

    ``positions``: of each of the ``rows`` this device holds, its share of ``positions *
    sequence``. Raises ValueError for a group size that is neither."""
    if sequence == 1:
        return False
    full_seq = positions * sequence
    context = context_size()
    runs = contiguous_positions(full_seq, context, sequence // context)
    if runs % group_size == 0:
        return False
    if group_size % full_seq == 0 and rows % (group_size // full_seq) == 0:
        return True
    raise ValueError(
        f"moe.group_size={group_size}: under context or tensor parallelism a routing group "
        f"is a divisor of the runs of {runs} positions a device holds of each row, or whole "
        "sequences "
        f"(a multiple of {full_seq}) whose count divides the {rows} rows of a device"
    )
