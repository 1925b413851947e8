"""The experts: one feed-forward block per expert, applied as batched GEMMs (padded
slots) or as one grouped GEMM over rows sorted by expert (:meth:`Experts.grouped`, the
ragged dropless dispatch).

``model.activation`` picks the form, as for the dense FFN (:mod:`jaxmoe.layers.mlp`):
``gelu``, ``w_in`` ``[E, d, h]`` and ``w_out`` ``[E, h, d]`` with biases ``b_in``,
``b_out`` when ``model.linear_bias``; ``swiglu``, ``w_in`` ``[E, d, 2, h]`` (gate and
up, one GEMM) and ``w_out`` ``[E, h, d]``, ``silu(x W_gate) * (x W_up) W_down``.

Weights carry the expert index as their leading axis and are declared as
:class:`~jaxmoe.parallel.sharding.ExpertParam`, so under the whole-step shard_map
each device holds and computes only its local experts. The hidden dimension is split
over the expert-tensor group (``parallel.expert_tensor``): ``w_in`` and ``b_in`` by
column, ``w_out`` by row, ``b_out`` replicated. A device then computes a partial output
(its hidden slice's share, without ``b_out``); the dispatcher sums the partials over
the group and adds the output bias once (:mod:`jaxmoe.layers.dispatchers`). With
``model.fp8`` both forms run their GEMMs in FP8 (:mod:`jaxmoe.layers.fp8`: each slot's
weights scaled on their own).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config.layout import EXPERT, EXPERT_TENSOR
from jaxmoe.layers import activations
from jaxmoe.layers.fp8 import batched_matmul, grouped_matmul, row_groups
from jaxmoe.parallel.sharding import ExpertParam
from jaxmoe.placement.replicas import slot_weights

# The role each weight dimension is split over (jaxmoe/parallel/sharding.py).
HIDDEN_COLUMNS = (EXPERT, None, EXPERT_TENSOR)  # w_in [E, d, h]
GATE_UP_COLUMNS = (EXPERT, None, None, EXPERT_TENSOR)  # w_in [E, d, 2, h]
HIDDEN_BIAS = (EXPERT, EXPERT_TENSOR)  # b_in [E, h]
HIDDEN_ROWS = (EXPERT, EXPERT_TENSOR, None)  # w_out [E, h, d]


class Experts(nnx.Module):
    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_hidden: int,
        *,
        activation: str = "gelu",
        bias: bool = True,
        fp8: str = "none",
        recompute: str = "none",
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.fp8 = fp8
        self.recompute = recompute  # model.recompute: how the activation keeps its values
        self.swiglu = activation == "swiglu"
        # Fan-in is the model width; the leading expert axis is a batch axis.
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=-1, batch_axis=(0,)
        )
        if self.swiglu:
            gate_up_init = nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=(2, 3), batch_axis=(0,)
            )
            w_in = gate_up_init(rngs.params(), (num_experts, d_model, 2, d_hidden))
            self.w_in = ExpertParam(w_in, parallel_axes=GATE_UP_COLUMNS)
        else:
            w_in = init(rngs.params(), (num_experts, d_model, d_hidden))
            self.w_in = ExpertParam(w_in, parallel_axes=HIDDEN_COLUMNS)
        self.w_out = ExpertParam(
            init(rngs.params(), (num_experts, d_hidden, d_model)), parallel_axes=HIDDEN_ROWS
        )
        biases = bias and not self.swiglu
        self.b_in = (
            ExpertParam(jnp.zeros((num_experts, d_hidden)), parallel_axes=HIDDEN_BIAS)
            if biases
            else None
        )
        self.b_out = ExpertParam(jnp.zeros((num_experts, d_model))) if biases else None

    @property
    def num_experts(self) -> int:
        """The experts this module holds (on one device of the whole-step shard_map: its
        local experts)."""
        return self.w_in.shape[0]

    def __call__(self, x: jax.Array, replica_table: jax.Array | None = None) -> jax.Array:
        """``[slots, tokens, d_model] -> [slots, tokens, d_model]``, slot i on row i.

        The slots are the local experts, followed, with a replica table
        (:mod:`jaxmoe.placement.replicas`), by this device's replica slots. With the
        hidden dimension split, the result lacks the other slices' shares (see
        :meth:`partial_output`).
        """
        return self.partial_output(x, replica_table) + self.output_bias(replica_table)

    def partial_output(self, x: jax.Array, replica_table: jax.Array | None = None) -> jax.Array:
        """This device's hidden slice's share of each output, the output bias not added."""
        w_in, w_out = (slot_weights(w[...], replica_table) for w in (self.w_in, self.w_out))
        slots, d_model = w_in.shape[:2]
        chex.assert_shape(
            x, (slots, None, d_model), custom_message="experts input [slots, tokens, d_model]"
        )
        x = x.astype(self.dtype)
        if self.swiglu:
            hidden = activations.activate("swiglu", self._per_slot(x, w_in), self.recompute)
        else:
            hidden = self._per_slot(x, w_in)
            if self.b_in is not None:
                b_in = slot_weights(self.b_in[...], replica_table)
                hidden = hidden + b_in[:, None, :].astype(self.dtype)
            hidden = activations.activate("gelu", hidden, self.recompute)
        return self._per_slot(hidden, w_out)

    def _per_slot(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """``x [slots, tokens, K]`` through each slot's ``w [slots, K, *features]``."""
        w = w.astype(self.dtype)
        if self.fp8 != "none":
            return batched_matmul(x, w, self.fp8)
        return jnp.einsum("esd,edth->esth" if w.ndim == 4 else "esd,edh->esh", x, w)

    def _grouped(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``jax.lax.ragged_dot`` of ``x [rows, K]`` with ``w [slots, K, *features]``."""
        w = w.astype(self.dtype)
        if self.fp8 != "none":
            return grouped_matmul(x, w, group_sizes, self.fp8)
        features = w.shape[2:]
        flat = w.reshape(*w.shape[:2], -1)
        return jax.lax.ragged_dot(x, flat, group_sizes).reshape(x.shape[0], *features)

    def grouped(
        self, x: jax.Array, group_sizes: jax.Array, replica_table: jax.Array | None = None
    ) -> jax.Array:
        """The slots as one grouped GEMM (``jax.lax.ragged_dot``) on rows sorted by slot:
        ``[rows, d_model] -> [rows, d_model]``, the first ``group_sizes[0]`` rows through
        slot 0, the next ``group_sizes[1]`` through slot 1, and so on; rows past
        ``sum(group_sizes)`` give zeros. Whole experts only (no expert-tensor split).

        ``ragged_dot`` is differentiable in both operands. On GPU and TPU it lowers to a
        grouped GEMM over the groups' rows; on CPU, JAX lowers it to a masked dense matmul
        per group (``slots x rows`` rows of work)."""
        w_in, w_out = (slot_weights(w[...], replica_table) for w in (self.w_in, self.w_out))
        slots, d_model = w_in.shape[:2]
        chex.assert_shape(x, (None, d_model), custom_message="grouped input [rows, d_model]")
        chex.assert_shape(group_sizes, (slots,), custom_message="group_sizes [slots]")
        rows = x.shape[0]
        x = x.astype(self.dtype)
        row_slot = row_groups(group_sizes, rows)  # for the biases

        def per_row(bias: jax.Array) -> jax.Array:
            bias = slot_weights(bias, replica_table).astype(self.dtype)
            return jnp.take(bias, row_slot, axis=0, mode="fill", fill_value=0)

        if self.swiglu:
            hidden = activations.activate(
                "swiglu", self._grouped(x, w_in, group_sizes), self.recompute
            )
        else:
            hidden = self._grouped(x, w_in, group_sizes)
            if self.b_in is not None:
                hidden = hidden + per_row(self.b_in[...])
            hidden = activations.activate("gelu", hidden, self.recompute)
        out = self._grouped(hidden, w_out, group_sizes)
        if self.b_out is not None:
            out = out + per_row(self.b_out[...])
        return out

    def output_bias(self, replica_table: jax.Array | None = None) -> jax.Array:
        """The output bias of each slot, ``[slots, 1, d_model]``, to add once per output
        (zeros without biases)."""
        if self.b_out is None:
            slots, _, d_model = slot_weights(self.w_out[...], replica_table).shape
            return jnp.zeros((slots, 1, d_model), self.dtype)
        return slot_weights(self.b_out[...], replica_table)[:, None, :].astype(self.dtype)
