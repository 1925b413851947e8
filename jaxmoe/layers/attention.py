"""Causal multi-head self-attention (the caller applies the pre-norm and residual).

With tensor parallelism the heads are split over the tensor group (Megatron):
the sequence slices are all-gathered on entry, each device projects and
attends with its own heads over the full sequence, and the row-parallel output
projection reduce-scatters back to the sequence slices.

The fused query/key/value kernel is ``[d_model, 3, d_model]`` (q/k/v, then
heads x head_dim), split over the tensor group on its last axis: a contiguous
block of it holds whole heads of each of q, k and v, while the projection
stays one GEMM. (A ``[d_model, 3 * d_model]`` kernel ordered (3, heads,
head_dim) would be cut between q, k and v.) Its values at initialisation are
those of the former ``[d_model, 3 * d_model]`` kernel, reshaped; a checkpoint
of that kernel does not restore into this one (the shapes differ), rather than
restoring into a different meaning.

``recompute=True`` (``model.recompute="attention"``) is Megatron-Core's selective
activation recomputation: the core attention (QK^T, scale, causal mask, softmax,
x V) runs under ``jax.checkpoint``, so the backward pass recomputes it from q, k
and v instead of keeping its ``[batch, heads, seq, seq]`` weights, the one
activation that grows with seq^2. It costs QK^T and the softmax once more.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.layers.parallel_linear import RowParallelLinear
from jaxmoe.parallel.layout import TENSOR
from jaxmoe.parallel.tensor_parallel import gather_sequence


def core_attention(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
    """Causal ``softmax(q k^T / sqrt(head_dim)) v`` over ``[batch, seq, heads, head_dim]``."""
    seq, head_dim = query.shape[1], query.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32)
    logits = logits / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


# The barrier keeps XLA from merging the backward pass's recomputation with the forward
# values, which would keep the weights alive again (the layers are unrolled, not a scan).
recomputed_core_attention = jax.checkpoint(core_attention, prevent_cse=True)


class CausalSelfAttention(nnx.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        recompute: bool = False,
    ):
        self.num_heads = num_heads
        self.recompute = recompute
        self.head_dim = d_model // num_heads
        # No bias: a key bias has an exactly zero gradient (softmax ignores a per-query
        # constant), and Adam would turn its round-off into full-size updates.
        self.qkv = nnx.Einsum(
            "bsd,dtf->bstf",
            (d_model, 3, d_model),
            dtype=dtype,
            # LeCun normal over fan-in d_model, as nnx.Linear's default.
            kernel_init=nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2)
            ),
            kernel_metadata={"parallel_axes": (None, None, TENSOR)},
            rngs=rngs,
        )
        self.out = RowParallelLinear(d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; position i sees 0..i.

        Under tensor parallelism ``seq`` is this device's slice, in and out."""
        chex.assert_shape(
            x,
            (None, None, self.out.out_features),
            custom_message="attention input [batch, seq, d_model]",
        )
        x = gather_sequence(x)
        batch, seq, _ = x.shape
        qkv = self.qkv(x)  # [batch, seq, 3, local heads * head_dim]
        qkv = qkv.reshape(batch, seq, 3, -1, self.head_dim)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attend = recomputed_core_attention if self.recompute else core_attention
        attended = attend(query, key, value)
        return self.out(attended.reshape(batch, seq, -1))
