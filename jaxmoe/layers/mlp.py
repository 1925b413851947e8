"""The dense feed-forward block used in the layers that are not MoE layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class DenseFFN(nnx.Module):
    def __init__(self, d_model: int, d_hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, d_hidden, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(d_hidden, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))
