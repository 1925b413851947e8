"""The normalisation layers of the model families: LayerNorm or RMSNorm (``model.norm``).

Both compute their statistics in float32 whatever the compute dtype, as the
Hugging Face implementations do, and return the compute dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig


def make_norm(model: ModelConfig, width: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
    """The normalisation ``model.norm`` names, over the last axis of width ``width``."""
    if model.norm == "rmsnorm":
        return nnx.RMSNorm(width, epsilon=model.norm_eps, dtype=dtype, rngs=rngs)
    return nnx.LayerNorm(width, epsilon=model.norm_eps, dtype=dtype, rngs=rngs)
