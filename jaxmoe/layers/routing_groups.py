"""Routing groups: the tokens that share each expert's capacity, and this device's part.

Capacity is counted per routing group (``moe.group_size``; by default one whole sequence,
whatever the layout), and the load-balancing loss averages over groups. Under tensor
(sequence) parallelism a device holds only ``seq_len / tensor`` positions of each row; a
group of whole sequences is then planned from the group's choices, all-gathered over the
tensor group (``[rows, seq_len / tensor, top_k]`` integers), identically on every member,
and each device dispatches the assignments of its own positions
(:func:`~jaxmoe.layers.dispatch.local_plan`). So ``parallel.tensor`` and
``parallel.expert_tensor`` never change which tokens are dropped. A ``group_size`` that
divides a device's slice of a sequence needs no gather.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config.layout import TENSOR
from jaxmoe.layers.dispatch import DispatchPlan, local_plan
from jaxmoe.parallel.mesh import role_axes
from jaxmoe.parallel.tensor_parallel import sequence_slice


class RoutingGroups(NamedTuple):
    """This device's routing groups: every choice of each whole group, and its own part."""

    choices: jax.Array  # [groups, size, top_k]: the experts of each token of a whole group
    counts: jax.Array  # [groups, num_experts]: assignments routed to each expert, pre-drop
    rows: int  # rows of tokens this device holds
    local: int  # positions of a group this device holds
    parts: int  # devices a group is split over: its tensor group when gathered, else 1

    @property
    def count(self) -> int:
        return self.choices.shape[0]

    @property
    def size(self) -> int:
        return self.choices.shape[1]

    def own_plan(
        self, group_plan: DispatchPlan, num_slots: int, capacity: int
    ) -> tuple[DispatchPlan, int]:
        """This device's part of the whole groups' plan (``capacity`` places per slot), in a
        buffer of its own: ``(plan, places per slot)``.

        A group split over the tensor group is planned alike by every member, which keeps
        its own positions' assignments, packed in ``min(capacity, local)`` places per slot
        (a token sends at most one assignment to a slot)."""
        if self.parts == 1:
            return group_plan, capacity
        local_capacity = min(capacity, self.local)
        slot_index = jnp.where(group_plan.kept, group_plan.slot // capacity, num_slots)
        own = local_plan(
            self._own(slot_index), self._own(group_plan.kept), num_slots, local_capacity
        )
        return own, local_capacity

    def _own(self, a: jax.Array) -> jax.Array:
        """``[groups, size, k]`` -> this device's positions, ``[groups, local, k]``."""
        top_k = a.shape[-1]
        a = sequence_slice(a.reshape(self.rows, -1, top_k))
        return a.reshape(self.count, self.local, top_k)


def routing_groups(
    choices: jax.Array, num_experts: int, group_size: int | None, tensor: int
) -> RoutingGroups:
    """The routing groups of this device's tokens' ``choices [rows, positions, top_k]``.

    ``tensor``: the devices of its tensor group, each holding its slice of the positions
    of the same rows (1: whole rows). ``group_size`` None: one whole sequence."""
    rows, positions, top_k = choices.shape
    size = group_size or positions * tensor
    if spans_the_tensor_group(rows, positions, tensor, size):
        # Whole sequences: every member plans the group's assignments alike from the
        # gathered choices and keeps those of its own positions.
        choices = jax.lax.all_gather(choices, role_axes(TENSOR), axis=1, tiled=True)
        parts = tensor
    elif (rows * positions) % size:
        raise ValueError(
            f"moe.group_size={size} does not divide the {rows * positions} tokens on this device"
        )
    else:
        parts = 1
    grouped = choices.reshape(-1, size, top_k)
    counts = jnp.sum(jax.nn.one_hot(grouped, num_experts, dtype=jnp.int32), axis=(1, 2))
    return RoutingGroups(grouped, counts, rows, size // parts, parts)


def spans_the_tensor_group(rows: int, positions: int, tensor: int, group_size: int) -> bool:
    """Whether routing groups of ``group_size`` are whole sequences split over the tensor
    group (planned from gathered choices), rather than inside this device's tokens.

    ``positions``: of each of the ``rows`` this device holds, its slice of ``positions *
    tensor``. Raises ValueError for a group size that is neither."""
    if tensor == 1 or positions % group_size == 0:
        return False
    full_seq = positions * tensor
    if group_size % full_seq == 0 and rows % (group_size // full_seq) == 0:
        return True
    raise ValueError(
        f"moe.group_size={group_size}: under tensor parallelism a routing group is a divisor "
        f"of the {positions} positions a device holds of each row, or whole sequences "
        f"(a multiple of {full_seq}) whose count divides the {rows} rows of a device"
    )
