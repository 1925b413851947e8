"""Dispatch over replica slots: an expert's assignments spread over its copies.

With a replica table (:mod:`jaxmoe.placement.replicas`, ``moe.slots_per_device`` above a
device's own experts) the expert group has more slots than experts: each device holds its
experts and copies of others. The padded dispatch then gives every slot ``capacity``
places and deals an expert's assignments round-robin over its copies
(:func:`~jaxmoe.layers.dispatch.plan_replicated_dispatch`); the ragged dispatch splits an
expert's rows over its copies, balanced from the step's counts
(:func:`~jaxmoe.placement.copy_split.balanced_slots`), or round-robin, the research
baseline (:class:`jaxmoe.experimental.ExperimentalOptions`). Both report each slot's
load and what each expert would keep with 1, 2, ... copies, for the placement planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmoe.layers.dispatch import DispatchStats, plan_replicated_dispatch, replica_slots
from jaxmoe.layers.padded import PaddedDispatch, Sent, SlotPlan, plan_slots
from jaxmoe.layers.ragged import RaggedDispatch, RaggedSent
from jaxmoe.layers.router import RouterOutput
from jaxmoe.layers.routing_groups import RoutingGroups
from jaxmoe.parallel.sequence_split import sequence_group_index
from jaxmoe.placement.copy_split import balanced_slots
from jaxmoe.placement.replicas import slot_experts

# How the ragged dispatch picks the slots of this device's assignments [T, k] over the
# copies (slot_expert [num_slots]): (slots, rows every source sends every slot, or None).
CopySplit = Callable[[jax.Array, jax.Array, int], tuple[jax.Array, jax.Array | None]]


def round_robin_slots(
    choices: jax.Array, slot_expert: jax.Array, num_experts: int
) -> tuple[jax.Array, None]:
    """Each source deals an expert's assignments out over its copies in turn."""
    return replica_slots(choices[None], slot_expert, num_experts)[0], None


# ExperimentalOptions.replica_split -> the split.
COPY_SPLITS: dict[str, CopySplit] = {"balanced": balanced_slots, "round_robin": round_robin_slots}


def kept_by_copies(groups: RoutingGroups, capacity: int, copies: int) -> jax.Array:
    """``[num_experts, copies]``: the assignments each expert would keep with 1, 2, ...
    copies of ``capacity`` places per group (sum over groups of ``min(routed, copies x
    capacity)``)."""
    places = capacity * jnp.arange(1, copies + 1, dtype=jnp.int32)
    kept = jnp.sum(jnp.minimum(groups.counts[:, :, None], places), axis=0)
    if groups.parts > 1:  # every member holds the whole groups' counts: count them once
        kept = jnp.where(sequence_group_index() == 0, kept, 0)
    return kept


@dataclass(frozen=True)
class ReplicatedDispatch(PaddedDispatch):
    """The padded dispatch with ``capacity`` places per slot of the expert group."""

    def plan(
        self, route: RouterOutput, groups: RoutingGroups, replica_table: jax.Array | None
    ) -> SlotPlan:
        slot_expert = slot_experts(replica_table, self.num_experts)
        return plan_slots(
            route,
            groups,
            self.capacity_factor,
            slot_expert.shape[0],
            lambda choices, capacity: plan_replicated_dispatch(
                choices, slot_expert, self.num_experts, capacity
            ),
            replica_table,
        )

    def stats(self, groups: RoutingGroups, sent: Sent) -> DispatchStats:
        plan = sent.plan
        kept_slot = jnp.where(plan.places.kept, plan.places.slot // plan.capacity, plan.num_slots)
        slot_load = jnp.sum(jax.nn.one_hot(kept_slot, plan.num_slots, dtype=jnp.int32), (0, 1, 2))
        copies = plan.num_slots - self.num_experts + 1
        dropped = super().stats(groups, sent).dropped
        return DispatchStats(
            dropped, slot_load, kept_by_copies(groups, plan.group_capacity, copies)
        )


@dataclass(frozen=True)
class ReplicatedRaggedDispatch(RaggedDispatch):
    """The ragged dispatch over the slots of the expert group, ``split`` picking the copy
    that takes each row."""

    split: CopySplit = balanced_slots

    def slots(
        self, choices: jax.Array, replica_table: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None, int]:
        slot_expert = slot_experts(replica_table, self.num_experts)
        slot, slot_counts = self.split(choices, slot_expert, self.num_experts)
        return slot, slot_counts, slot_expert.shape[0]

    def stats(self, groups: RoutingGroups, sent: RaggedSent) -> DispatchStats:
        copies = sent.plan.num_slots - self.num_experts + 1
        dropped = super().stats(groups, sent).dropped
        # Dropless: a group's every token fits in one copy of an expert.
        return DispatchStats(dropped, sent.kept, kept_by_copies(groups, groups.size, copies))
