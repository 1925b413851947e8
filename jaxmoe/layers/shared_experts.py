"""Shared experts: always-on experts beside the routed ones (DeepSeek, Qwen-MoE).

Every token goes through them, so they are a dense feed-forward block
(:class:`~jaxmoe.layers.mlp.DenseFFN`) of hidden width ``num_shared_experts x
d_shared_expert``, replicated like the dense layers and split over the tensor group
when there is one; their output is added to the routed experts' output. Qwen-MoE
gates it per token: ``sigmoid(x w_gate)`` (``moe.shared_expert_gate``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.config.moe import shared_width
from jaxmoe.layers.mlp import DenseFFN


class SharedExperts(nnx.Module):
    def __init__(self, model: ModelConfig, moe: MoEConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.ffn = DenseFFN(model, shared_width(model, moe), dtype=dtype, rngs=rngs)
        self.gate = (
            nnx.Linear(model.d_model, 1, use_bias=False, dtype=dtype, rngs=rngs)
            if moe.shared_expert_gate
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]`` (``seq``: this device's slice
        under tensor parallelism)."""
        y = self.ffn(x)
        if self.gate is not None:
            y = jax.nn.sigmoid(self.gate(x)) * y
        return y
