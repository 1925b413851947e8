"""The dense feed-forward block used in the layers that are not MoE layers.

With tensor parallelism (Megatron) the hidden layer is split over the tensor
group: the sequence slices are all-gathered on entry, ``up`` is
column-parallel, ``down`` row-parallel and reduce-scatters back to the slices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from jaxmoe.parallel.tensor_parallel import gather_sequence


class DenseFFN(nnx.Module):
    def __init__(self, d_model: int, d_hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.up = ColumnParallelLinear(d_model, d_hidden, dtype=dtype, rngs=rngs)
        self.down = RowParallelLinear(d_hidden, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]`` (``seq``: this device's slice
        under tensor parallelism)."""
        return self.down(jax.nn.gelu(self.up(gather_sequence(x))))
