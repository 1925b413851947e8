"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), causal, with the interface of
:class:`~jaxmoe.layers.attention.CausalSelfAttention` (the caller applies the pre-norm
and the residual).

Keys and values come from one compressed latent a token: ``kv_down [d_model,
kv_lora_rank + qk_rope_head_dim]`` makes the latent (normed by ``kv_norm``, an RMSNorm)
and, beside it, one rotary key a token that every head shares; ``kv_up [kv_lora_rank,
heads, qk_nope_head_dim + v_head_dim]`` expands the latent into each head's key
features without positions and its value. Queries come through a compression of their
own (``query_down [d_model, q_lora_rank]``, ``query_norm``, ``query_up [q_lora_rank,
heads, qk_nope_head_dim + qk_rope_head_dim]``), or straight from the residual stream
(``query [d_model, heads, ...]``) where ``model.q_lora_rank`` is unset. A head's query
and key are its features without positions followed by its rotated ones (the rotary key
repeated for every head); the scores' scale is ``1 / sqrt(qk_nope_head_dim +
qk_rope_head_dim)``, times DeepSeek's YaRN factor (:func:`~jaxmoe.layers.rotary.
attention_scale`). The output projection ``out [heads * v_head_dim, d_model]``. The core
is the one every family uses (:mod:`jaxmoe.layers.attention_core`), with the value
width apart from the query's. No biases (DeepSeek's have none).

Tensor parallelism splits the heads: ``query_up`` (or ``query``), ``kv_up`` and
``out`` are split over the tensor group as the other attention's projections are; the
compressions and their norms are small and replicated (each device compresses the
whole gathered sequence; their gradients are summed over the group as every replicated
parameter's are).

Decoding (:meth:`LatentAttention.decode`) caches what DeepSeek caches: the normed latent
and the rotated key, ``kv_lora_rank + qk_rope_head_dim`` values a token (576 at V3's
shape), not per-head keys and values. The up-projection of the keys is absorbed into the
queries (``q_nope kv_up_keyᵀ``: each head's query in latent space) and that of the
values into the output: the core then attends with every head over one shared key and
value head, the cached latent and rotary key, and each head's latent result is expanded
by its value matrix.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.config.layout import TENSOR
from jaxmoe.layers.attention import model_core, recomputed
from jaxmoe.layers.parallel_linear import HeadProjection, RowParallelLinear
from jaxmoe.layers.rotary import attention_scale, rotate
from jaxmoe.parallel.tensor_parallel import gather_sequence, tensor_group_size


class LatentCache(NamedTuple):
    """One layer's decode cache: the normed latents ``[batch, max_len, kv_lora_rank]``
    and the rotated keys ``[batch, max_len, qk_rope_head_dim]``, in the model's dtype."""

    latent: jax.Array
    rotary_key: jax.Array


class LatentAttention(nnx.Module):
    def __init__(
        self,
        model: ModelConfig,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        context_exchange: str = "ring",
    ):
        assert model.latent_attention
        assert model.kv_lora_rank is not None and model.qk_nope_head_dim is not None
        self.num_heads = heads = model.num_heads
        self.kv_lora_rank = model.kv_lora_rank
        self.nope_dim = model.qk_nope_head_dim
        self.rope_dim = model.rotary_head_dim
        self.value_dim = model.value_head_dim
        self.scale = attention_scale(model)
        self.core, self.recompute_core = model_core(model, dtype, context_exchange)

        def projection(width: int, features: tuple[int, ...], split: tuple) -> HeadProjection:
            return HeadProjection(
                width,
                features,
                parallel_axes=split,
                use_bias=False,
                dtype=dtype,
                rngs=rngs,
                fp8=model.fp8,
            )

        def norm(width: int) -> nnx.RMSNorm:
            return nnx.RMSNorm(width, epsilon=model.norm_eps, dtype=dtype, rngs=rngs)

        query_features = (heads, model.attention_head_dim)
        if model.q_lora_rank is None:
            self.query = projection(model.d_model, query_features, (TENSOR, None))
            self.query_down = self.query_norm = self.query_up = None
        else:
            self.query = None
            self.query_down = projection(model.d_model, (model.q_lora_rank,), (None,))
            self.query_norm = norm(model.q_lora_rank)
            self.query_up = projection(model.q_lora_rank, query_features, (TENSOR, None))
        self.kv_down = projection(model.d_model, (self.kv_lora_rank + self.rope_dim,), (None,))
        self.kv_norm = norm(self.kv_lora_rank)
        self.kv_up = projection(
            self.kv_lora_rank, (heads, self.nope_dim + self.value_dim), (TENSOR, None)
        )
        self.out = RowParallelLinear(
            heads * self.value_dim,
            model.d_model,
            use_bias=False,
            dtype=dtype,
            rngs=rngs,
            fp8=model.fp8,
        )

    def __call__(
        self,
        x: jax.Array,
        rotary: tuple[jax.Array, jax.Array] | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``; position i sees 0..i. The
        arguments as :meth:`CausalSelfAttention.__call__ <jaxmoe.layers.attention.
        CausalSelfAttention.__call__>` takes them (``rotary`` is required)."""
        chex.assert_shape(
            x,
            (None, None, self.out.out_features),
            custom_message="attention input [batch, seq, d_model]",
        )
        x = gather_sequence(x)
        query_nope, query_rope = self._queries(x, rotary)
        latent, rotary_key = self._latent(x, rotary)
        expanded = self.kv_up(latent)  # [batch, seq, local heads, nope + value]
        key_nope, value = expanded[..., : self.nope_dim], expanded[..., self.nope_dim :]
        query = jnp.concatenate([query_nope, query_rope], axis=-1)
        shared = jnp.broadcast_to(rotary_key, (*key_nope.shape[:-1], self.rope_dim))
        key = jnp.concatenate([key_nope, shared], axis=-1)
        attend = recomputed(self.core) if self.recompute_core else self.core
        attended = attend(query, key, value, segment_ids=segment_ids, scale=self.scale)
        batch, seq = attended.shape[:2]
        return self.out(attended.reshape(batch, seq, -1))

    def _queries(
        self, x: jax.Array, rotary: tuple[jax.Array, jax.Array] | None
    ) -> tuple[jax.Array, jax.Array]:
        """Each local head's query features without positions ``[batch, seq, heads,
        nope]`` and rotated ``[batch, seq, heads, rope]``."""
        if rotary is None:
            raise ValueError("multi-head latent attention needs the rotary cos and sin tables")
        if self.query is not None:
            query = self.query(x)
        else:
            assert self.query_down is not None and self.query_norm is not None
            assert self.query_up is not None
            query = self.query_up(self.query_norm(self.query_down(x)))
        return query[..., : self.nope_dim], rotate(query[..., self.nope_dim :], *rotary)

    def _latent(
        self, x: jax.Array, rotary: tuple[jax.Array, jax.Array] | None
    ) -> tuple[jax.Array, jax.Array]:
        """The normed latent ``[batch, seq, kv_lora_rank]`` and the rotated key ``[batch,
        seq, 1, rope]`` of ``x``."""
        if rotary is None:
            raise ValueError("multi-head latent attention needs the rotary cos and sin tables")
        compressed = self.kv_down(x)
        latent = self.kv_norm(compressed[..., : self.kv_lora_rank])
        rotary_key = rotate(compressed[..., None, self.kv_lora_rank :], *rotary)
        return latent, rotary_key

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> LatentCache:
        """An empty cache of ``max_len`` positions."""
        return LatentCache(
            jnp.zeros((batch, max_len, self.kv_lora_rank), dtype),
            jnp.zeros((batch, max_len, self.rope_dim), dtype),
        )

    def decode(
        self,
        x: jax.Array,
        cache: LatentCache,
        index: jax.Array,
        rotary: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, LatentCache]:
        """``x [batch, new, d_model]``, the tokens at cache positions ``index .. index + new
        - 1`` -> their attention output ``[batch, new, d_model]`` and the cache with their
        latents and rotated keys written in, the up-projections absorbed (module
        docstring). ``rotary``: the tables of those positions. One device."""
        if tensor_group_size() != 1:
            raise ValueError("decoding with a latent cache runs without tensor parallelism")
        chex.assert_shape(
            x,
            (None, None, self.out.out_features),
            custom_message="attention input [batch, new, d_model]",
        )
        query_nope, query_rope = self._queries(x, rotary)
        latent, rotary_key = self._latent(x, rotary)
        cache = LatentCache(
            jax.lax.dynamic_update_slice(
                cache.latent, latent.astype(cache.latent.dtype), (0, index, 0)
            ),
            jax.lax.dynamic_update_slice(
                cache.rotary_key, rotary_key[:, :, 0].astype(cache.rotary_key.dtype), (0, index, 0)
            ),
        )
        up = self.kv_up.kernel[...].astype(query_nope.dtype)  # [rank, heads, nope + value]
        key_up, value_up = up[..., : self.nope_dim], up[..., self.nope_dim :]
        # Each head's query in latent space: q_nope . (latent @ key_up) = (q_nope @ key_upᵀ)
        # . latent.
        absorbed = jnp.einsum("bnhd,rhd->bnhr", query_nope, key_up)
        query = jnp.concatenate([absorbed, query_rope], axis=-1)
        key = jnp.concatenate([cache.latent, cache.rotary_key], axis=-1)[:, :, None]
        positions = index + jnp.arange(x.shape[1])
        attended = self.core(
            query, key, cache.latent[:, :, None], query_positions=positions, scale=self.scale
        )  # [batch, new, heads, rank]: each head's weighted latents
        heads = jnp.einsum("bnhr,rhv->bnhv", attended, value_up)
        batch, new = heads.shape[:2]
        return self.out(heads.reshape(batch, new, -1)), cache
