"""Partition rules, one primitive at a time, checked against running the op on chunks."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from scheduling.passes.chunk_ops import chunk_aval, chunk_copy
from scheduling.program import jax_adapter
from scheduling.program.capture import Op, Phase, Value, inline_jaxpr
from scheduling.program.partition_rules import Split, chunking

IN_BOUNDS = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS


def _single_op(fn, *shapes, dtype=jnp.float32):
    """The one interesting op of ``fn`` (the last equation), with its input values."""
    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, dtype) for s in shapes))
    inputs = [Value(v.aval) for v in closed.jaxpr.invars]
    ops, _ = inline_jaxpr(closed, inputs, "", Phase.FORWARD)
    return ops[-1]


def _check_against_chunks(fn, shapes, layouts, n, dtype=jnp.float32, uniform=None, arrays=None):
    """Run the op's chunk copy on each chunk and compare with chunks of the whole result
    (``uniform``: the axes along which each input is the same, where not split; ``arrays``:
    the inputs, else random integers)."""
    op = _single_op(fn, *shapes, dtype=dtype)
    how = chunking(op, layouts, uniform or [frozenset()] * len(layouts))
    assert how is not None
    rng = np.random.default_rng(0)
    if arrays is None:
        arrays = [jnp.asarray(rng.integers(0, 5, s), dtype) for s in shapes]
    whole = jax_adapter.bind_equation(op.eqn, arrays)
    for chunk in range(n):
        pieces, chunk_inputs = [], []
        for atom, array, cut, layout in zip(op.inputs, arrays, how.inputs, layouts, strict=True):
            if cut is None:
                pieces.append(array)
                chunk_inputs.append(atom)
            else:
                pieces.append(take_chunk(array, layout or Split(cut), n, chunk))
                chunk_inputs.append(Value(chunk_aval(atom.aval, cut, n)))
        copy = chunk_copy(op, how, n, chunk_inputs)
        results = jax_adapter.bind_equation(copy.eqn, pieces)
        for result, expected, split in zip(results, whole, how.outputs, strict=True):
            np.testing.assert_array_equal(result, take_chunk(expected, split, n, chunk))
    return how


def take_chunk(array, split: Split, n: int, chunk: int):
    """The rows of chunk ``chunk`` of ``n`` of an array laid out by ``split``."""
    shape = array.shape
    axis = split.axis
    grouped = array.reshape((*shape[:axis], split.outer, -1, *shape[axis + 1 :]))
    rows = grouped.shape[axis + 1] // n
    taken = grouped[(slice(None),) * (axis + 1) + (slice(chunk * rows, (chunk + 1) * rows),)]
    return taken.reshape((*shape[:axis], -1, *shape[axis + 1 :]))


def test_elementwise_with_broadcast_operands():
    how = _check_against_chunks(lambda x, y: x * y, [(4, 3, 5), (1, 3, 5)], [Split(0), None], n=2)
    assert how.inputs == (0, None)


def test_an_optimization_barrier_chunks_each_operand_as_its_result():
    how = _check_against_chunks(
        lambda x, y: jax.lax.optimization_barrier((x, y)),
        [(4, 3), (2, 4)],
        [Split(0), Split(1)],
        n=2,
    )
    assert how.outputs == (Split(0), Split(1))
    op = _single_op(lambda x, y: jax.lax.optimization_barrier((x, y)), (4, 3), (4, 3))
    assert chunking(op, [Split(0), None], [frozenset()] * 2) is None


def test_reshape_that_merges_the_batch_with_a_later_axis():
    how = _check_against_chunks(lambda x: x.reshape(24, 5), [(4, 6, 5)], [Split(0)], n=2)
    assert how.outputs == (Split(0, 1, 6),)


def test_reshape_of_a_batch_in_the_middle_of_an_axis():
    # [outer 2, batch 4, inner 3] along axis 1 -> split into (8, 3): batch is in axis 0.
    how = _check_against_chunks(
        lambda x: x.reshape(5, 8, 3), [(5, 24)], [Split(1, outer=2, inner=3)], n=4
    )
    assert how.outputs == (Split(1, outer=2, inner=1),)


def test_reshape_that_straddles_the_batch_has_no_rule():
    op = _single_op(lambda x: x.reshape(2, 10), (4, 5))  # batch 4 -> 2 x (2 of 5)
    assert chunking(op, [Split(0)], [frozenset()]) is None


def test_transpose_and_dot_general_batch_and_free_axes():
    _check_against_chunks(lambda x: x.transpose(2, 0, 1), [(4, 3, 5)], [Split(0)], n=2)
    how = _check_against_chunks(lambda x, w: x @ w, [(4, 3, 5), (5, 2)], [Split(0), None], n=4)
    assert how.outputs == (Split(0),)
    how = _check_against_chunks(
        lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), [(4, 3, 2), (4, 3, 2)], [Split(0)] * 2, n=2
    )
    assert how.outputs == (Split(0),)


def test_contracting_or_reducing_over_the_batch_has_no_rule():
    dot = _single_op(lambda x, w: jnp.einsum("bd,be->de", x, w), (4, 3), (4, 2))
    assert chunking(dot, [Split(0), Split(0)], [frozenset()] * 2) is None
    total = _single_op(lambda x: x.sum(0), (4, 3))
    assert chunking(total, [Split(0)], [frozenset()]) is None
    _check_against_chunks(lambda x: x.sum(1), [(4, 3)], [Split(0)], n=2)


def test_prefix_along_another_axis_and_along_the_batch():
    how = _check_against_chunks(lambda x: jnp.cumsum(x, 1), [(4, 3)], [Split(0)], n=2)
    assert how.carry is None
    op = _single_op(lambda x: jnp.cumsum(x, 0), (4, 3))
    assert chunking(op, [Split(0)], [frozenset()]).carry == "add"
    assert chunking(op, [Split(0, outer=2)], [frozenset()]) is None  # not contiguous


def test_top_k_and_slice():
    _check_against_chunks(lambda x: jax.lax.top_k(x, 2)[1], [(4, 6)], [Split(0)], n=2)
    _check_against_chunks(lambda x: x[:, 1:4], [(4, 6)], [Split(0)], n=2)
    op = _single_op(lambda x: x[1:3], (4, 6))
    assert chunking(op, [Split(0)], [frozenset()]) is None


def test_a_dynamic_slice_along_another_axis_keeps_the_batch():
    # A device's slice of the sequence (axis 1), as sequence parallelism takes it; the
    # index is a traced scalar, like the tensor rank.
    def traced(axis):
        closed = jax.make_jaxpr(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, 2, axis=axis))(
            jax.ShapeDtypeStruct((4, 6), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
        )
        inputs = [Value(v.aval) for v in closed.jaxpr.invars]
        return inline_jaxpr(closed, inputs, "", Phase.FORWARD)[0][-1]

    op = traced(axis=1)
    indices = len(op.inputs) - 1
    how = chunking(op, [Split(0)] + [None] * indices, [frozenset()] * (1 + indices))
    assert how is not None and how.inputs[0] == 0 and how.outputs == (Split(0),)
    assert how.params(2)["slice_sizes"] == (2, 2)
    x = jnp.arange(24.0).reshape(4, 6)
    index_values = [getattr(atom, "value", 3) for atom in op.inputs[1:]]  # rows 0, column 3
    for chunk in range(2):
        inputs = [Value(chunk_aval(op.inputs[0].aval, 0, 2)), *op.inputs[1:]]
        copy = chunk_copy(op, how, 2, inputs)
        rows = x[2 * chunk : 2 * chunk + 2]
        (result,) = jax_adapter.bind_equation(copy.eqn, [rows, *index_values])
        np.testing.assert_array_equal(result, rows[:, 3:5])
    # A slice that cuts the batch itself has no rule.
    op = traced(axis=0)
    indices = len(op.inputs) - 1
    assert chunking(op, [Split(0)] + [None] * indices, [frozenset()] * (1 + indices)) is None


def test_gather_of_rows_by_split_indices():
    numbers = jax.lax.GatherDimensionNumbers(
        offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0,)
    )

    def gather(table, index):
        return jax.lax.gather(table, index, numbers, slice_sizes=(1, 3), mode=IN_BOUNDS)

    _check_against_chunks(gather, [(7, 3), (4, 5, 1)], [None, Split(0)], n=2, dtype=jnp.int32)


def test_batched_gather_and_scatter_add():
    gather_numbers = jax.lax.GatherDimensionNumbers(
        offset_dims=(2,),
        collapsed_slice_dims=(1,),
        start_index_map=(1,),
        operand_batching_dims=(0,),
        start_indices_batching_dims=(0,),
    )

    def gather(values, index):
        return jax.lax.gather(values, index, gather_numbers, (1, 1, 2), mode=IN_BOUNDS)

    _check_against_chunks(
        gather, [(4, 6, 2), (4, 3, 1)], [Split(0), Split(0)], n=2, dtype=jnp.int32
    )
    scatter_numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2,),
        inserted_window_dims=(1,),
        scatter_dims_to_operand_dims=(1,),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )

    def scatter_add(buffer, index, updates):
        return jax.lax.scatter_add(buffer, index, updates, scatter_numbers, mode=IN_BOUNDS)

    _check_against_chunks(
        scatter_add,
        [(4, 6, 2), (4, 3, 1), (4, 3, 2)],
        [Split(0), Split(0), Split(0)],
        n=2,
        dtype=jnp.int32,
    )


def test_a_scatter_of_the_same_updates_into_each_rows_own_buffer():
    """Positions ``0 .. 5`` written into each row's slots (the dispatch's slots inverted):
    the buffer and the updates, the same for every row, are cut where they are uniform."""
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(),
        inserted_window_dims=(1,),
        scatter_dims_to_operand_dims=(1,),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )

    def scatter(buffer, index, updates):
        return jax.lax.scatter(buffer, index, updates, numbers, mode=IN_BOUNDS)

    rng = np.random.default_rng(0)
    slots = np.stack([rng.permutation(9)[:6] for _ in range(4)])[..., None]  # distinct a row
    arrays = [jnp.full((4, 9), 6), jnp.asarray(slots), jnp.tile(jnp.arange(6), (4, 1))]
    uniform = [frozenset({0}), frozenset(), frozenset({0})]
    how = _check_against_chunks(
        scatter, [(4, 9), (4, 6, 1), (4, 6)], [None, Split(0), None], 2, jnp.int32, uniform, arrays
    )
    assert how.inputs == (0, 0, 0) and how.outputs == (Split(0),)
    # Updates that differ along the rows but are not split cannot be cut.
    op = _single_op(scatter, (4, 9), (4, 6, 1), (4, 6), dtype=jnp.int32)
    assert chunking(op, [None, Split(0), None], [frozenset({0}), frozenset(), frozenset()]) is None


def test_uniform_operand_is_cut_and_others_are_refused():
    op = _single_op(lambda x, y: x + y, (4, 3), (4, 3))
    assert chunking(op, [Split(0), None], [frozenset(), frozenset({0})]).inputs == (0, 0)
    assert chunking(op, [Split(0), None], [frozenset(), frozenset()]) is None


def test_cudnn_fused_attention_chunks_along_the_whole_leading_batch():
    # cuDNN's attention cannot be traced without a GPU: its equation stands in by name.
    def value(*shape):
        return Value(jax.core.ShapedArray(shape, jnp.bfloat16))

    query, key, val = value(4, 16, 8, 64), value(4, 16, 2, 64), value(4, 16, 2, 64)
    absent_bias, lengths = value(0), value(4)
    eqn = SimpleNamespace(
        primitive=SimpleNamespace(name="dot_product_attention_fwd_wrapper"), params={}
    )
    outputs = (value(4, 16, 8, 64), value(4, 8, 16))  # the output, the softmax statistics
    op = Op(0, eqn, (query, key, val, absent_bias, lengths), outputs, "")
    uniform = [frozenset()] * 4 + [frozenset({0})]

    how = chunking(op, [Split(0)] * 3 + [None, None], uniform)

    assert how is not None and how.inputs == (0, 0, 0, None, 0)
    assert how.outputs == (Split(0), Split(0))
    # A batch folded with another factor (after an all-to-all) is not the leading rows.
    assert chunking(op, [Split(0, outer=2)] * 3 + [None, None], uniform) is None
    # Lengths that differ along the batch cannot be read whole.
    assert chunking(op, [Split(0)] * 3 + [None, None], [frozenset()] * 5) is None


def test_a_reshape_keeps_what_it_reshapes_uniform():
    """A fill reshaped is a fill (RMSNorm's epsilon, broadcast then given a trailing axis
    of 1); a reshape that adds or drops axes of size 1 keeps the uniform axes it carries;
    one that merges a uniform axis with another keeps none."""
    from scheduling.program.uniform_axes import uniform_axes

    fill = _single_op(lambda x: jnp.reshape(x, (4, 6, 1)), (4, 6))
    assert uniform_axes(fill, [frozenset({0, 1})]) == [frozenset({0, 1, 2})]
    added = _single_op(lambda x: jnp.reshape(x, (4, 1, 6)), (4, 6))
    assert uniform_axes(added, [frozenset({1})]) == [frozenset({1, 2})]
    squeezed = _single_op(lambda x: jnp.squeeze(x, 1), (4, 1, 6))
    assert uniform_axes(squeezed, [frozenset({0})]) == [frozenset({0})]
    merged = _single_op(lambda x: jnp.reshape(x, (24,)), (4, 6))
    assert uniform_axes(merged, [frozenset({1})]) == [frozenset()]


def _traced_update():
    """``dynamic_update_slice`` of a ``[tiles, batch, 3]`` carry with one tile at a traced
    index, as a loop over tiles writes its output."""

    def write(out, tile, i):
        return jax.lax.dynamic_update_index_in_dim(out, tile, i, 0)

    closed = jax.make_jaxpr(write)(
        jax.ShapeDtypeStruct((2, 4, 3), jnp.float32),
        jax.ShapeDtypeStruct((4, 3), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    inputs = [Value(v.aval) for v in closed.jaxpr.invars]
    return inline_jaxpr(closed, inputs, "", Phase.FORWARD)[0][-1]


def test_a_tile_written_into_every_row_keeps_the_batch():
    op = _traced_update()
    assert op.primitive == "dynamic_update_slice"
    indices = len(op.inputs) - 2
    layouts = [Split(1), Split(1)] + [None] * indices
    how = chunking(op, layouts, [frozenset()] * len(layouts))
    assert how is not None and how.inputs[:2] == (1, 1) and how.outputs == (Split(1),)
    out = jnp.arange(24.0).reshape(2, 4, 3)
    tile = -jnp.arange(12.0).reshape(1, 4, 3)
    index_values = [getattr(atom, "value", 1) for atom in op.inputs[2:]]  # tile 1
    (whole,) = jax_adapter.bind_equation(op.eqn, [out, tile, *index_values])
    for chunk in range(2):
        rows = slice(2 * chunk, 2 * chunk + 2)
        (result,) = jax_adapter.bind_equation(op.eqn, [out[:, rows], tile[:, rows], *index_values])
        np.testing.assert_array_equal(result, whole[:, rows])
    # Zeros to write into (not split, uniform) are cut; an operand that is neither, not.
    uniform = [frozenset({0, 1, 2}), frozenset()] + [frozenset()] * indices
    assert chunking(op, [None, Split(1)] + [None] * indices, uniform).inputs[:2] == (1, 1)
    assert chunking(op, [None, Split(1)] + [None] * indices, [frozenset()] * 5) is None


def test_slices_and_updates_of_uniform_values_are_uniform():
    from scheduling.program.uniform_axes import uniform_axes

    sliced = _single_op(lambda x: jax.lax.dynamic_index_in_dim(x, 1, keepdims=True), (2, 4, 3))
    assert uniform_axes(sliced, [frozenset({1}), frozenset()]) == [frozenset({0, 1})]
    op = _traced_update()
    flat = [frozenset({1, 2}), frozenset({1})] + [frozenset()] * (len(op.inputs) - 2)
    assert uniform_axes(op, flat) == [frozenset({1})]  # the tile covers all of axis 1
