"""The dense feed-forward blocks: the FFN of the layers that are not MoE layers, and the
shared experts beside the routed ones.

``model.activation`` picks the form: ``gelu``, two matrices (``up``, ``down``) with
biases when ``model.linear_bias`` (GPT-2); ``swiglu``, ``silu(x W_gate) * (x W_up)``
then ``W_down`` (the Llama-derived families), its gate and up matrices one kernel
``[d_model, 2, d_hidden]`` so that they are one GEMM.

With tensor parallelism (Megatron) the hidden layer is split over the tensor group:
the sequence slices are all-gathered on entry, the first matrix (or matrices) is
column-parallel, ``down`` row-parallel and reduce-scatters back to the slices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.config.layout import TENSOR
from jaxmoe.layers import activations
from jaxmoe.layers.parallel_linear import (
    ColumnParallelLinear,
    HeadProjection,
    RowParallelLinear,
)
from jaxmoe.parallel.tensor_parallel import gather_sequence


class DenseFFN(nnx.Module):
    def __init__(self, model: ModelConfig, d_hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.swiglu = model.activation == "swiglu"
        self.recompute = model.recompute  # how the activation keeps its values
        bias = model.linear_bias
        if self.swiglu:
            self.gate_up = HeadProjection(
                model.d_model,
                (2, d_hidden),
                parallel_axes=(None, TENSOR),
                use_bias=bias,
                dtype=dtype,
                rngs=rngs,
                fp8=model.fp8,
            )
        else:
            self.up = ColumnParallelLinear(
                model.d_model, d_hidden, use_bias=bias, dtype=dtype, rngs=rngs, fp8=model.fp8
            )
        self.down = RowParallelLinear(
            d_hidden, model.d_model, use_bias=bias, dtype=dtype, rngs=rngs, fp8=model.fp8
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]`` (``seq``: this device's slice
        under tensor parallelism)."""
        x = gather_sequence(x)
        if self.swiglu:
            hidden = activations.activate("swiglu", self.gate_up(x), self.recompute)
        else:
            hidden = activations.activate("gelu", self.up(x), self.recompute)
        return self.down(hidden)
