"""The model cut for the pipeline (:mod:`jaxmoe.pipeline.pipelined`): the parts outside the
blocks, and the blocks one chunk runs, with each block's place among the MoE layers.

Every chunk holds blocks of the same structure at each position (the configuration checks
it), so one chunk's code runs every chunk: the pipeline merges a position's block graph
with the chunk's stacked parameters (:mod:`jaxmoe.pipeline.params`). Built once
per model and layout, on abstract parameters: nothing is allocated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flax import nnx

from jaxmoe.config import Config, ModelConfig, MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers.router import ExpertBias
from jaxmoe.layers.shapes import abstract_model
from jaxmoe.pipeline.params import StageLayout
from jaxmoe.pipeline.ticks import TickTable


@dataclass(frozen=True)
class PipelineModel:
    """The model cut for the pipeline: the parts outside the blocks, and the blocks of one
    chunk (every chunk holds blocks of the same structure)."""

    layout: StageLayout
    ticks: TickTable
    outside: nnx.GraphDef  # the model without its blocks: embeddings, final norm, head
    blocks: tuple[nnx.GraphDef, ...]  # a chunk's blocks, in order (the longest chunk's)
    moe_rank: tuple[int | None, ...]  # each block's index among a chunk's MoE blocks
    # Per chunk, the model's MoE-layer index of each of its MoE blocks (0 for padding).
    moe_rows: tuple[tuple[int, ...], ...]

    @property
    def moe_per_chunk(self) -> int:
        return sum(rank is not None for rank in self.moe_rank)


def pipeline_model(
    config: Config, layout: StageLayout, experimental: ExperimentalOptions = DEFAULT
) -> PipelineModel:
    """``config``'s model cut for its pipeline's ``layout`` (on abstract parameters:
    nothing is allocated), its MoE layers built with the research options
    ``experimental`` (:mod:`jaxmoe.experimental`)."""
    train = config.train
    return _pipeline_model(
        config.model,
        config.moe,
        layout,
        train.microbatches,
        train.seed,
        experimental,
        config.parallel.context_exchange,
    )


@functools.lru_cache(maxsize=16)
def _pipeline_model(
    model: ModelConfig,
    moe: MoEConfig,
    layout: StageLayout,
    microbatches: int,
    seed: int,
    experimental: ExperimentalOptions,
    context_exchange: str,
) -> PipelineModel:
    # A module of its own (its blocks are taken out below), from the model's shapes as every
    # run of the model reads them: nothing is traced again.
    abstract = nnx.merge(*abstract_model(model, moe, seed, experimental, context_exchange))
    blocks, ranks, moe_blocks = [], [], 0
    for j in range(layout.per_chunk):
        # A layer at position j (chunks hold alike blocks at each position).
        v, s = next((v, s) for v, s in layout.chunk_slots() if layout.holds(v, s, j))
        block = abstract.blocks[layout.layer(v, s, j)]
        graphdef, _, _ = nnx.split(block, ExpertBias, ...)
        blocks.append(graphdef)
        ranks.append(moe_blocks if block.is_moe else None)
        moe_blocks += block.is_moe
    moe_layers = model.moe_layers
    moe_rows = tuple(
        tuple(
            moe_layers.index(layout.layer(v, s, j)) if layout.holds(v, s, j) else 0
            for j, rank in enumerate(ranks)
            if rank is not None
        )
        for v, s in layout.chunk_slots()
    )
    abstract.blocks = nnx.List([])
    outside, _, _ = nnx.split(abstract, ExpertBias, ...)
    return PipelineModel(
        layout=layout,
        ticks=TickTable(layout.stages, layout.virtual, microbatches),
        outside=outside,
        blocks=tuple(blocks),
        moe_rank=tuple(ranks),
        moe_rows=moe_rows,
    )
