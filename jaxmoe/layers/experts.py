"""The experts: one two-layer GELU MLP per expert, applied as batched GEMMs.

Weights carry the expert index as their leading axis and are declared as
:class:`~jaxmoe.parallel.sharding.ExpertParam`, so under the whole-step
shard_map each device holds and computes only its local experts. The hidden
dimension is split over the expert-tensor group (``parallel.expert_tensor``):
``w_in`` and ``b_in`` by column, ``w_out`` by row, ``b_out`` replicated. A
device then computes a partial output (its hidden slice's share, without
``b_out``); the dispatcher sums the partials over the group and adds ``b_out``
once (:mod:`jaxmoe.layers.dispatchers`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.parallel.layout import EXPERT, EXPERT_TENSOR
from jaxmoe.parallel.placement import slot_weights
from jaxmoe.parallel.sharding import ExpertParam

# The role each weight dimension is split over (jaxmoe/parallel/sharding.py).
HIDDEN_COLUMNS = (EXPERT, None, EXPERT_TENSOR)  # w_in [E, d, h]
HIDDEN_BIAS = (EXPERT, EXPERT_TENSOR)  # b_in [E, h]
HIDDEN_ROWS = (EXPERT, EXPERT_TENSOR, None)  # w_out [E, h, d]


class Experts(nnx.Module):
    def __init__(
        self, num_experts: int, d_model: int, d_hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        self.dtype = dtype
        # Fan-in is the second-to-last axis; the leading expert axis is a batch axis.
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
        )
        self.w_in = ExpertParam(
            init(rngs.params(), (num_experts, d_model, d_hidden)), parallel_axes=HIDDEN_COLUMNS
        )
        self.b_in = ExpertParam(jnp.zeros((num_experts, d_hidden)), parallel_axes=HIDDEN_BIAS)
        self.w_out = ExpertParam(
            init(rngs.params(), (num_experts, d_hidden, d_model)), parallel_axes=HIDDEN_ROWS
        )
        self.b_out = ExpertParam(jnp.zeros((num_experts, d_model)))

    def __call__(self, x: jax.Array, replica_table: jax.Array | None = None) -> jax.Array:
        """``[slots, tokens, d_model] -> [slots, tokens, d_model]``, slot i on row i.

        The slots are the local experts, followed, with a replica table
        (:mod:`jaxmoe.parallel.placement`), by this device's replica slots. With the
        hidden dimension split, the result lacks the other slices' shares (see
        :meth:`partial_output`).
        """
        return self.partial_output(x, replica_table) + self.output_bias(replica_table)

    def partial_output(self, x: jax.Array, replica_table: jax.Array | None = None) -> jax.Array:
        """This device's hidden slice's share of each output, ``b_out`` not added."""
        w_in, b_in, w_out = (
            slot_weights(home[...], replica_table) for home in (self.w_in, self.b_in, self.w_out)
        )
        slots, d_model, _ = w_in.shape
        chex.assert_shape(
            x, (slots, None, d_model), custom_message="experts input [slots, tokens, d_model]"
        )
        x = x.astype(self.dtype)
        hidden = jnp.einsum("esd,edh->esh", x, w_in.astype(self.dtype))
        hidden = jax.nn.gelu(hidden + b_in[:, None, :].astype(self.dtype))
        return jnp.einsum("esh,ehd->esd", hidden, w_out.astype(self.dtype))

    def output_bias(self, replica_table: jax.Array | None = None) -> jax.Array:
        """``b_out`` of each slot, ``[slots, 1, d_model]``, to add once per output."""
        return slot_weights(self.b_out[...], replica_table)[:, None, :].astype(self.dtype)
