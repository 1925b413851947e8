"""Gradient accumulation over microbatches inside the one per-device step.

``train.microbatches`` M cuts a device's rows into M microbatches of whole rows (so
whole routing groups: the same tokens drop as in one batch); each is forwarded and
differentiated in turn, under a name scope ``microbatch_<i>`` that the scheduler reads,
and the gradients are summed before the step's one gradient synchronisation and update.
The losses are scaled so that the sum is the gradient of the step's mean loss
(:mod:`jaxmoe.losses`). The loop is unrolled, like the layers: the scheduler sees
every microbatch's collectives, and may run one microbatch's forward pass beside
another's backward pass.

Nothing in the gradients orders one microbatch's backward pass before a later one's
forward pass, and XLA may run every forward pass first, holding the activations of the
whole batch. So from :data:`ORDERED_FROM` microbatches on, microbatch i's parameters and
rows pass through an ``optimization_barrier`` with the gradients summed up to microbatch
i - :data:`~scheduling.names.MICROBATCHES_IN_FLIGHT`: at most that many microbatches'
activations are alive, in every schedule's order, and accumulating over more
microbatches holds fewer rows. Waiting may hold up to two microbatches' gradients
unsummed, in the order XLA:CPU picks; below :data:`ORDERED_FROM` that costs more than it
saves (four microbatches of ``scale_eval``'s CPU model: 37.0 MB against 30.4 MB
unordered), so fewer microbatches run unordered.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp

import scheduling.names
from jaxmoe.layers import RoutingStats

# The scheduler reads the microbatches of a step from this scope.
SCOPE = scheduling.names.MICROBATCH_SCOPE
IN_FLIGHT = scheduling.names.MICROBATCHES_IN_FLIGHT
# The fewest microbatches that are ordered (module docstring).
ORDERED_FROM = 2 * IN_FLIGHT


def in_flight(microbatches: int) -> int:
    """How many of a step's ``microbatches`` may have their activations alive at once."""
    return min(microbatches, IN_FLIGHT) if microbatches >= ORDERED_FROM else microbatches


def microbatch_rows(batch: jax.Array, microbatches: int) -> list[jax.Array]:
    """This device's rows cut into ``microbatches`` equal, consecutive pieces."""
    rows = batch.shape[0]
    if rows % microbatches:
        raise ValueError(f"{rows} rows do not split into {microbatches} microbatches")
    size = rows // microbatches
    return [batch[i * size : (i + 1) * size] for i in range(microbatches)]


def combine_stats(parts: list[RoutingStats]) -> RoutingStats:
    """One step's routing stats from its microbatches': losses averaged, counts summed."""

    def combine(*leaves):
        if leaves[0] is None:
            return None
        stacked = jnp.stack(leaves)
        integer = jnp.issubdtype(stacked.dtype, jnp.integer)
        return jnp.sum(stacked, axis=0) if integer else jnp.mean(stacked, axis=0)

    return RoutingStats(*(combine(*field) for field in zip(*parts, strict=True)))


def accumulate(
    value_and_grad: Callable[[Any, jax.Array, int], tuple[Any, Any]],
    weights: Any,
    batch: jax.Array,
    microbatches: int,
) -> tuple[list[Any], Any]:
    """``value_and_grad(weights, rows, index) -> (aux, grads)`` on every microbatch of
    ``batch``, at most :func:`in_flight` at a time: each one's ``aux``, and the gradients
    summed in microbatch order.

    Ordered, microbatch i starts behind a barrier with the sum up to microbatch
    i - IN_FLIGHT, and the next microbatch's gradients are added to what comes out of it:
    the running sum is one chain, each sum read once."""
    auxes, pending, total = [], [], None
    for index, rows in enumerate(microbatch_rows(batch, microbatches)):
        if microbatches >= ORDERED_FROM and index >= IN_FLIGHT:
            # total: the sum up to microbatch index - IN_FLIGHT
            weights, rows, total = jax.lax.optimization_barrier((weights, rows, total))
        # One microbatch is the step as written: no scope of its own.
        scope = jax.named_scope(SCOPE.format(index)) if microbatches > 1 else nullcontext()
        with scope:
            aux, grads = value_and_grad(weights, rows, index)
        auxes.append(aux)
        pending.append(grads)
        if len(pending) == IN_FLIGHT:
            total = _add(total, pending.pop(0))
    for grads in pending:
        total = _add(total, grads)
    return auxes, total


def _add(total: Any, grads: Any) -> Any:
    return grads if total is None else jax.tree.map(jnp.add, total, grads)
