"""Estimates of a deep model from two shallow ones: what the planner reads off one
repeating block of layers.

A model of ``num_layers`` layers whose FFN is an MoE every ``moe_every`` layers is
``num_layers / moe_every`` copies of one block (``moe_every - 1`` dense layers, then
an MoE layer) between the same embedding and head; leading dense layers
(``first_dense_layers``, DeepSeek's) stand with the embedding, before the copies. A
quantity that each block adds
to in the same measure — parameters, optimizer state, saved activations, and the
simulated step when blocks run one after another — is therefore affine in the block
count ``n``::

    q(n) = q(1) + (n - 1) * (q(2) - q(1))

so tracing the model with one and with two blocks gives the deep model's figure,
(with a pipeline, one and two blocks in each chunk of its layers: a device runs its
chunks' blocks, every chunk alike),
at the price of two shallow traces instead of one deep one (Mixtral-shaped models
have 56 layers; one of their traces takes tens of seconds, a one-block trace about
one). It is exact where the blocks are alike and run in sequence: the ``none``
schedule, and the memory of every schedule. Where a schedule overlaps work across
block boundaries, or the gradient sync packs buckets across blocks, the deep
model's step differs from the line by what happens at the boundaries; the planner's
tests measure that difference against full traces.
"""

from __future__ import annotations

import dataclasses

from jaxmoe.config import Config

# Fewer blocks than this are traced whole: two shallow traces would cost as much.
MIN_BLOCKS = 3


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
    """Whether the planner estimates ``config`` from one- and two-block traces."""
    blocks = block_count(config)
    return blocks is not None and blocks >= MIN_BLOCKS


def with_blocks(config: Config, blocks: int) -> Config:
    """``config`` with its model cut (or grown) to ``blocks`` repeating blocks (in each
    chunk of a pipeline's layers)."""
    values = config.to_dict()
    model = config.model
    repeating = blocks * model.moe_every * config.parallel.chunks
    values["model"]["num_layers"] = model.first_dense_layers + repeating
    values["parallel"]["chunk_layers"] = None  # equal chunks (see block_count)
    return Config.from_dict(values)


def extrapolate[Numbers](one_block: Numbers, two_blocks: Numbers, blocks: int) -> Numbers:
    """The figures of a ``blocks``-block model from those of one and two blocks (``Numbers``:
    a dataclass whose fields are all numbers).

    Integer fields (bytes) stay integers: their per-block step is an exact integer."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks}: a model has at least one block")
    fields = {}
    for field in dataclasses.fields(one_block):  # type: ignore[arg-type]
        first = getattr(one_block, field.name)
        second = getattr(two_blocks, field.name)
        fields[field.name] = first + (blocks - 1) * (second - first)
    return dataclasses.replace(one_block, **fields)  # type: ignore[type-var]
