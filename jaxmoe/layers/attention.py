"""Causal self-attention with grouped-query heads (the caller applies the pre-norm and
the residual).

Projections: ``query`` ``[d_model, heads, head_dim]`` and ``key_value``
``[d_model, 2, kv_heads, head_dim]`` (keys, then values; one GEMM), each with a bias
when ``model.attention_bias`` (Qwen2), and ``out`` ``[heads * head_dim, d_model]``,
with a bias when ``model.linear_bias`` (GPT-2). Grouped-query attention
(``model.num_kv_heads``): query head ``h`` reads key/value head
``h // (heads / kv_heads)``. ``model.qk_norm`` (Qwen3) applies an RMSNorm to each
query and key head; with ``model.position = "rope"`` queries and keys are then
rotated (:mod:`jaxmoe.layers.rotary`).

With tensor parallelism the heads are split over the tensor group (Megatron):
the sequence slices are all-gathered on entry, each device projects and attends
with its own query heads over the full sequence, and the row-parallel output
projection reduce-scatters back to the sequence slices. Key/value heads are split
too when the group divides them; when there are fewer key/value heads than tensor
devices they are replicated (Megatron-Core does the same), and each device uses the
one its query heads read.

The core (QK^T, scale, mask, softmax, x V) is :mod:`jaxmoe.layers.attention_core`,
chosen once by ``model.attention``: blockwise or cuDNN flash attention, whose backward
pass recomputes the scores tile by tile and keeps only the rows' log-sum-exp, or the
dense reference. ``model.recompute="attention"`` is Megatron-Core's selective
recomputation for the dense core: it runs under ``jax.checkpoint``, so the backward
pass recomputes it from q, k and v instead of keeping its ``[batch, heads, seq, seq]``
weights; the flash cores keep none, and run as they are.

Decoding (:meth:`CausalSelfAttention.decode`, :mod:`jaxmoe.generate`) keeps each
layer's keys and values in a :class:`KVCache` ``[batch, max_len, kv_heads, head_dim]``:
a call writes its tokens' keys and values at the cache position and attends over the
whole cache with the same core, masked to the positions written so far. It runs on one
device, without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.config.layout import TENSOR, TENSOR_IF_DIVIDES
from jaxmoe.layers.attention_core import AttentionCore, resolve_core
from jaxmoe.layers.parallel_linear import HeadProjection, RowParallelLinear
from jaxmoe.layers.rotary import rotate
from jaxmoe.parallel.mesh import role_axes
from jaxmoe.parallel.tensor_parallel import gather_sequence, tensor_group_size


class KVCache(NamedTuple):
    """One layer's keys and values for decoding, ``[batch, max_len, kv_heads, head_dim]``
    each (after the key norm and the rotation), in the model's dtype."""

    key: jax.Array
    value: jax.Array


def recomputed(core: AttentionCore) -> Callable[..., jax.Array]:
    """``core`` with its activations recomputed in the backward pass (the dense core's
    weights). The barrier keeps XLA from merging the recomputation with the forward
    values, which would keep the weights alive again (the layers are unrolled, not a
    scan)."""
    return jax.checkpoint(core, prevent_cse=True)


def model_core(
    model: ModelConfig, dtype: jnp.dtype, context_exchange: str = "ring"
) -> tuple[AttentionCore, bool]:
    """The attention core of ``model`` (query and value widths, tile, window; how a context
    group exchanges keys and values, ``parallel.context_exchange``), and whether
    the layer recomputes it: the dense core's weights under ``recompute="attention"``."""
    core = resolve_core(
        model.attention,
        dtype=dtype,
        head_dim=model.attention_head_dim,
        value_head_dim=model.value_head_dim,
        block=model.attention_block,
        window=model.sliding_window,
        context_exchange=context_exchange,
    )
    return core, model.recompute == "attention" and core.keeps_scores


def kv_heads_split(kv_heads: int) -> bool:
    """Whether this device holds its own share of the key/value heads (the tensor group
    divides them) rather than all of them, replicated."""
    return kv_heads % tensor_group_size() == 0


