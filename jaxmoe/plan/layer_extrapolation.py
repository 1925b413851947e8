"""Estimates of a deep model from two shallow ones: what the planner reads off one
repeating block of layers.

A model of ``num_layers`` layers whose FFN is an MoE every ``moe_every`` layers is
``num_layers / moe_every`` copies of one block (``moe_every - 1`` dense layers, then
an MoE layer) between the same embedding and head; leading dense layers
(``first_dense_layers``, DeepSeek's) stand with the embedding, before the copies (with a
pipeline, the copies in each chunk of its layers: a device runs its chunks' blocks, every
chunk alike). A quantity that each block adds to in the same measure (parameters,
optimizer state, saved activations, and the simulated step when blocks run one after
another) is affine in the block count ``n``.

The first and the last block of a step are not like those between them, though: the
first has no block before it to overlap with, and in the backward pass the last has no
later block whose weight gradients fill its windows; under ZeRO-3 a block prefetches the
next block's weights, which the last does not. So the model is traced with two blocks
and with three, whose difference is a block between two others, and::

    q(n) = q(2) + (n - 2) * (q(3) - q(2))

at the price of two shallow traces instead of one deep one (Mixtral-shaped models have
56 layers; their whole trace takes minutes, a three-block trace seconds). It is exact
where each block reaches no further than its neighbours. (The line through one and two
blocks took a boundary's effect as a block's: 2.4% over on Qwen2-57B-A14B at its recipe
under ``lancet``, whose one-, two-, three- and four-block steps differ by 130.3, 126.8
and 126.8 ms.) The planner's tests measure the line against whole traces.

A schedule's order can also differ between depths in kind, not in measure: where its dW
placements would hold more live bytes than its bound allows, some are withdrawn
(:mod:`scheduling.order.list_scheduler`), and the bound may bind at one traced depth and
not at the next. A line through those two takes the change for a block's (at its recipe,
Qwen2-57B-A14B's two-block ``pair`` step withdrew 1556 of 10891 placements and its
three-block step none: the slope came out 0.377 s a block against ``dw``'s 0.506 s, 6.9
points of MFU too optimistic at 28 layers). So a schedule's line is drawn through the
first two successive depths, from :data:`TRACED_BLOCKS` on, at which the bound withdrew
at both or at neither (:func:`agreeing_depth`), no deeper than :data:`MAX_TRACED_BLOCKS`.

A paired schedule (``pair``: :data:`scheduling.names.PAIRING`) reaches further still: it
merges passes of their whole length, and the shorter one beside another (a forward pass,
about half its backward pass) ends part of the way through it. Where a block falls
against that end depends on the depth, so no block is like the next. At Mixtral 8x22B's
recipe, pipelined (two stages of 28 blocks, 16 microbatches), when each pair of slots
was merged on its own, the third to the eighth block added 153.3, 159.0, 213.3, 159.9,
184.3 and 184.3 ms, and the line through two and three blocks was 10.1% under the
twelve-block trace (experiments/results/depth_line_paired.md). What a block adds settles
only on average over several blocks, so a paired schedule's line runs from the shallower
depth to :data:`PAIRED_LINE_DEPTH` blocks (:func:`line_depths`). With the whole step's
passes merged in one order (:mod:`scheduling.passes.pair_microbatches`) it is 1.4% over
the twelve-block trace there (the line through two and three: 2.0% under), and 0.05%
under it on Qwen2-57B-A14B's 16 paired microbatches at its recipe (two and three: 1.0%
over; experiments/results/depth_line_pair.md).

No line runs deeper than a step of :data:`MAX_LINE_OPS` ops (:func:`deepest_line_depth`):
the scheduler's memory grows with the square of a step's size, and a deep pipeline's
eight blocks a chunk in many microbatches are more than a host holds. There the line runs
to the deepest step within it, no shallower than three blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import scheduling
from jaxmoe.config import Config

# The depths a deep model is traced at, one block apart (module docstring).
TRACED_BLOCKS = (2, 3)
# The deepest a model is traced at to find two depths whose orders agree (module
# docstring); where none agree by then, the line runs through it and the depth before.
MAX_TRACED_BLOCKS = 5
# The most ops a step is traced with deeper than TRACED_BLOCKS, for a line (module
# docstring). The scheduler keeps each node's ancestors and descendants as sets of bits
# (scheduling.program.graph): about 3 N^2 / 16 bytes for N nodes, 4.2 GB at this many.
# Mixtral 8x22B in four pipeline stages of two chunks each and 32 microbatches, traced at
# the paired line's depth (seven blocks a chunk: the whole model), is about 380,000 ops,
# 27 GB of those sets for one graph. The deepest lines that this leaves as they were
# (Mixtral 8x22B's pipelined recipe mapping at eight blocks: 112,699 ops; Qwen2-57B-A14B's
# paired one: about 90,000) are inside it.
MAX_LINE_OPS = 150_000
# How the table says a deep model's depth was estimated.
DEPTH_METHOD = (
    "extrapolated from two- and three-block traces (two- and eight-block traces under pair, "
    f"shallower where a deeper step would exceed {MAX_LINE_OPS:,} ops)"
)
# The deeper depth of a paired schedule's line (module docstring), or the model's own
# where it is shallower.
PAIRED_LINE_DEPTH = 8
# A model of more blocks than the deeper trace's is estimated from the traces at
# TRACED_BLOCKS; one of no more is traced whole, which is exact and no deeper.
MIN_BLOCKS = TRACED_BLOCKS[-1] + 1
# A model of at least this many blocks is screened (jaxmoe.plan.bounds) from a one-block
# trace.
MIN_SCREENED_BLOCKS = 3


def block_count(config: Config) -> int | None:
    """How many repeating blocks ``config``'s model has (in each chunk of a pipeline's
    layers: every chunk holds as many), or None when its layers do not split into whole
    blocks (the last layer is then not an MoE layer).

    With uneven chunks (``parallel.chunk_layers``), the longest chunk's: every stage
    holds and runs that many, the shorter chunks padded (:mod:`jaxmoe.pipeline.pipelined`),
    so memory and step are those of equal chunks of that length (:func:`with_blocks`
    makes them equal). Only the model FLOPs, which the planner takes from the real
    model, tell the two apart."""
    model = config.model
    counts = config.parallel.chunk_layer_counts
    if model.first_dense_layers and config.parallel.chunks > 1:
        return None  # the leading dense layers make the first chunk unlike the others
    if counts is not None:
        longest = max(counts)
        return None if longest % model.moe_every else longest // model.moe_every
    per_block = model.moe_every * config.parallel.chunks
    repeating = model.num_layers - model.first_dense_layers
    if repeating % per_block:
        return None
    return repeating // per_block


def extrapolates(config: Config) -> bool:
    """Whether the planner estimates ``config`` from shallow traces (:data:`TRACED_BLOCKS`)."""
    return _blocks_at_least(config, MIN_BLOCKS)


def screens_shallow(config: Config) -> bool:
    """Whether the planner bounds ``config`` from a one-block trace."""
    return _blocks_at_least(config, MIN_SCREENED_BLOCKS)


def _blocks_at_least(config: Config, count: int) -> bool:
    blocks = block_count(config)
    return blocks is not None and blocks >= count


def with_blocks(config: Config, blocks: int) -> Config:
    """``config`` with its model cut (or grown) to ``blocks`` repeating blocks (in each
    chunk of a pipeline's layers)."""
    values = config.to_dict()
    model = config.model
    repeating = blocks * model.moe_every * config.parallel.chunks
    values["model"]["num_layers"] = model.first_dense_layers + repeating
    values["parallel"]["chunk_layers"] = None  # equal chunks (see block_count)
    return Config.from_dict(values)


def agreeing_depth(bound_withdrew: Callable[[int], bool], blocks: int) -> int:
    """The shallower of the two successive depths a ``blocks``-block model's line is drawn
    through: the first, from :data:`TRACED_BLOCKS` on, at which ``bound_withdrew`` (whether
    the live-bytes bound withdrew placements from the step of that many blocks) says the
    same of both; else the deepest pair, no deeper than :data:`MAX_TRACED_BLOCKS` or the
    model."""
    shallow = TRACED_BLOCKS[0]
    deepest = min(MAX_TRACED_BLOCKS, blocks)
    while shallow + 1 < deepest and bound_withdrew(shallow) != bound_withdrew(shallow + 1):
        shallow += 1
    return shallow


def deepest_line_depth(ops_at: Callable[[int], int], blocks: int) -> int:
    """The deepest a ``blocks``-block model is traced at for a line: where the line
    through its steps' sizes at :data:`TRACED_BLOCKS` (``ops_at``: the ops of the step
    traced at a depth) stays within :data:`MAX_LINE_OPS`; never shallower than the deeper
    of :data:`TRACED_BLOCKS`, never deeper than the model."""
    shallow, deeper = TRACED_BLOCKS
    first = ops_at(shallow)
    grows = ops_at(deeper) - first
    if grows <= 0:
        return blocks
    within = shallow + (MAX_LINE_OPS - first) // grows
    return min(blocks, max(deeper, within))


def line_depths(
    schedule: str,
    bound_withdrew: Callable[[int], bool],
    blocks: int,
    ops_at: Callable[[int], int] | None = None,
) -> tuple[int, int]:
    """The two depths ``schedule``'s line of a ``blocks``-block model runs through: from
    :func:`agreeing_depth`'s to the next, or for a paired schedule to
    :data:`PAIRED_LINE_DEPTH` (module docstring), no deeper than the model, nor than
    :func:`deepest_line_depth` where ``ops_at`` gives the steps' sizes (None: no limit)."""
    deepest = blocks if ops_at is None else deepest_line_depth(ops_at, blocks)
    shallow = agreeing_depth(bound_withdrew, deepest)
    if schedule in scheduling.names.PAIRING:
        return shallow, max(shallow + 1, min(PAIRED_LINE_DEPTH, deepest))
    return shallow, shallow + 1


def extrapolate[Numbers](
    shallow: Numbers,
    deeper: Numbers,
    blocks: int,
    shallow_blocks: int = TRACED_BLOCKS[0],
    deeper_blocks: int | None = None,
) -> Numbers:
    """The figures of a ``blocks``-block model from those of ``shallow_blocks`` blocks and
    ``deeper_blocks`` (by default one more: the two depths of :data:`TRACED_BLOCKS`;
    ``Numbers``: a dataclass whose fields are all numbers).

    Integer fields (bytes) stay integers: one block apart their per-block step is an exact
    integer; further apart they are rounded."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks}: a model has at least one block")
    span = 1 if deeper_blocks is None else deeper_blocks - shallow_blocks
    if span < 1:
        raise ValueError(f"deeper_blocks={deeper_blocks}: deeper than {shallow_blocks}")
    fields = {}
    for field in dataclasses.fields(shallow):  # type: ignore[arg-type]
        first = getattr(shallow, field.name)
        second = getattr(deeper, field.name)
        if span == 1:
            fields[field.name] = first + (blocks - shallow_blocks) * (second - first)
        else:
            grown = first + (blocks - shallow_blocks) * (second - first) / span
            fields[field.name] = round(grown) if isinstance(first, int) else grown
    return dataclasses.replace(shallow, **fields)  # type: ignore[type-var]
