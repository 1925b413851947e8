"""Partition rules of collectives over tuples of mesh axes, checked by running them on chunks.

Each case captures one collective from a per-device function on the folded toy
mesh (``data x expert x tensor_expert``, each of size 2), binds it inside a
``shard_map`` on the whole per-device operand and, as the rule says, on each row
chunk, and compares every chunk's result with the rows of the whole result that
the rule says belong to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.passes.chunk_ops import chunk_copy
from scheduling.program import jax_adapter
from scheduling.program.capture import capture
from scheduling.program.partition_rules import Split, chunking
from tests.scheduling.folding_toys import FOLDED
from tests.scheduling.program.test_partition_rules import take_chunk
from tests.scheduling.toys import put, sds

MESH = FOLDED.mesh
ALL_AXES = FOLDED.axis_names
TENSOR = FOLDED.tensor  # ('tensor_expert',)
EXPERT = FOLDED.expert  # ('expert', 'tensor_expert'): a group of 4
DEVICES = 8


def _on_every_device(per_device):
    """``per_device`` jitted under shard_map over every axis of the mesh, with two results."""
    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=MESH,
            in_specs=P(ALL_AXES),
            out_specs=(P(ALL_AXES), P(ALL_AXES)),
            check_vma=False,
        )
    )


def _collective(fn, shape):
    """The one collective of per-device ``fn`` applied to a ``shape`` operand."""
    program = capture(
        fn,
        sds(MESH, (DEVICES * shape[0], *shape[1:]), P(ALL_AXES)),
        mesh=MESH,
        in_specs=P(ALL_AXES),
        out_specs=P(ALL_AXES),
    )
    (op,) = program.collectives()
    return op


def _check_on_chunks(fn, shape, layout: Split, n: int):
    """The rule's chunk copies, run on every device, give the rows the rule promises."""
    op = _collective(fn, shape)
    how = chunking(op, [layout], [frozenset()])
    assert how is not None
    (cut,) = how.inputs
    (out_split,) = how.outputs

    def per_device(x):
        (whole,) = jax_adapter.bind_equation(op.eqn, [x])
        expected, got = [], []
        for chunk in range(n):
            piece = take_chunk(x, layout, n, chunk)
            copy = chunk_copy(op, how, n, [op.inputs[0]])
            (result,) = jax_adapter.bind_equation(copy.eqn, [piece])
            got.append(result)
            expected.append(take_chunk(whole, out_split, n, chunk))
        return jnp.stack(got)[None], jnp.stack(expected)[None]

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 9, (DEVICES * shape[0], *shape[1:])), jnp.float32)
    run = _on_every_device(per_device)
    got, expected = run(put(MESH, x, P(ALL_AXES)))
    assert cut == layout.axis
    np.testing.assert_array_equal(got, expected)
    return how


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_all_gather_over_the_tensor_axes_keeps_the_rows(n):
    # [rows, seq slice, d] gathered along the sequence: the rows stay on axis 0.
    how = _check_on_chunks(
        lambda x: jax.lax.all_gather(x, TENSOR, axis=1, tiled=True), (8, 3, 2), Split(0), n
    )
    assert how.outputs == (Split(0),)


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_reduce_scatter_over_the_tensor_axes_keeps_the_rows(n):
    how = _check_on_chunks(
        lambda x: jax.lax.psum_scatter(x, TENSOR, scatter_dimension=1, tiled=True),
        (8, 4, 2),
        Split(0),
        n,
    )
    assert how.outputs == (Split(0),)


def test_all_gather_over_an_axis_tuple_along_the_batch_adds_outer_blocks():
    # Four devices' pieces one after another: chunk c is rows c of every piece.
    how = _check_on_chunks(
        lambda x: jax.lax.all_gather(x, EXPERT, axis=1, tiled=True), (2, 8, 3), Split(1), 2
    )
    assert how.outputs == (Split(1, outer=4),)


def test_untiled_all_gather_moves_the_batch_past_the_group_axis():
    how = _check_on_chunks(
        lambda x: jax.lax.all_gather(x, EXPERT, axis=0, tiled=False), (8, 3), Split(0), 4
    )
    assert how.outputs == (Split(1),)


def test_reduce_scatter_along_whole_outer_blocks_of_the_batch():
    # The batch is the middle factor of [4, P, 1]; scattered over 2 devices, each keeps
    # two whole outer blocks.
    how = _check_on_chunks(
        lambda x: jax.lax.psum_scatter(x, TENSOR, scatter_dimension=1, tiled=True),
        (2, 16, 3),
        Split(1, outer=4),
        2,
    )
    assert how.outputs == (Split(1, outer=2),)


def test_psum_over_an_axis_tuple_keeps_the_rows():
    how = _check_on_chunks(lambda x: jax.lax.psum(x, EXPERT), (8, 3), Split(0), 2)
    assert how.outputs == (Split(0),)


def test_reduce_scatter_that_cuts_the_batch_has_no_rule():
    # Device i keeps rows [iP/2, (i+1)P/2): a chunk of rows would give it other examples.
    op = _collective(
        lambda x: jax.lax.psum_scatter(x, TENSOR, scatter_dimension=0, tiled=True), (8, 3)
    )
    assert chunking(op, [Split(0)], [frozenset()]) is None
    # With three outer blocks over two devices, the blocks are not whole either.
    op = _collective(
        lambda x: jax.lax.psum_scatter(x, TENSOR, scatter_dimension=0, tiled=True), (12, 3)
    )
    assert chunking(op, [Split(0, outer=3)], [frozenset()]) is None


def test_an_untiled_reduce_scatter_of_the_batch_axis_has_no_rule():
    op = _collective(lambda x: jax.lax.psum_scatter(x, TENSOR, scatter_dimension=0), (2, 3))
    assert chunking(op, [Split(0, outer=2)], [frozenset()]) is None


def test_a_chunked_reduce_scatter_of_the_batch_would_be_wrong():
    # Why the rule above refuses: chunk 0's scatter keeps other rows than the whole's.
    op = _collective(
        lambda x: jax.lax.psum_scatter(x, TENSOR, scatter_dimension=0, tiled=True), (4, 1)
    )

    def per_device(x):
        (whole,) = jax_adapter.bind_equation(op.eqn, [x])
        (first,) = jax_adapter.bind_equation(op.eqn, [x[:2]])
        return whole[None], first[None]

    x = jnp.arange(DEVICES * 4, dtype=jnp.float32).reshape(DEVICES * 4, 1)
    run = _on_every_device(per_device)
    whole, first = (np.asarray(a) for a in run(put(MESH, x, P(ALL_AXES))))
    # Device 1 of the pair keeps rows 2..3 of the sum; of chunk 0 it keeps row 1.
    assert not np.array_equal(first[1], whole[1][:1])