class CausalSelfAttention(nnx.Module):
    def __init__(
        self,
        model: ModelConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        context_exchange: str = "ring",
    ):
        self.num_heads = model.num_heads
        self.num_kv_heads = model.kv_heads
        self.head_dim = model.attention_head_dim
        self.core, self.recompute_core = model_core(model, dtype, context_exchange)
        self.rope = model.position == "rope"
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        self.query = HeadProjection(
            model.d_model,
            (heads, head_dim),
            parallel_axes=(TENSOR, None),
            use_bias=model.attention_bias,
            dtype=dtype,
            rngs=rngs,
            fp8=model.fp8,
        )
        self.key_value = HeadProjection(
            model.d_model,
            (2, kv_heads, head_dim),
            parallel_axes=(None, TENSOR_IF_DIVIDES, None),
            use_bias=model.attention_bias,
            dtype=dtype,
            rngs=rngs,
            fp8=model.fp8,
        )
        # Qwen3's query and key norms: an RMSNorm over each head's features, one scale of
        # head_dim shared by the heads.
        norm = lambda: nnx.RMSNorm(head_dim, epsilon=model.norm_eps, dtype=dtype, rngs=rngs)
        self.query_norm = norm() if model.qk_norm else None
        self.key_norm = norm() if model.qk_norm else None
        self.out = RowParallelLinear(
            heads * head_dim,
            model.d_model,
            use_bias=model.linear_bias,
            dtype=dtype,
            rngs=rngs,
            fp8=model.fp8,
        )

    def _local_key_value(self, key: jax.Array, value: jax.Array):
        """The key/value heads this device's query heads read, when every device holds all
        of them (fewer key/value heads than tensor devices): one head."""
        group = tensor_group_size()
        if group == 1 or kv_heads_split(self.num_kv_heads):
            return key, value
        # The group's query heads h = rank * heads / group ... all read kv head
        # rank * kv_heads / group (kv_heads divides group: checked by the configuration).
        head = jax.lax.axis_index(role_axes(TENSOR)) * self.num_kv_heads // group
        pick = lambda x: jax.lax.dynamic_slice_in_dim(x, head, 1, axis=2)
        return pick(key), pick(value)

    def __call__(
        self,
        x: jax.Array,
        rotary: tuple[jax.Array, jax.Array] | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; position i sees 0..i.

        Under tensor parallelism ``seq`` is this device's slice, in and out. ``rotary``:
        the ``cos`` and ``sin`` tables of the full sequence's positions
        (:func:`~jaxmoe.layers.rotary.rotary_tables`), with rotary positions.
        ``segment_ids [batch, full seq]``: attention stays inside each segment."""
        chex.assert_shape(
            x,
            (None, None, self.out.out_features),
            custom_message="attention input [batch, seq, d_model]",
        )
        x = gather_sequence(x)
        query, key, value = self._heads(x, rotary)
        key, value = self._local_key_value(key, value)
        attend = recomputed(self.core) if self.recompute_core else self.core
        attended = attend(query, key, value, segment_ids=segment_ids)
        batch, seq = attended.shape[:2]
        return self.out(attended.reshape(batch, seq, -1))

    def _heads(
        self, x: jax.Array, rotary: tuple[jax.Array, jax.Array] | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[batch, seq, local heads, head_dim]``, keys and values ``[batch, seq,
        local kv heads, head_dim]`` of ``x``, normed and rotated as the model says."""
        query = self.query(x)  # [batch, seq, local heads, head_dim]
        key_value = self.key_value(x)  # [batch, seq, 2, local kv heads, head_dim]
        key, value = key_value[:, :, 0], key_value[:, :, 1]
        if self.query_norm is not None:
            query, key = self.query_norm(query), self.key_norm(key)
        if self.rope:
            if rotary is None:
                raise ValueError("rotary positions need the cos and sin tables")
            query, key = rotate(query, *rotary), rotate(key, *rotary)
        return query, key, value

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
        """An empty cache of ``max_len`` positions."""
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def decode(
        self,
        x: jax.Array,
        cache: KVCache,
        index: jax.Array,
        rotary: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """``x [batch, new, d_model]``, the tokens at cache positions ``index .. index + new
        - 1`` -> their attention output ``[batch, new, d_model]`` and the cache with their
        keys and values written in (``lax.dynamic_update_slice``). ``rotary``: the tables
        of those positions. One device: no tensor parallelism."""
        if tensor_group_size() != 1:
            raise ValueError("decoding with a key/value cache runs without tensor parallelism")
        chex.assert_shape(
            x,
            (None, None, self.out.out_features),
            custom_message="attention input [batch, new, d_model]",
        )
        query, key, value = self._heads(x, rotary)
        start = (0, index, 0, 0)
        cache = KVCache(
            jax.lax.dynamic_update_slice(cache.key, key.astype(cache.key.dtype), start),
            jax.lax.dynamic_update_slice(cache.value, value.astype(cache.value.dtype), start),
        )
        positions = index + jnp.arange(x.shape[1])
        attended = self.core(query, cache.key, cache.value, query_positions=positions)
        batch, new = attended.shape[:2]
        return self.out(attended.reshape(batch, new, -1)), cache
