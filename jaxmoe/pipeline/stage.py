"""What a pipeline's stages run alike in one SPMD program (:mod:`jaxmoe.pipeline.pipelined`):
per-stage values picked by the stage's index on the ``pipeline`` mesh axis, the
``ppermute`` that hands each stage's value to a neighbour, and the VJP of one of several
forward slots picked per stage.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxmoe.config.layout import PIPELINE as PIPELINE_AXIS


class Stage:
    """This device's stage (traced) and per-stage values of the tick table."""

    def __init__(self, stages: int):
        self.stages = stages
        self.index = jax.lax.axis_index(PIPELINE_AXIS)

    def pick(self, values: list[int]) -> int | jax.Array:
        """``values[stage]``: a constant where every stage has the same."""
        if len(set(values)) == 1:
            return values[0]
        return self.traced(values)

    def traced(self, values: list[int]) -> jax.Array:
        """``values[stage]``, traced even where every stage has the same."""
        return jnp.asarray(values, jnp.int32)[self.index]

    def where(self, sources: list[int], values: dict[int, jax.Array | None]) -> jax.Array:
        """Per stage, the value its ``sources`` entry names."""
        needed = sorted(set(sources))
        if len(needed) == 1:
            return values[needed[0]]
        chosen = self.pick(sources)
        result = values[needed[0]]
        for source in needed[1:]:
            result = jnp.where(chosen == source, values[source], result)
        return result


def shift(x: jax.Array, stages: int, step: int, circular: bool) -> jax.Array:
    """Each stage's ``x`` to the stage ``step`` after it (wrapping around if ``circular``;
    a stage that nothing reaches gets zeros)."""
    pairs = [(s, (s + step) % stages) for s in range(stages) if circular or 0 <= s + step < stages]
    return jax.lax.ppermute(x, PIPELINE_AXIS, pairs)


def select_vjp(
    candidates: list[Any],
    which: int | jax.Array,
    params: list[Any] | None = None,
    picked: Any = None,
) -> Any:
    """The VJP of ``candidates[which]`` (``which`` traced per stage): the residuals
    selected leaf by leaf, applied by the first candidate's backward function.

    ``params`` (each candidate's parameters, as passed to its ``jax.vjp``) and ``picked``
    (the parameters of the chunk the backward slot runs, per stage): a residual that is
    the same parameter leaf in every candidate (a recomputed chunk keeps its inputs) is
    taken from ``picked`` instead of selected. The stage's selected forward slot ran the
    same chunk, whose parameters the step does not change: the values are the same,
    without the copy of the chunk's weights that a selection makes."""
    if len(candidates) == 1:
        return candidates[0]
    flat = [jax.tree.flatten(candidate) for candidate in candidates]
    leaves = [candidate_leaves for candidate_leaves, _ in flat]
    types = [jax.typeof(x) for x in leaves[0]]
    for other in leaves[1:]:
        if [jax.typeof(x) for x in other] != types:
            raise AssertionError("forward slots saved residuals of different types")
    positions = [{id(leaf): k for k, leaf in enumerate(jax.tree.leaves(p))} for p in params or []]
    replacement = jax.tree.leaves(picked) if params else []

    def select(group: tuple[Any, ...]) -> Any:
        if all(x is group[0] for x in group):
            return group[0]
        if positions:
            found = {position.get(id(x)) for position, x in zip(positions, group, strict=True)}
            if len(found) == 1 and None not in found:
                return replacement[found.pop()]
        return jax.lax.select_n(which, *group)

    selected = [select(group) for group in zip(*leaves, strict=True)]
    return jax.tree.unflatten(flat[0][1], selected)
