"""The sequence group's split of a row: each device's two context chunks, then its tensor
slice of them; gathering the shares back gives the row in position order."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.config.layout import contiguous_positions
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.parallel.sequence_split import (
    context_slice,
    gather_positions,
    sequence_group_index,
    sequence_slice,
    sum_own_positions,
    zigzag_order,
)

# Context groups of 2 over tensor groups of 2: every device holds a quarter of each row.
LAYOUT = ParallelConfig(data=2, expert=4, context=2, tensor=2)


def _on_every_device(fn, x):
    mesh = build_mesh(LAYOUT)
    axes = tuple(mesh.axis_names)
    mapped = jax.shard_map(
        lambda x: jax.tree.map(lambda out: out[None], fn(x)),
        mesh=mesh,
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(axes),
        check_vma=False,
    )
    replicated = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return jax.tree.map(np.asarray, jax.jit(mapped)(replicated))


def test_the_zigzag_order_gives_device_c_chunks_c_and_2c_minus_1_minus_c():
    np.testing.assert_array_equal(zigzag_order(8, 2).reshape(2, 4), [[0, 1, 6, 7], [2, 3, 4, 5]])


def test_each_device_holds_its_chunks_slice_and_the_group_gathers_the_row_back():
    row = np.arange(2 * 16, dtype=np.int32).reshape(2, 16)

    def shares(x):
        return (
            sequence_group_index(),
            context_slice(x),
            sequence_slice(x),
            gather_positions(sequence_slice(x)),
        )

    index, chunks, local, gathered = _on_every_device(shares, row)
    for device in range(8):
        context, tensor = divmod(int(index[device]), 2)
        own = np.concatenate([np.arange(4) + 4 * context, np.arange(4) + 4 * (3 - context)])
        np.testing.assert_array_equal(chunks[device], row[:, own])
        np.testing.assert_array_equal(local[device], row[:, own[4 * tensor : 4 * tensor + 4]])
        np.testing.assert_array_equal(gathered[device], row)


def test_summing_own_positions_is_the_transpose_of_gathering_them():
    row = np.arange(2 * 16, dtype=np.float32).reshape(2, 16)

    def summed(x):
        # Each member of a sequence group holds a full-length row of its own.
        return sum_own_positions(x * (sequence_group_index() + 1))

    local = _on_every_device(summed, row)
    shares = _on_every_device(sequence_slice, row)
    # The four members' rows are 1x to 4x the row: their sum is 10x, cut into shares.
    np.testing.assert_array_equal(local, 10 * shares)


@pytest.mark.parametrize(
    ("seq_len", "context", "tensor", "runs"),
    [(64, 1, 4, 16), (64, 2, 1, 16), (64, 2, 2, 16), (64, 4, 2, 8), (48, 2, 3, 4)],
)
def test_a_share_is_cut_into_runs_of_consecutive_positions(seq_len, context, tensor, runs):
    assert contiguous_positions(seq_len, context, tensor) == runs
