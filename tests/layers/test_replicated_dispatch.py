"""Dispatch over expert slots: round-robin over an expert's copies, capacity per slot."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.layers.dispatch import plan_dispatch, plan_replicated_dispatch
from jaxmoe.placement.replicas import (
    EMPTY,
    replicas_per_expert,
    slot_experts,
    static_placement,
)


def _routing(seed: int, groups=3, group_size=20, top_k=2, experts=4) -> jax.Array:
    rng = np.random.default_rng(seed)
    # Skewed: expert 0 is hot, so capacity binds.
    index = rng.choice(experts, (groups, group_size, top_k), p=[0.55, 0.25, 0.15, 0.05])
    return jnp.asarray(index, jnp.int32)


def test_one_copy_per_expert_is_the_plain_plan():
    index = _routing(0)
    plain = plan_dispatch(index, 4, capacity=3)
    replicated = plan_replicated_dispatch(index, jnp.arange(4, dtype=jnp.int32), 4, capacity=3)
    chex.assert_trees_all_equal(replicated, plain)


def test_copies_take_assignments_round_robin_and_keep_copies_times_capacity():
    index = _routing(1)
    capacity = 2
    # Expert 0 has three copies (slots 0, 4, 5), expert 1 two (slots 1, 6); slot 7 is empty.
    slot_expert = jnp.asarray([0, 1, 2, 3, 0, 0, 1, EMPTY], jnp.int32)
    plan = plan_replicated_dispatch(index, slot_expert, 4, capacity)
    wide = plan_dispatch(index, 4, capacity=3 * capacity)  # expert 0's total places
    # An expert keeps its first copies * capacity assignments in priority order.
    expert_0 = np.asarray(index) == 0
    np.testing.assert_array_equal(np.asarray(plan.kept)[expert_0], np.asarray(wide.kept)[expert_0])
    slot = np.asarray(plan.slot)[np.asarray(plan.kept)] // capacity
    expert = np.asarray(index)[np.asarray(plan.kept)]
    np.testing.assert_array_equal(np.asarray(slot_expert)[slot], expert)
    # Each slot takes at most `capacity` per group, and no two assignments share a place.
    for group in range(index.shape[0]):
        places = np.asarray(plan.slot[group])[np.asarray(plan.kept[group])]
        assert len(set(places.tolist())) == len(places)
        counts = np.bincount(places // capacity, minlength=8)
        assert counts.max() <= capacity and counts[7] == 0
        # Round robin: expert 0's copies fill within one place of each other.
        copies_0 = counts[[0, 4, 5]]
        assert copies_0.max() - copies_0.min() <= 1


def test_static_placement_gives_every_expert_the_same_copies():
    table = static_placement(num_experts=16, expert_axis=4, slots_per_device=8)
    np.testing.assert_array_equal(replicas_per_expert(table, 16), np.full(16, 2))
    for device, row in enumerate(table):  # never a second copy of a home expert
        assert not set(row.tolist()) & set(range(4 * device, 4 * device + 4))
    slots = slot_experts(jnp.asarray(table), 16)
    assert slots.shape == (32,)
    np.testing.assert_array_equal(np.asarray(slots[:4]), [0, 1, 2, 3])
