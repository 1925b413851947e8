"""Each step, which of an expert's routed rows each of its copies takes (ragged dropless).

A replica table (:mod:`jaxmoe.placement.replicas`) is made before a step, from the steps
before it: it says which devices hold a copy of which expert. Which rows each copy takes
can still be chosen inside the step, from that step's own routing. Under the ragged
dropless dispatch (:mod:`jaxmoe.layers.ragged`) a device's work is the rows its slots
receive, so here each expert's rows are split over its copies to even out the devices'
loads (the library's split; the research baseline
``ExperimentalOptions(replica_split="round_robin")``, :mod:`jaxmoe.experimental`, deals
them out evenly instead, :func:`~jaxmoe.layers.dispatch.replica_slots`):

1. The devices of the expert group share their rows per expert: one ``all_gather`` of
   ``E`` integers each, which replaces the ragged dispatch's own gather of its counts.
2. :func:`balanced_rows` starts from the even split and visits the experts in turn,
   ``SWEEPS`` times: each visit pours the expert's rows over the devices that hold its
   copies, filling the least loaded first given what every other expert has put there
   (water-filling). A visit is the best split of that expert given the others, so the
   largest device load never rises from one visit to the next.
3. :func:`copy_bounds` rounds the split to whole rows: the expert's rows, source after
   source, are cut into consecutive runs, one per copy in slot order.
   :func:`source_slot_rows` then gives every device the rows every source sends to every
   slot, with no further exchange, and :func:`slots_of` the slot of each of its own
   assignments, from its place in that order.

Every device computes the same split from the same counts, so senders and receivers
agree. The split never changes what is computed (a replica's weights are its home
expert's), only where. The numpy arrays of the placement planner go through the same
functions (:func:`balanced_rows` and :func:`copy_bounds` take numpy or jax arrays).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config.layout import EXPERT
from jaxmoe.parallel.mesh import role_axes, role_size

# Sweeps over the experts in balanced_rows. Each sweep closes most of the gap to the
# least largest load (a linear program's): over random tables of 4-8 devices, 8 sweeps
# end within 1% of it in all but 0.7% of cases (at most 3.3% above), 16 within 1%
# (tests/placement/test_copy_split.py). A sweep is one loop iteration per expert.
SWEEPS = 8


def _xp(*arrays: Any) -> Any:
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def water_fill(base: Any, holds: Any, total: Any) -> Any:
    """``[..., D]``: ``total [...]`` poured over the devices that ``holds``, least ``base``
    first.

    The amounts are ``max(level - base, 0)`` on those devices (0 elsewhere), at the level
    where they add up to ``total``: the split that minimises the largest ``base + amount``.
    """
    xp = _xp(base, holds, total)
    devices = base.shape[-1]
    holds = xp.broadcast_to(holds, base.shape)
    held = xp.sum(holds, axis=-1, keepdims=True)
    ordered = xp.sort(xp.where(holds, base, xp.inf), axis=-1)
    finite = xp.where(xp.arange(devices) < held, ordered, 0.0)
    k = xp.arange(1, devices + 1)
    # The level if the k least loaded are filled.
    level = (xp.asarray(total)[..., None] + xp.cumsum(finite, axis=-1)) / k
    fits = (k <= held) & (level >= finite)
    chosen = xp.max(xp.where(fits, k, 1), axis=-1, keepdims=True) - 1
    reached = xp.take_along_axis(level, chosen, axis=-1)
    return xp.where(holds, xp.maximum(reached - base, 0.0), 0.0)


def balanced_rows(
    expert_rows: Any, slot_expert: Any, slots_per_device: int, sweeps: int = SWEEPS
) -> Any:
    """``[..., N]`` (float): the rows each of the ``N = devices x slots_per_device`` global
    slots takes, expert ``slot_expert[j]`` (-1: empty) having ``expert_rows[..., e]`` rows,
    split to even out the devices' loads (the module docstring, step 2); leading
    dimensions of ``expert_rows`` are routings split independently."""
    xp = _xp(expert_rows, slot_expert)
    num_experts = expert_rows.shape[-1]
    num_slots = slot_expert.shape[0]
    devices = num_slots // slots_per_device
    rows = xp.asarray(expert_rows, xp.float32)
    holds = slot_expert[None, :] == xp.arange(num_experts)[:, None]  # [E, N]
    copies = xp.maximum(xp.sum(holds, axis=1), 1)
    held = xp.maximum(slot_expert, 0)
    split = xp.where(slot_expert >= 0, rows[..., held] / copies[held], 0.0)
    device_of = xp.arange(num_slots) // slots_per_device
    on_device = (device_of[:, None] == xp.arange(devices)[None, :]).astype(xp.float32)  # [N, G]

    def visit(i: Any, split: Any) -> Any:
        expert = i % num_experts
        mine = holds[expert]
        loads = split @ on_device
        own = xp.where(mine, split, 0.0) @ on_device
        copies_on = mine.astype(xp.float32) @ on_device
        amount = water_fill(loads - own, copies_on > 0, rows[..., expert])
        per_copy = amount / xp.maximum(copies_on, 1.0)
        return xp.where(mine, per_copy[..., device_of], split)

    visits = sweeps * num_experts
    if xp is jnp:
        return jax.lax.fori_loop(0, visits, visit, split)
    for i in range(visits):
        split = visit(i, split)
    return split


def copy_bounds(split: Any, slot_expert: Any, expert_rows: Any) -> tuple[Any, Any]:
    """``(start, end)`` ``[N]`` int32: the run of its expert's rows each slot takes, the
    float ``split`` rounded so the runs of an expert's copies, in slot order, tile
    ``[0, expert_rows[e])`` exactly (empty slots: ``(0, 0)``)."""
    xp = _xp(split, slot_expert, expert_rows)
    num_slots = slot_expert.shape[0]
    held = xp.maximum(slot_expert, 0)
    total = xp.where(slot_expert >= 0, xp.asarray(expert_rows)[held], 0).astype(xp.int32)
    same = (slot_expert[:, None] == slot_expert[None, :]) & (slot_expert[:, None] >= 0)
    index = xp.arange(num_slots)
    earlier = same & (index[None, :] < index[:, None])  # [j, j']: j' an earlier copy
    later = same & (index[None, :] > index[:, None])
    through = xp.sum(xp.where(earlier | (index[:, None] == index[None, :]), split, 0.0), axis=1)
    end = xp.minimum(xp.floor(through + 0.5).astype(xp.int32), total)
    end = xp.where(xp.any(later, axis=1), end, total)  # the last copy ends the expert's rows
    start = xp.max(xp.where(earlier, end[None, :], 0), axis=1, initial=0)
    return start.astype(xp.int32), end.astype(xp.int32)


def source_slot_rows(counts: jax.Array, slot_expert: jax.Array, start: jax.Array, end: jax.Array):
    """``[sources, N]``: the rows each source (``counts [sources, E]``, its rows per
    expert) sends to each slot, its rows of an expert being consecutive in that expert's
    order, source after source."""
    held = jnp.maximum(slot_expert, 0)
    first = (jnp.cumsum(counts, axis=0) - counts)[:, held]  # [sources, N]
    last = first + counts[:, held]
    rows = jnp.minimum(last, end[None, :]) - jnp.maximum(first, start[None, :])
    return jnp.where(slot_expert[None, :] >= 0, jnp.maximum(rows, 0), 0).astype(jnp.int32)


def slots_of(
    expert_index: jax.Array,
    first: jax.Array,
    slot_expert: jax.Array,
    start: jax.Array,
    end: jax.Array,
) -> jax.Array:
    """The slot of each of this device's assignments ``expert_index [A]``: its place in its
    expert's order is ``first[e]`` (this device's first row of expert ``e``) plus its rank
    among this device's rows of that expert, in ``expert_index``'s order."""
    assignments = expert_index.shape[0]
    order = jnp.argsort(expert_index, stable=True)
    sorted_index = expert_index[order]
    counts = jnp.zeros(first.shape[0], jnp.int32).at[expert_index].add(1)
    begins = jnp.cumsum(counts) - counts
    rank = (
        jnp.zeros(assignments, jnp.int32)
        .at[order]
        .set(jnp.arange(assignments, dtype=jnp.int32) - begins[sorted_index])
    )
    place = first[expert_index] + rank  # [A]
    taken = (
        (slot_expert[None, :] == expert_index[:, None])
        & (start[None, :] <= place[:, None])
        & (place[:, None] < end[None, :])
    )
    return jnp.argmax(taken, axis=1).astype(jnp.int32)


def balanced_slots(
    expert_index: jax.Array, slot_expert: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array]:
    """This device's assignments' slots ``[T, k]`` and the rows every source of its expert
    group sends to every global slot ``[G, N]``, the split balanced from this step's
    routing (the module docstring); inside the whole-step shard_map, or with no expert
    axis (``G = 1``)."""
    chex.assert_rank([expert_index, slot_expert], [2, 1])
    flat = expert_index.reshape(-1)
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    group = role_size(EXPERT)
    if group > 1:
        axes = role_axes(EXPERT)
        every = jax.lax.all_gather(counts, axes)  # [G, E]
        me = jax.lax.axis_index(axes)
    else:
        every, me = counts[None], 0
    expert_rows = jnp.sum(every, axis=0)
    slots_per_device = slot_expert.shape[0] // group
    split = balanced_rows(expert_rows, slot_expert, slots_per_device)
    start, end = copy_bounds(split, slot_expert, expert_rows)
    first = (jnp.cumsum(every, axis=0) - every)[me]
    slot = slots_of(flat, first, slot_expert, start, end)
    return slot.reshape(expert_index.shape), source_slot_rows(every, slot_expert, start, end)
