"""Capacity, the token-dropping rule of ``plan_dispatch``, and the dispatch/combine round trip.

The rule (``jaxmoe.layers.dispatch`` docstring): assignments are ranked choice
first, then token position; each expert fills its ``capacity`` slots in that
order and drops the rest. Slot = expert * capacity + position; a dropped
assignment gets slot ``num_experts * capacity``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmoe.config import capacity_per_expert
from jaxmoe.layers.dispatch import DispatchPlan, combine, dispatch, local_plan, plan_dispatch

# --- capacity_per_expert ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group_size", "top_k", "capacity_factor", "num_experts", "expected"),
    [
        (8, 1, 1.0, 8, 1),  # exactly 1
        (8, 2, 1.0, 8, 2),  # exactly 2
        (8, 1, 1.25, 8, 2),  # 1.25 rounds up
        (10, 1, 1.0, 4, 3),  # 2.5 rounds up
        (12, 2, 1.5, 8, 5),  # 4.5 rounds up
        (16, 2, 2.0, 8, 8),  # exactly 8
        (4, 1, 0.5, 8, 1),  # 0.25 rounds up to one slot
        (6, 2, 0.5, 3, 2),  # the hand-built dispatch case below
    ],
)
def test_capacity_is_ceil_of_tokens_times_k_times_factor_over_experts(
    group_size, top_k, capacity_factor, num_experts, expected
):
    assert capacity_per_expert(group_size, top_k, capacity_factor, num_experts) == expected


@pytest.mark.parametrize(("group_size", "top_k", "num_experts"), [(8, 1, 8), (8, 2, 4), (5, 3, 7)])
def test_dropless_capacity_is_the_group_size(group_size, top_k, num_experts):
    assert capacity_per_expert(group_size, top_k, None, num_experts) == group_size


# --- plan_dispatch on a hand-built case ------------------------------------------------------

# One group of 6 tokens, top-2, 3 experts, capacity 2 (6 slots; slot 6 = dropped).
#   token  1st 2nd
#     t0    0   1
#     t1    0   2
#     t2    1   0
#     t3    0   1
#     t4    2   1
#     t5    1   2
# First choices, in token order: t0->e0 (pos 0), t1->e0 (pos 1), t2->e1 (pos 0),
#   t3->e0 (full: dropped, an earlier token wins), t4->e2 (pos 0), t5->e1 (pos 1).
# Second choices, in token order: t0->e1 (full: dropped; it would have fitted had it
#   jumped the queue ahead of t5's first choice), t1->e2 (pos 1), t2->e0 (full),
#   t3->e1 (full), t4->e1 (full), t5->e2 (full).
HAND_INDEX = np.array([[[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [1, 2]]], np.int32)
HAND_KEPT = np.array(
    [[[True, False], [True, True], [True, False], [False, False], [True, False], [True, False]]]
)
HAND_SLOT = np.array([[[0, 6], [1, 5], [2, 6], [6, 6], [4, 6], [3, 6]]], np.int32)


def test_plan_dispatch_on_hand_built_case():
    plan = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=2)

    np.testing.assert_array_equal(plan.kept, HAND_KEPT)
    np.testing.assert_array_equal(plan.slot, HAND_SLOT)
    assert plan.slot.dtype == jnp.int32


def test_first_choice_of_a_later_token_beats_second_choice_of_an_earlier_one():
    plan = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=2)
    kept = np.asarray(plan.kept)[0]

    assert not kept[0, 1]  # t0's second choice (expert 1) ...
    assert kept[5, 0] and kept[2, 0]  # ... loses to t2's and t5's first choices of expert 1


def test_earlier_token_beats_later_token_for_the_same_choice():
    plan = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=2)
    kept = np.asarray(plan.kept)[0]

    assert kept[0, 0] and kept[1, 0] and not kept[3, 0]  # expert 0: t0, t1 in; t3 out


def test_plan_dispatch_groups_are_independent():
    # The same group twice, and once with the tokens that were dropped removed from contention.
    second = np.array([[[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]]], np.int32)
    index = np.concatenate([HAND_INDEX, second])

    plan = plan_dispatch(jnp.asarray(index), num_experts=3, capacity=2)

    np.testing.assert_array_equal(plan.kept[0], HAND_KEPT[0])
    np.testing.assert_array_equal(plan.slot[0], HAND_SLOT[0])
    # Group 1: each expert gets exactly two first choices, so every second choice is dropped.
    np.testing.assert_array_equal(plan.kept[1, :, 0], True)
    np.testing.assert_array_equal(plan.kept[1, :, 1], False)
    np.testing.assert_array_equal(plan.slot[1, :, 0], [0, 2, 4, 1, 3, 5])


def test_capacity_one_top_1():
    index = np.array([[[2], [2], [0], [1], [0]]], np.int32)

    plan = plan_dispatch(jnp.asarray(index), num_experts=3, capacity=1)

    np.testing.assert_array_equal(plan.kept[..., 0], [[True, False, True, True, False]])
    np.testing.assert_array_equal(plan.slot[..., 0], [[2, 3, 0, 1, 3]])


# --- plan_dispatch under generated routings --------------------------------------------------

# Jitted so that each generated shape costs one small compile instead of one per operation.
jitted_plan_dispatch = jax.jit(plan_dispatch, static_argnums=(1, 2))


def reference_plan(expert_index, num_experts, capacity):
    """The documented rule, in plain Python: loop over choices, then tokens, count per expert."""
    groups, group_size, top_k = expert_index.shape
    kept = np.zeros(expert_index.shape, bool)
    slot = np.full(expert_index.shape, num_experts * capacity, np.int64)
    for g in range(groups):
        filled = [0] * num_experts
        for choice in range(top_k):
            for token in range(group_size):
                expert = int(expert_index[g, token, choice])
                if filled[expert] < capacity:
                    kept[g, token, choice] = True
                    slot[g, token, choice] = expert * capacity + filled[expert]
                    filled[expert] += 1
    return kept, slot


@st.composite
def routings(draw):
    """An expert_index [groups, group_size, top_k]: each token's choices are distinct experts."""
    num_experts = draw(st.integers(1, 4))
    top_k = draw(st.integers(1, min(2, num_experts)))
    groups = draw(st.integers(1, 2))
    group_size = draw(st.integers(1, 6))
    experts = list(range(num_experts))
    tokens = [draw(st.permutations(experts))[:top_k] for _ in range(groups * group_size)]
    index = np.array(tokens, np.int32).reshape(groups, group_size, top_k)
    return index, num_experts


