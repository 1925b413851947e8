"""The normalisation layers of the model families: LayerNorm or RMSNorm (``model.norm``),
keeping only their input for the backward pass where the block's forward values are kept
(:mod:`jaxmoe.layers.input_kept`).

Both compute their statistics in float32 whatever the compute dtype, as the Hugging Face
implementations do, and return the compute dtype. Differentiated as written, a norm of
a bfloat16 input keeps the input again in float32, its statistics and the normalised
values until the backward pass (Qwen2-57B-A14B on 64 H100s: about 0.35 of the 2.5 GB a
block keeps); kept as its input and its parameters alone, its backward pass normalises
again. The modules are Flax's, their parameters named as Flax names them; only their
call differs.

The input passes an ``optimization_barrier`` first, so that the norm reads it as the
residual stream holds it, rounded to the compute dtype, in every program: XLA:CPU's
excess precision may otherwise hand one program an unrounded copy of the residual sum
and not another (two layouts of one step would then differ in the last bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.layers.input_kept import keeping_inputs, kept_inputs

# The name scope of a norm's ops (the planner's bounds read it).
SCOPE = "norm"


def make_norm(model: ModelConfig, width: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
    """The normalisation ``model.norm`` names, over the last axis of width ``width``,
    keeping its input alone unless ``model.recompute`` recomputes the block."""
    kept = kept_inputs(model.recompute)
    if model.norm == "rmsnorm":
        kind = InputKeptRMSNorm if kept else nnx.RMSNorm
        return kind(width, epsilon=model.norm_eps, dtype=dtype, rngs=rngs)
    kind = InputKeptLayerNorm if kept else nnx.LayerNorm
    return kind(width, epsilon=model.norm_eps, dtype=dtype, rngs=rngs)


def _input_kept(norm_call):
    """The call of a Flax norm, ``norm_call(module, x)``, keeping ``x`` and the module's
    parameters alone."""

    def call(self: nnx.Module, x: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(self)
        normed = keeping_inputs(lambda state, x: norm_call(nnx.merge(graphdef, state), x))
        with jax.named_scope(SCOPE):
            return normed(state, jax.lax.optimization_barrier(x))

    return call


class InputKeptRMSNorm(nnx.RMSNorm):
    """Flax's RMSNorm, keeping its input alone for the backward pass."""

    __call__ = _input_kept(nnx.RMSNorm.__call__)


class InputKeptLayerNorm(nnx.LayerNorm):
    """Flax's LayerNorm, keeping its input alone for the backward pass."""

    __call__ = _input_kept(nnx.LayerNorm.__call__)
