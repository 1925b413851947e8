"""The per-step split of each expert's rows over its copies: water-filling against a linear
program's optimum, whole rows that tile each expert's order, and senders and receivers
that agree inside a shard_map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from scipy.optimize import linprog

from jaxmoe.config import ParallelConfig
from jaxmoe.layers.dispatch import replica_slots
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.placement.copy_split import (
    balanced_rows,
    balanced_slots,
    copy_bounds,
    water_fill,
)
from jaxmoe.placement.replicas import EMPTY, slot_experts, static_placement


def least_largest_load(rows: np.ndarray, slot_expert: np.ndarray, slots_per_device: int):
    """The optimum: min t subject to every device's rows <= t, each expert's copies summing
    to its rows, nothing on an empty slot."""
    num_slots, experts = len(slot_expert), len(rows)
    devices = num_slots // slots_per_device
    cost = np.zeros(num_slots + 1)
    cost[-1] = 1
    per_device = np.zeros((devices, num_slots + 1))
    per_device[np.arange(num_slots) // slots_per_device, np.arange(num_slots)] = 1
    per_device[:, -1] = -1
    per_expert = np.zeros((experts, num_slots + 1))
    held = slot_expert >= 0
    per_expert[slot_expert[held], np.flatnonzero(held)] = 1
    bounds = [(0, None) if e >= 0 else (0, 0) for e in slot_expert] + [(0, None)]
    result = linprog(
        cost, A_ub=per_device, b_ub=np.zeros(devices), A_eq=per_expert, b_eq=rows, bounds=bounds
    )
    assert result.success
    return result.fun


def random_case(rng: np.random.Generator, index: int):
    devices = int(rng.choice([4, 8]))
    local = int(rng.choice([1, 2]))
    experts, slots = devices * local, local + int(rng.choice([1, 2]))
    table = rng.integers(EMPTY, experts, size=(devices, slots - local)).astype(np.int32)
    if index % 3 == 0:
        table = static_placement(experts, devices, slots)
    rows = rng.gamma(float(rng.choice([0.5, 2.0])), 100, size=experts).round()
    return rows, np.asarray(slot_experts(jnp.asarray(table), experts)), slots


def test_water_fill_levels_the_least_loaded_holders():
    base = np.array([5.0, 1.0, 3.0, 0.0])
    holds = np.array([True, True, True, False])
    amount = water_fill(base, holds, 4.0)
    np.testing.assert_allclose(amount, [0.0, 3.0, 1.0, 0.0])  # level 4, below 5
    np.testing.assert_allclose(water_fill(base, holds, 0.0), 0.0)
    jax_amount = water_fill(jnp.asarray(base), jnp.asarray(holds), jnp.float32(4.0))
    np.testing.assert_allclose(jax_amount, amount, rtol=1e-6)


def test_balanced_split_reaches_the_linear_programs_least_largest_load():
    rng = np.random.default_rng(0)
    gaps, even_gaps = [], []
    for index in range(120):
        rows, slot_expert, slots = random_case(rng, index)
        split = balanced_rows(rows, slot_expert, slots, sweeps=16)
        per_expert = np.bincount(slot_expert[slot_expert >= 0], split[slot_expert >= 0])
        np.testing.assert_allclose(per_expert, rows, rtol=1e-6, atol=1e-6)
        assert np.all(split[slot_expert < 0] == 0) and np.all(split >= 0)
        best = least_largest_load(rows, slot_expert, slots)
        gaps.append(split.reshape(-1, slots).sum(axis=1).max() / best - 1)
        even = balanced_rows(rows, slot_expert, slots, sweeps=0)
        even_gaps.append(even.reshape(-1, slots).sum(axis=1).max() / best - 1)
    assert max(gaps) < 0.01
    assert max(even_gaps) > 0.3  # dealing rows out evenly is far from it on these tables


def test_the_step_and_the_planner_split_alike():
    rng = np.random.default_rng(1)
    for index in range(6):
        rows, slot_expert, slots = random_case(rng, index)
        on_host = balanced_rows(rows, slot_expert, slots)
        in_step = jax.jit(balanced_rows, static_argnums=2)(
            jnp.asarray(rows, jnp.int32), jnp.asarray(slot_expert), slots
        )
        np.testing.assert_allclose(in_step, on_host, rtol=1e-4, atol=1e-3)


def test_whole_rows_tile_each_experts_order_in_slot_order():
    rng = np.random.default_rng(2)
    for index in range(30):
        rows, slot_expert, slots = random_case(rng, index)
        rows = rows.astype(np.int32)
        split = balanced_rows(rows, slot_expert, slots)
        start, end = copy_bounds(split, slot_expert, rows)
        assert np.all(np.abs((end - start) - split) <= 1.0)
        for expert in range(len(rows)):
            copies = np.flatnonzero(slot_expert == expert)
            assert start[copies[0]] == 0 and end[copies[-1]] == rows[expert]
            np.testing.assert_array_equal(start[copies[1:]], end[copies[:-1]])
        assert np.all(start[slot_expert < 0] == 0) and np.all(end[slot_expert < 0] == 0)


DEVICES, EXPERTS, SLOTS, TOKENS, TOP_K = 8, 8, 3, 24, 2


@functools.cache
def _split_on_devices(slot_expert: tuple[int, ...], seed: int):
    """Every device's slots for skewed routing and the rows it is told each source sends
    to each slot, from ``balanced_slots`` inside a shard_map over 8 expert devices."""
    rng = np.random.default_rng(seed)
    # Distinct experts per token, expert 0 in most tokens' choices.
    index = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(DEVICES * TOKENS)])
    hot = rng.random(len(index)) < 0.6
    index[hot, 0] = np.where(index[hot, 1] == 0, index[hot, 0], 0)
    index = index.reshape(DEVICES, TOKENS, TOP_K).astype(np.int32)
    mesh = build_mesh(ParallelConfig(data=1, expert=DEVICES))
    table = jnp.asarray(slot_expert, jnp.int32)

    def per_device(index):
        slot, counts = balanced_slots(index[0], table, EXPERTS)
        return slot[None], counts[None]

    spec = PartitionSpec(tuple(mesh.axis_names))
    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    with jax.set_mesh(mesh):
        slot, counts = run(jax.device_put(index, NamedSharding(mesh, spec)))
    return np.asarray(index), np.asarray(slot), np.asarray(counts)


@pytest.mark.parametrize("seed", [0, 1])
def test_senders_and_receivers_agree_and_the_devices_even_out(seed):
    table = static_placement(EXPERTS, DEVICES, SLOTS)
    slot_expert = np.asarray(slot_experts(jnp.asarray(table), EXPERTS))
    index, slot, counts = _split_on_devices(tuple(slot_expert.tolist()), seed)
    # Every assignment goes to a copy of its own expert.
    np.testing.assert_array_equal(slot_expert[slot], index)
    for device in range(DEVICES):
        # Every device derived the same counts, and each source's are what it sends.
        np.testing.assert_array_equal(counts[device], counts[0])
        sent = np.bincount(slot[device].ravel(), minlength=len(slot_expert))
        np.testing.assert_array_equal(counts[0][device], sent)
    loads = counts[0].sum(axis=0).reshape(DEVICES, SLOTS).sum(axis=1)
    round_robin = np.stack(
        [
            np.asarray(replica_slots(jnp.asarray(i)[None], jnp.asarray(slot_expert), EXPERTS))[0]
            for i in index
        ]
    )
    dealt = np.bincount(round_robin.ravel(), minlength=len(slot_expert))
    dealt = dealt.reshape(DEVICES, SLOTS).sum(axis=1)
    assert loads.sum() == dealt.sum() == index.size
    best = least_largest_load(
        np.bincount(index.ravel(), minlength=EXPERTS).astype(float), slot_expert, SLOTS
    )
    assert loads.max() <= np.ceil(best * 1.01) + SLOTS  # whole rows: a row per slot at most
    assert loads.max() < dealt.max()


def test_routings_split_together_as_each_alone():
    rng = np.random.default_rng(3)
    rows, slot_expert, slots = random_case(rng, 0)
    routings = rng.gamma(2.0, 100, size=(5, rows.shape[0])).round()
    together = balanced_rows(routings, slot_expert, slots)
    alone = np.stack([balanced_rows(r, slot_expert, slots) for r in routings])
    np.testing.assert_allclose(together, alone, rtol=1e-6)
