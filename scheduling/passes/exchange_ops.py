"""New ops for a decomposed expert exchange: per-round ``ppermute``s and rotations.

In round ``r`` of ``G`` every device ``i`` sends its block for device
``(i + r) % G`` and receives the block of source ``(i - r) % G``; round 0 is
the local block and needs no transfer. Per-device code cannot pick "the block
for device ``i + r``" with a static slice, so a value is *rotated* once into
round order (a gather at indices computed from ``axis_index``) and then cut
with static slices. Rotations
only move data: the decomposed program computes the same values.

Like ``chunk_ops``, each helper is a small ``jax.lax`` function traced once per
signature (under the mesh's axis environment, for ``axis_index`` and
``ppermute``) and inlined as ops of the given phase.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from scheduling.program.capture import Atom, Op, Phase, Value, inline_jaxpr
from scheduling.program.partition_rules import Split


def _grouped(x: jax.Array, split: Split, pieces: int) -> tuple[jax.Array, int]:
    """``x`` with the middle factor of ``split.axis`` (``pieces`` long) as its own axis."""
    shape = x.shape
    inner = shape[split.axis] // (split.outer * pieces)
    grouped = x.reshape(
        (*shape[: split.axis], split.outer, pieces, inner, *shape[split.axis + 1 :])
    )
    return grouped, split.axis + 1


def _rotate(x: jax.Array, *, axis_name: Any, split: Split, pieces: int, toward: str) -> jax.Array:
    """Reorder the ``pieces`` blocks of ``x`` along ``split`` by this device's index ``i``.

    ``toward="destination"``: ``y[r] = x[(i + r) % G]`` (the block to send in round r).
    ``toward="source"``: ``y[r] = x[(i - r) % G]`` (its own inverse).
    ``toward="back"``: ``y[k] = x[(k - i) % G]``, the inverse of ``"destination"``.
    One gather: it only moves data.
    """
    index = lax.axis_index(axis_name)
    grouped, axis = _grouped(x, split, pieces)
    offsets = lax.iota(jnp.int32, pieces)
    if toward == "destination":
        taken = index + offsets
    elif toward == "source":
        taken = index - offsets + pieces
    else:
        taken = offsets - index + pieces
    taken = lax.rem(taken, jnp.int32(pieces))
    rotated = jnp.take(grouped, taken, axis=axis, mode="clip")
    # As for a join (``chunk_ops``): a reduction of the result must not be fused into
    # the gather, where XLA would sum in another order.
    return lax.optimization_barrier(rotated.reshape(x.shape))


def _ppermute(x: jax.Array, *, axis_name: Any, shift: int, pieces: int) -> jax.Array:
    """Every device ``j`` sends ``x`` to ``(j + shift) % pieces``."""
    perm = [(j, (j + shift) % pieces) for j in range(pieces)]
    return lax.ppermute(x, axis_name, perm)


@functools.lru_cache(maxsize=4096)
def _traced(
    fn: Callable[..., Any],
    keywords: tuple[tuple[str, Any], ...],
    signature: tuple,
    axis_env: tuple[tuple[str, int], ...],
):
    structs = [
        jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in signature
    ]
    return jax.make_jaxpr(functools.partial(fn, **dict(keywords)), axis_env=list(axis_env))(
        *structs
    )


def _inline(
    fn: Callable[..., Any],
    args: Sequence[Atom],
    name_stack: str,
    phase: Phase,
    axis_env: tuple[tuple[str, int], ...],
    **keywords: Any,
) -> tuple[list[Op], Value]:
    signature = tuple(
        (tuple(a.aval.shape), a.aval.dtype, bool(getattr(a.aval, "weak_type", False))) for a in args
    )
    closed = _traced(fn, tuple(sorted(keywords.items())), signature, axis_env)
    ops, (result,) = inline_jaxpr(closed, args, name_stack, phase)
    return ops, result


def rotate(
    value: Atom,
    split: Split,
    pieces: int,
    toward: str,
    axis_name: Any,
    axis_env: tuple[tuple[str, int], ...],
    name_stack: str,
    phase: Phase,
) -> tuple[list[Op], Value]:
    """Ops that rotate ``value`` into (or out of) round order; see :func:`_rotate`."""
    return _inline(
        _rotate,
        [value],
        name_stack,
        phase,
        axis_env,
        axis_name=axis_name,
        split=split,
        pieces=pieces,
        toward=toward,
    )


def send_round(
    value: Atom,
    shift: int,
    pieces: int,
    axis_name: Any,
    axis_env: tuple[tuple[str, int], ...],
    name_stack: str,
    phase: Phase,
) -> tuple[list[Op], Value]:
    """A ``ppermute`` op: each device sends ``value`` ``shift`` devices on (mod ``pieces``)."""
    return _inline(
        _ppermute,
        [value],
        name_stack,
        phase,
        axis_env,
        axis_name=axis_name,
        shift=shift,
        pieces=pieces,
    )
