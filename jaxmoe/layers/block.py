"""One transformer block: ``x + attention(norm(x))``, then ``x + ffn(norm(x))``, the
attention grouped-query (:mod:`jaxmoe.layers.attention`) or latent
(:mod:`jaxmoe.layers.latent_attention`), the FFN dense or MoE with its shared experts.
The decoder (:mod:`jaxmoe.layers.transformer`) stacks them; each multi-token prediction
module (:mod:`jaxmoe.layers.multi_token`) holds one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers.attention import CausalSelfAttention, KVCache
from jaxmoe.layers.latent_attention import LatentAttention, LatentCache
from jaxmoe.layers.mlp import DenseFFN
from jaxmoe.layers.moe import MoELayer, RoutingStats
from jaxmoe.layers.norms import make_norm
from jaxmoe.layers.shared_experts import SharedExperts

# One attention layer's decode cache.
LayerCache = KVCache | LatentCache


class Block(nnx.Module):
    """``x + attention(norm(x))``, then ``x + ffn(norm(x))``; the FFN is dense, or MoE
    (with its shared experts, when the model has them)."""

    def __init__(
        self,
        model: ModelConfig,
        moe: MoEConfig | None,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        experimental: ExperimentalOptions = DEFAULT,
        context_exchange: str = "ring",
    ):
        self.attention_norm = make_norm(model, model.d_model, dtype=dtype, rngs=rngs)
        attention = LatentAttention if model.latent_attention else CausalSelfAttention
        self.attention = attention(model, dtype=dtype, rngs=rngs, context_exchange=context_exchange)
        self.ffn_norm = make_norm(model, model.d_model, dtype=dtype, rngs=rngs)
        self.shared = (
            SharedExperts(model, moe, dtype=dtype, rngs=rngs)
            if moe is not None and moe.num_shared_experts
            else None
        )
        if moe is None:
            self.ffn = DenseFFN(model, model.d_ff, dtype=dtype, rngs=rngs)
        else:
            self.ffn = MoELayer(
                model.d_model,
                model.d_ff,
                moe,
                activation=model.activation,
                bias=model.linear_bias,
                fp8=model.fp8,
                recompute=model.recompute,
                dtype=dtype,
                rngs=rngs,
                experimental=experimental,
            )

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def __call__(
        self,
        x: jax.Array,
        jitter_key: jax.Array | None = None,
        replica_table: jax.Array | None = None,
        rotary: tuple[jax.Array, jax.Array] | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats | None]:
        with jax.named_scope("attention"):
            x = x + self.attention(self.attention_norm(x), rotary, segment_ids)
        return self._feed_forward(x, jitter_key, replica_table)

    def decode(
        self,
        x: jax.Array,
        cache: LayerCache,
        index: jax.Array,
        rotary: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, LayerCache]:
        """The block on new tokens ``x [batch, new, d_model]`` at cache positions ``index``
        on (:meth:`CausalSelfAttention.decode`); the FFN as in training, without router
        noise or replicas."""
        with jax.named_scope("attention"):
            update, cache = self.attention.decode(self.attention_norm(x), cache, index, rotary)
        x, _ = self._feed_forward(x + update)
        return x, cache

    def _feed_forward(
        self,
        x: jax.Array,
        jitter_key: jax.Array | None = None,
        replica_table: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats | None]:
        """``x + ffn(norm(x))`` and the MoE layer's routing stats (None when dense)."""
        if not self.is_moe:
            with jax.named_scope("ffn"):
                return x + self.ffn(self.ffn_norm(x)), None
        normed = self.ffn_norm(x)
        with jax.named_scope("moe"):
            update, stats = self.ffn(normed, jitter_key, replica_table)
        if self.shared is not None:
            with jax.named_scope("shared"):
                update = update + self.shared(normed)
        return x + update, stats