@settings(max_examples=25, deadline=None)
@given(routings())
def test_dropless_capacity_never_drops(routing):
    index, num_experts = routing
    group_size, top_k = index.shape[1:]
    capacity = capacity_per_expert(group_size, top_k, None, num_experts)

    plan = jitted_plan_dispatch(jnp.asarray(index), num_experts, capacity)

    assert np.all(plan.kept)
    slot = np.asarray(plan.slot)
    np.testing.assert_array_equal(slot // capacity, index)  # every slot is in its expert's block
    for g in range(index.shape[0]):
        assert len(np.unique(slot[g])) == slot[g].size


@settings(max_examples=25, deadline=None)
@given(routings(), st.integers(1, 3))
def test_capacity_mode_follows_the_documented_rule(routing, capacity):
    index, num_experts = routing

    plan = jitted_plan_dispatch(jnp.asarray(index), num_experts, capacity)
    kept, slot = np.asarray(plan.kept), np.asarray(plan.slot)

    expected_kept, expected_slot = reference_plan(index, num_experts, capacity)
    np.testing.assert_array_equal(kept, expected_kept)
    np.testing.assert_array_equal(slot, expected_slot)
    for g in range(index.shape[0]):
        per_expert = np.bincount(index[g][kept[g]], minlength=num_experts)
        assert np.all(per_expert <= capacity)
        kept_slots = slot[g][kept[g]]
        assert len(np.unique(kept_slots)) == kept_slots.size
        assert np.all(kept_slots < num_experts * capacity)
        assert np.all(slot[g][~kept[g]] == num_experts * capacity)


# --- dispatch and combine --------------------------------------------------------------------


def test_dispatch_then_combine_with_unit_weight_returns_the_tokens():
    num_experts, groups, group_size, width = 4, 2, 5, 3
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(groups, group_size, width)), jnp.float32)
    index = jnp.asarray(rng.integers(0, num_experts, (groups, group_size, 1)), jnp.int32)
    capacity = group_size
    plan = plan_dispatch(index, num_experts, capacity)
    assert np.all(plan.kept)

    slots = dispatch(x, plan, num_experts * capacity)
    y = combine(slots, plan, jnp.ones((groups, group_size, 1)))

    assert slots.shape == (groups, num_experts * capacity, width)
    np.testing.assert_array_equal(y, x)


def test_dispatch_places_each_token_in_its_slot_and_leaves_the_rest_zero():
    x = jnp.arange(1.0, 7.0)[None, :, None] * jnp.ones((1, 6, 2))  # token t has value t + 1
    plan = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=2)

    slots = np.asarray(dispatch(x, plan, 6))[0, :, 0]

    # slot: 0 <- t0, 1 <- t1, 2 <- t2, 3 <- t5, 4 <- t4, 5 <- t1 (its second choice).
    np.testing.assert_array_equal(slots, [1, 2, 3, 6, 5, 2])


def _scattered(closed) -> list[tuple[int, ...]]:
    """The shapes of the buffers ``closed`` (and every jaxpr in it) scatters into."""
    found = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name.startswith("scatter"):
            found.append(tuple(eqn.outvars[0].aval.shape))
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _scattered(jax.extend.core.ClosedJaxpr(inner, ()))
    return found


