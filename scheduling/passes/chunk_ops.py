"""New ops for the partitioned program: chunk copies, cutting, reassembly, carries.

A chunk copy is the original equation with the parameters of its rule at
chunk size; its results are new values of the chunk shapes. Cutting a value
into its ``n`` chunks, reassembling a value from its chunks and applying a
prefix carry are small ``jax.lax`` functions, traced once per signature and
inlined as ops, so the partitioned program is again a flat list of equations
that the rest of the scheduler and ``emit`` treat like any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from scheduling.program.capture import Atom, Op, Phase, Value, inline_jaxpr
from scheduling.program.partition_rules import Chunking, Split, chunk_shape


def chunk_aval(aval: Any, axis: int, n: int) -> Any:
    return aval.update(shape=chunk_shape(aval.shape, axis, n))


def chunk_copy(op: Op, how: Chunking, n: int, inputs: Sequence[Atom]) -> Op:
    """``op`` on one chunk: ``inputs`` are the chunk operands (whole where not cut)."""
    outputs = tuple(
        Value(chunk_aval(value.aval, split.axis, n))
        for value, split in zip(op.outputs, how.outputs, strict=True)
    )
    eqn = op.eqn.replace(params=how.params(n))
    return Op(-1, eqn, tuple(inputs), outputs, op.name_stack, op.phase)


def _take(x: jax.Array, *, axis: int, outer: int, start: int, rows: int) -> jax.Array:
    """Rows ``[start, start + rows)`` of the middle factor of ``axis`` read as ``[outer, -1]``."""
    if outer == 1:
        return lax.slice_in_dim(x, start, start + rows, axis=axis)
    shape = x.shape
    grouped = x.reshape((*shape[:axis], outer, shape[axis] // outer, *shape[axis + 1 :]))
    taken = lax.slice_in_dim(grouped, start, start + rows, axis=axis + 1)
    return taken.reshape((*shape[:axis], outer * rows, *shape[axis + 1 :]))


def _join(*chunks: jax.Array, axis: int, outer: int) -> jax.Array:
    """Inverse of :func:`_take` over all chunks, in order.

    The result passes an optimization barrier: otherwise XLA may rewrite a reduction
    of the concatenation as a sum of per-chunk reductions, which rounds differently.
    """
    if outer == 1:
        return lax.optimization_barrier(lax.concatenate(chunks, axis))
    shape = chunks[0].shape
    split_shape = (*shape[:axis], outer, shape[axis] // outer, *shape[axis + 1 :])
    joined = lax.concatenate([c.reshape(split_shape) for c in chunks], axis + 1)
    whole = (*shape[:axis], shape[axis] * len(chunks), *shape[axis + 1 :])
    return lax.optimization_barrier(joined.reshape(whole))


_COMBINE = {"add": jnp.add, "mul": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum}


def _carry(local: jax.Array, previous: jax.Array, *, axis: int, combine: str) -> jax.Array:
    """A chunk's own prefix combined with the last prefix of the chunk before it."""
    size = previous.shape[axis]
    return _COMBINE[combine](local, lax.slice_in_dim(previous, size - 1, size, axis=axis))


@functools.lru_cache(maxsize=4096)
def _traced(fn: Callable[..., Any], keywords: tuple[tuple[str, Any], ...], signature: tuple):
    structs = [
        jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in signature
    ]
    return jax.make_jaxpr(functools.partial(fn, **dict(keywords)))(*structs)


def _inline(
    fn: Callable[..., Any],
    args: Sequence[Atom],
    name_stack: str,
    phase: Phase = Phase.FORWARD,
    **keywords: Any,
) -> tuple[list[Op], Value]:
    """``fn(*args, **keywords)`` as ops over ``args`` in ``phase`` (traced once per signature)."""
    signature = tuple(
        (tuple(a.aval.shape), a.aval.dtype, bool(getattr(a.aval, "weak_type", False))) for a in args
    )
    closed = _traced(fn, tuple(sorted(keywords.items())), signature)
    ops, (result,) = inline_jaxpr(closed, args, name_stack, phase)
    return ops, result


def take_chunk(
    value: Atom,
    split: Split,
    batch_size: int,
    n: int,
    chunk: int,
    name_stack: str,
    phase: Phase = Phase.FORWARD,
) -> tuple[list[Op], Value]:
    """Ops that cut chunk ``chunk`` of ``n`` out of a split value."""
    rows = batch_size // n * split.inner
    return _inline(
        _take,
        [value],
        name_stack,
        phase,
        axis=split.axis,
        outer=split.outer,
        start=chunk * rows,
        rows=rows,
    )


def take_slice(
    value: Atom, axis: int, n: int, name_stack: str, phase: Phase = Phase.FORWARD
) -> tuple[list[Op], Value]:
    """A ``1/n`` slice along ``axis`` of a value that is uniform along it."""
    rows = value.aval.shape[axis] // n
    return _inline(_take, [value], name_stack, phase, axis=axis, outer=1, start=0, rows=rows)


def join_chunks(
    chunks: Sequence[Value], split: Split, name_stack: str, phase: Phase = Phase.FORWARD
) -> tuple[list[Op], Value]:
    """Ops that reassemble a split value from its chunks."""
    return _inline(_join, chunks, name_stack, phase, axis=split.axis, outer=split.outer)


def apply_carry(
    local: Value, previous: Value, axis: int, combine: str, name_stack: str
) -> tuple[list[Op], Value]:
    return _inline(_carry, [local, previous], name_stack, axis=axis, combine=combine)
