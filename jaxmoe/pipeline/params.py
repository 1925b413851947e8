"""The blocks' parameters stacked by pipeline stage, and back.

The model's parameters (``nnx.to_pure_dict`` of :class:`~jaxmoe.layers.GPTMoE`) hold the
blocks as ``params["blocks"][layer]``. Under ``parallel.pipeline`` P with
``parallel.virtual_stages`` V the train state holds them as ``params["stage_blocks"][j]``
instead: for each position ``j`` in a chunk, every array of that block stacked into
``[V, P, *shape]``, element ``[v, s]`` being the ``j``-th layer of chunk ``c = v P + s``
(on stage ``s``, see :mod:`jaxmoe.pipeline.ticks`). The stage dimension is
split over the ``pipeline`` mesh axis, so a device holds its stage's V chunks,
``[V, 1, *shape]``, and nothing of the others: parameters, gradients and optimizer moments
of ``1 / P`` of the blocks. Every chunk position holds blocks of one structure (the
configuration checks it), which is what stacking needs.

**Uneven chunks** (``parallel.chunk_layers``): chunk ``c`` holds ``counts[c]`` consecutive
layers and the stack has as many positions as the longest chunk. A shorter chunk's
positions past its layers are *padding*: stacked zeros that no layer owns, which the
pipeline skips (their output is the input, their gradients zero) and which
:func:`unstack_blocks` drops.

Everything outside the blocks (embeddings, final norm, output head) keeps its place and
its spec: replicated over the pipeline axis, its gradient summed over it like over any
axis it is not split over (:mod:`jaxmoe.parallel.sharding`); a stacked block's spec
names the pipeline axis, so its gradient is not.

The other trees shaped like the parameters (the optimizer's moments, a gradient-sync
state) are converted alike by :func:`convert_param_trees`; checkpoints use it to restore
a state saved in one pipeline layout into another. Under ``train.zero`` 1 a stacked
block is sharded over its replicas as its layers are (:func:`stacked_zero_layout`), so a
checkpoint holds the same global arrays in every layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.config.layout import PIPELINE as PIPELINE_AXIS
from jaxmoe.parallel.zero import ShardLayout, ZeroLayout

BLOCKS = "blocks"
STAGE_BLOCKS = "stage_blocks"


@dataclass(frozen=True)
class StageLayout:
    """``stages`` x ``virtual`` chunks of consecutive layers, chunk ``c`` holding
    ``counts[c]`` of them (chunk ``v x stages + s`` on stage ``s``)."""

    stages: int
    virtual: int
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.counts) != self.chunks or min(self.counts) < 1:
            raise ValueError(f"{self.counts}: need {self.chunks} chunks of at least one layer")

    @classmethod
    def even(cls, stages: int, virtual: int, per_chunk: int) -> StageLayout:
        return cls(stages, virtual, (per_chunk,) * (stages * virtual))

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def per_chunk(self) -> int:
        """Positions in the stack: the longest chunk's layers."""
        return max(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    def offset(self, chunk: int) -> int:
        """The model's index of ``chunk``'s first layer."""
        return sum(self.counts[:chunk])

    def holds(self, virtual: int, stage: int, position: int) -> bool:
        """Whether the chunk's ``position`` is a layer (not padding)."""
        return position < self.counts[virtual * self.stages + stage]

    def layer(self, virtual: int, stage: int, position: int) -> int:
        """The model's index of the layer at the chunk's ``position`` (one it holds)."""
        return self.offset(virtual * self.stages + stage) + position

    def chunk_slots(self) -> list[tuple[int, int]]:
        """``(virtual, stage)`` of every chunk, in stacking order."""
        return [(v, s) for v in range(self.virtual) for s in range(self.stages)]


def layout_of(
    stages: int, virtual: int, chunk_layers: tuple[int, ...] | None, num_layers: int
) -> StageLayout | None:
    """The layout of a pipeline of ``stages`` x ``virtual`` chunks over ``num_layers``
    layers, cut as ``chunk_layers`` says (None: equal chunks); None without a pipeline."""
    if stages == 1:
        return None
    if chunk_layers is not None:
        return StageLayout(stages, virtual, tuple(chunk_layers))
    return StageLayout.even(stages, virtual, num_layers // (stages * virtual))


def stage_layout(parallel: ParallelConfig, num_layers: int) -> StageLayout | None:
    """The chunks of ``parallel``'s pipeline over ``num_layers`` layers (None without a
    pipeline; the configuration has checked that they cover the layers)."""
    return layout_of(
        parallel.pipeline, parallel.virtual_stages, parallel.chunk_layer_counts, num_layers
    )


def is_stacked(params: Any) -> bool:
    return isinstance(params, dict) and STAGE_BLOCKS in params


def _is_param_tree(x: Any) -> bool:
    return isinstance(x, dict) and (BLOCKS in x or STAGE_BLOCKS in x)


def stack_blocks(params: dict, layout: StageLayout) -> dict:
    """``params["blocks"]`` -> ``params["stage_blocks"]`` (see the module docstring;
    padding positions are zeros shaped like the position's layers)."""
    blocks = params[BLOCKS]
    if len(blocks) != layout.num_layers:
        raise ValueError(f"{len(blocks)} blocks for {layout.num_layers} pipelined layers")
    stacked = {}
    for j in range(layout.per_chunk):
        held = [
            blocks[layout.layer(v, s, j)] for v, s in layout.chunk_slots() if layout.holds(v, s, j)
        ]
        padding = jax.tree.map(jnp.zeros_like, held[0])
        row = [
            blocks[layout.layer(v, s, j)] if layout.holds(v, s, j) else padding
            for v, s in layout.chunk_slots()
        ]
        stacked[j] = jax.tree.map(
            lambda *leaves: jnp.stack(leaves).reshape(
                layout.virtual, layout.stages, *leaves[0].shape
            ),
            *row,
        )
    rest = {key: value for key, value in params.items() if key != BLOCKS}
    return {**rest, STAGE_BLOCKS: stacked}


def unstack_blocks(params: dict, layout: StageLayout) -> dict:
    """``params["stage_blocks"]`` -> ``params["blocks"]``: the inverse of
    :func:`stack_blocks` (padding dropped)."""
    stacked = params[STAGE_BLOCKS]
    blocks = {}
    for j, tree in stacked.items():
        for v, s in layout.chunk_slots():
            if layout.holds(v, s, j):
                blocks[layout.layer(v, s, j)] = jax.tree.map(lambda a, v=v, s=s: a[v, s], tree)
    rest = {key: value for key, value in params.items() if key != STAGE_BLOCKS}
    return {**rest, BLOCKS: dict(sorted(blocks.items()))}


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def stacked_tree(
    tree: dict,
    layout: StageLayout,
    leaf: Callable[[Any], Any] = lambda x: x,
    is_leaf: Callable[[Any], bool] | None = None,
) -> dict:
    """A tree that describes the model's parameters leaf by leaf (specs, shard layouts,
    dtype names), in the stacked structure: position ``j`` of ``stage_blocks`` is the
    first layer at ``j`` with ``leaf`` applied to each leaf. Refused where the layers at
    a position are described unlike (pipelined chunks hold alike blocks)."""
    blocks = tree[BLOCKS]
    stacked = {}
    for j in range(layout.per_chunk):
        layers = [layout.layer(v, s, j) for v, s in layout.chunk_slots() if layout.holds(v, s, j)]
        first = blocks[layers[0]]
        for layer in layers[1:]:
            if blocks[layer] != first:
                raise ValueError(
                    f"layer {layer} is laid out unlike layer {layers[0]}: pipelined chunks "
                    "must hold alike blocks"
                )
        stacked[j] = jax.tree.map(leaf, first, is_leaf=is_leaf)
    rest = {key: value for key, value in tree.items() if key != BLOCKS}
    return {**rest, STAGE_BLOCKS: stacked}


def stacked_specs(specs: dict, layout: StageLayout, stage_axis: str | None = PIPELINE_AXIS) -> dict:
    """The specs of the stacked parameters from the model's: a stacked block's spec is
    its layer's with ``(None, stage_axis)`` in front (``stage_axis`` None: the stacked
    arrays on a mesh without a pipeline axis, every stage's chunks on every device)."""
    return stacked_tree(
        specs, layout, lambda spec: PartitionSpec(None, stage_axis, *spec), _is_spec
    )


def stacked_zero_layout(plan: ZeroLayout, blocks: ZeroLayout, layout: StageLayout) -> ZeroLayout:
    """The ZeRO layout of the stacked parameters (:mod:`jaxmoe.parallel.zero`) from two of
    the model's: ``plan`` for the parameters outside the blocks (replicated over the
    pipeline axis, so sharded over it too), ``blocks`` for the blocks, planned without the
    pipeline axis (a stacked block is split over it by stage). A stacked block is sharded
    as its layers are, on the same dimension of the layer, two further in (past the chunk
    and stage dimensions)."""

    def past_stacking(shards: ShardLayout) -> ShardLayout:
        if shards.dim is None:
            return shards
        return dataclasses.replace(shards, dim=shards.dim + 2)

    def merged(outside: dict, stacked: dict) -> dict:
        rest = {key: value for key, value in outside.items() if key != BLOCKS}
        return {**rest, STAGE_BLOCKS: stacked[STAGE_BLOCKS]}

    def is_shards(x: Any) -> bool:
        return isinstance(x, ShardLayout)

    return ZeroLayout(
        plan.stage,
        layouts=merged(
            plan.layouts, stacked_tree(blocks.layouts, layout, past_stacking, is_shards)
        ),
        model_specs=merged(plan.model_specs, stacked_specs(blocks.model_specs, layout)),
        specs=merged(plan.specs, stacked_specs(blocks.specs, layout)),
        gather_dtypes=merged(plan.gather_dtypes, stacked_tree(blocks.gather_dtypes, layout)),
        blocks_key=STAGE_BLOCKS,
    )


def unstacked_specs(specs: dict, layout: StageLayout) -> dict:
    """The model's specs from the stacked parameters': the inverse of
    :func:`stacked_specs`."""
    blocks = {}
    for j, tree in specs[STAGE_BLOCKS].items():
        spec = jax.tree.map(lambda stacked: PartitionSpec(*stacked[2:]), tree, is_leaf=_is_spec)
        for v, s in layout.chunk_slots():
            if layout.holds(v, s, j):
                blocks[layout.layer(v, s, j)] = spec
    rest = {key: value for key, value in specs.items() if key != STAGE_BLOCKS}
    return {**rest, BLOCKS: dict(sorted(blocks.items()))}


def convert_param_trees(tree: Any, convert: Callable[[dict], dict]) -> Any:
    """``tree`` with ``convert`` applied to every sub-tree shaped like the parameters (a
    dict holding ``blocks`` or ``stage_blocks``): the parameters themselves, the
    optimizer's moments, a gradient-sync state. Not for the model state (the expert
    biases, under ``blocks`` too, of the MoE layers alone), which keeps the model's
    layout."""
    return jax.tree.map(
        lambda x: convert(x) if _is_param_tree(x) else x, tree, is_leaf=_is_param_tree
    )


def to_layout_specs(
    specs: Any,
    source: StageLayout | None,
    target: StageLayout | None,
    stage_axis: str | None = PIPELINE_AXIS,
) -> Any:
    """The specs of :func:`to_layout`'s result from those of its ``tree`` (``stage_axis``:
    as in :func:`stacked_specs`)."""
    if source == target:
        return specs

    def convert(params: dict) -> dict:
        if source is not None:
            params = unstacked_specs(params, source)
        if target is not None:
            params = stacked_specs(params, target, stage_axis)
        return params

    return convert_param_trees(specs, convert)


def to_layout(tree: Any, source: StageLayout | None, target: StageLayout | None) -> Any:
    """Every parameter-shaped sub-tree of ``tree`` moved from the ``source`` layout to the
    ``target`` one (None: the model's own, unstacked)."""
    if source == target:
        return tree

    def convert(params: dict) -> dict:
        if source is not None:
            params = unstack_blocks(params, source)
        if target is not None:
            params = stack_blocks(params, target)
        return params

    return convert_param_trees(tree, convert)