def test_each_slot_gathers_its_token_and_each_token_sums_its_slots():
    """Neither pass scatters into a buffer of slots (made of zeros, which XLA's CSE would
    share between the passes, alive from the forward pass to the backward): the slots
    gather their tokens, and the gradient of a token is the sum of its slots'."""
    x = jnp.arange(1.0, 7.0)[None, :, None] * jnp.ones((1, 6, 2))
    plan = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=3)
    scale = jnp.arange(1.0, 10.0)[None, :, None]  # slot s weighs s + 1

    def loss(x):
        return jnp.sum(dispatch(x, plan, 9) * scale)

    # Slots 0 <- t0, 1 <- t1, 2 <- t3, 3 <- t2, 4 <- t5, 5 <- t0, 6 <- t4, 7 <- t1, 8 <- t5.
    np.testing.assert_array_equal(
        np.asarray(dispatch(x, plan, 9))[0, :, 0], [1, 2, 4, 3, 6, 1, 5, 2, 6]
    )
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x))[0, :, 0], [7, 10, 4, 3, 7, 14])
    scattered = _scattered(jax.make_jaxpr(jax.value_and_grad(loss))(x))
    assert scattered and not [shape for shape in scattered if shape[-2:] == (9, 2)], scattered


def test_combine_drops_contribute_zero():
    x = jnp.arange(1.0, 7.0)[None, :, None] * jnp.ones((1, 6, 2))
    plan = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=2)
    weight = jnp.asarray(np.array([[[0.7, 0.3]] * 6], np.float32))

    y = np.asarray(combine(dispatch(x, plan, 6), plan, weight))[0, :, 0]

    # Identity experts: y = x * (sum of kept weights). t1 keeps both; t3 keeps none.
    kept_weight = np.where(HAND_KEPT[0], [0.7, 0.3], 0.0).sum(-1)
    np.testing.assert_allclose(y, np.arange(1.0, 7.0) * kept_weight, rtol=1e-6)
    np.testing.assert_allclose(kept_weight, [0.7, 1.0, 0.7, 0.0, 0.7, 0.7])
    assert y[3] == 0.0


def test_combine_ignores_expert_output_in_unused_slots():
    plan = DispatchPlan(
        slot=jnp.array([[[0], [2]]], jnp.int32),  # token 1 is dropped (2 slots: slot 2 = dropped)
        kept=jnp.array([[[True], [False]]]),
    )
    outputs = jnp.array([[[5.0], [9.0]]])  # slot 1 holds garbage no token points at

    y = combine(outputs, plan, jnp.ones((1, 2, 1)))

    np.testing.assert_array_equal(y, [[[5.0], [0.0]]])


# --- local_plan: a device's share of a group split over a tensor group -----------------------


def test_local_plans_keep_the_group_plan_and_pack_each_half_from_slot_zero():
    group = plan_dispatch(jnp.asarray(HAND_INDEX), num_experts=3, capacity=2)
    expert = np.where(np.asarray(group.kept), np.asarray(group.slot) // 2, 3)

    halves = [
        local_plan(jnp.asarray(expert[:, part]), group.kept[:, part], num_slots=3, capacity=2)
        for part in (slice(0, 3), slice(3, 6))
    ]

    for half, part in zip(halves, (slice(0, 3), slice(3, 6)), strict=True):
        np.testing.assert_array_equal(half.kept, HAND_KEPT[:, part])
    # First half, in priority order: t0->e0, t1->e0, t2->e1 (first choices), t1->e2.
    np.testing.assert_array_equal(halves[0].slot, [[[0, 6], [1, 4], [2, 6]]])
    # Second half: t3 dropped entirely, t4->e2 and t5->e1 each first in their expert.
    np.testing.assert_array_equal(halves[1].slot, [[[6, 6], [4, 6], [2, 6]]])


def test_the_halves_of_a_group_combine_to_the_whole_groups_output():
    rng = np.random.default_rng(0)
    first = rng.integers(0, 4, (2, 8))
    second = (first + rng.integers(1, 4, (2, 8))) % 4  # distinct from the first choice
    index = np.stack([first, second], axis=-1).astype(np.int32)
    tokens = jnp.asarray(rng.normal(size=(2, 8, 3)), jnp.float32)
    weight = jnp.asarray(rng.uniform(size=(2, 8, 2)), jnp.float32)
    group = plan_dispatch(jnp.asarray(index), num_experts=4, capacity=3)
    assert not np.all(group.kept)  # some assignments are dropped

    def apply(x, w, plan):  # expert e multiplies by e + 1
        slots = dispatch(x, plan, 4 * 3).reshape(x.shape[0], 4, 3, -1)
        outputs = slots * jnp.arange(1.0, 5.0)[:, None, None]
        return combine(outputs.reshape(x.shape[0], 12, -1), plan, w)

    expert = jnp.where(group.kept, group.slot // 3, 4)
    parts = [
        apply(
            tokens[:, part],
            weight[:, part],
            local_plan(expert[:, part], group.kept[:, part], num_slots=4, capacity=3),
        )
        for part in (slice(0, 4), slice(4, 8))
    ]

    np.testing.assert_allclose(
        jnp.concatenate(parts, axis=1), apply(tokens, weight, group), rtol=1e-6
    )
