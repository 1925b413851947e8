"""Causal multi-head self-attention (the caller applies the pre-norm and residual)."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
from flax import nnx


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.num_heads = num_heads
        # No bias: a key bias has an exactly zero gradient (softmax ignores a per-query
        # constant), and Adam would turn its round-off into full-size updates.
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; position i sees 0..i."""
        chex.assert_shape(
            x,
            (None, None, self.out.in_features),
            custom_message="attention input [batch, seq, d_model]",
        )
        batch, seq, width = x.shape
        head_dim = width // self.num_heads
        qkv = self.qkv(x).reshape(batch, seq, 3, self.num_heads, head_dim)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32)
        logits = logits / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, value)
        return self.out(attended.reshape(batch, seq, width))
