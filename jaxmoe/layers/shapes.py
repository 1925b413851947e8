"""The model's structure and the shapes of its state, traced once per model: what every
run of a model (its step, its state, its checkpoints, a pipeline's stages, each mapping a
plan traces) reads of it without allocating anything."""

from __future__ import annotations

import functools

from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.experimental import ExperimentalOptions
from jaxmoe.layers.router import ExpertBias
from jaxmoe.layers.transformer import GPTMoE


# A plan reads a model at several depths (its screens' and estimates' traced blocks) and
# recomputations; each entry is shapes alone.
@functools.lru_cache(maxsize=64)
def abstract_model(
    model: ModelConfig,
    moe: MoEConfig,
    seed: int,
    experimental: ExperimentalOptions,
    context_exchange: str,
) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The model's structure and the shapes of its parameters and of its other state
    (:func:`split_model`), without allocating anything; ``experimental`` and
    ``context_exchange`` as :func:`jaxmoe.train.state.build_model` takes them from the run
    (the structure's, never the shapes').

    Kept per model: building it traces every initialiser, seconds for a large model, and
    the planner and the tests resolve many runs of one model. Every argument is required
    (``jaxmoe.experimental.DEFAULT`` and ``"ring"`` where a caller has no run): the cache
    tells calls apart by the arguments they pass, so that each of a run's reads finds the
    others' only when all pass the same five."""
    return split_model(
        nnx.eval_shape(
            lambda: GPTMoE(
                model,
                moe,
                rngs=nnx.Rngs(seed),
                experimental=experimental,
                context_exchange=context_exchange,
            )
        )
    )


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, params, model_state)``: the trained parameters (every variable but the
    expert biases) and the state the step updates itself (the expert biases). ``nnx.merge(
    graphdef, params, model_state)`` takes their pure dicts."""
    graphdef, model_state, params = nnx.split(model, ExpertBias, ...)
    return graphdef, params, model_state
