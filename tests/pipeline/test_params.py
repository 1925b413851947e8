"""Blocks stacked by pipeline stage: element [v, s] of position j is layer (v P + s) L + j
(with uneven chunks, the chunk's first layer + j, or padding), the stage dimension split
over the pipeline axis, and every parameter-shaped tree of a state converts between
layouts without a change to any value."""

import chex
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from jaxmoe.pipeline.params import (
    STAGE_BLOCKS,
    StageLayout,
    stack_blocks,
    stacked_specs,
    to_layout,
    unstack_blocks,
)

LAYERS = 8


def _params():
    blocks = {
        layer: {
            "w": np.full((3, 2), layer, np.float32),
            "b": np.arange(2, dtype=np.float32) + 10 * layer,
        }
        for layer in range(LAYERS)
    }
    return {"blocks": blocks, "token_embed": {"embedding": np.ones((5, 2), np.float32)}}


@pytest.mark.parametrize(("stages", "virtual"), [(2, 1), (2, 2), (4, 2), (8, 1)])
def test_stacking_puts_each_layer_on_its_chunks_stage(stages, virtual):
    layout = StageLayout.even(stages, virtual, LAYERS // (stages * virtual))
    stacked = stack_blocks(_params(), layout)
    assert "blocks" not in stacked and set(stacked[STAGE_BLOCKS]) == set(range(layout.per_chunk))
    for j, tree in stacked[STAGE_BLOCKS].items():
        assert tree["w"].shape == (virtual, stages, 3, 2)
        for v in range(virtual):
            for s in range(stages):
                assert tree["w"][v, s, 0, 0] == (v * stages + s) * layout.per_chunk + j
    back = unstack_blocks(stacked, layout)
    chex.assert_trees_all_equal(back, _params())


def test_specs_split_the_stage_dimension_over_the_pipeline_axis():
    layout = StageLayout.even(2, 2, 2)
    specs = {
        "blocks": {layer: {"w": PartitionSpec("expert"), "b": PartitionSpec()} for layer in
                   range(LAYERS)},
        "head": PartitionSpec(),
    }  # fmt: skip
    stacked = stacked_specs(specs, layout)
    assert stacked["head"] == PartitionSpec()
    assert stacked[STAGE_BLOCKS][1]["w"] == PartitionSpec(None, "pipeline", "expert")
    assert stacked[STAGE_BLOCKS][0]["b"] == PartitionSpec(None, "pipeline")
    specs["blocks"][5]["w"] = PartitionSpec()
    with pytest.raises(ValueError, match="layer 5 is laid out unlike layer 1"):
        stacked_specs(specs, layout)


def test_every_parameter_shaped_tree_of_a_state_changes_layout():
    params = _params()
    state = (params, optax.adam(1e-3).init(params), {"blocks": {0: 1.0}})  # the last: kept
    two, four = StageLayout.even(2, 2, 2), StageLayout.even(4, 1, 2)
    on_two = to_layout(state[:2], None, two)
    assert on_two[1][0].mu[STAGE_BLOCKS][0]["w"].shape == (2, 2, 3, 2)
    on_four = to_layout(on_two, two, four)
    assert on_four[0][STAGE_BLOCKS][1]["w"].shape == (1, 4, 3, 2)
    chex.assert_trees_all_equal(to_layout(on_four, four, None), state[:2])
    assert to_layout(state, None, None) is state


def test_uneven_chunks_pad_the_shorter_ones_and_drop_the_padding_back():
    # Chunks of 1, 3, 2 and 2 layers: chunk c = v x 2 + s on stage s.
    layout = StageLayout(2, 2, (1, 3, 2, 2))
    assert (layout.per_chunk, layout.num_layers) == (3, 8)
    stacked = stack_blocks(_params(), layout)[STAGE_BLOCKS]
    assert set(stacked) == {0, 1, 2}
    first = {0: 0, 1: 1, 2: 4, 3: 6}  # each chunk's first layer
    for j, tree in stacked.items():
        for v in range(2):
            for s in range(2):
                chunk = v * 2 + s
                expected = first[chunk] + j if j < layout.counts[chunk] else 0.0
                assert tree["w"][v, s, 0, 0] == expected
                assert (tree["b"][v, s] == 0).all() == (j >= layout.counts[chunk])
    chex.assert_trees_all_equal(unstack_blocks(stack_blocks(_params(), layout), layout), _params())
    even = StageLayout.even(2, 2, 2)
    moved = to_layout(to_layout(_params(), None, layout), layout, even)
    chex.assert_trees_all_equal(moved, stack_blocks(_params(), even))
    with pytest.raises(ValueError, match="need 4 chunks"):
        StageLayout(2, 2, (4, 4))
