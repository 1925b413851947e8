"""The GPT-MoE decoder: pre-norm blocks, an MoE FFN every k-th layer, layers unrolled.

Layers are a Python loop, not a ``scan``: the scheduler must see each layer's
collectives separately to overlap them with the computation of neighbouring
layers.

Under tensor parallelism the model runs sequence-parallel between the
tensor-parallel regions: each device embeds only its slice of the sequence
(:mod:`jaxmoe.parallel.tensor_parallel`), norms, residuals and the MoE layers
work on that slice, and the logits are this device's positions. The token
embedding (and so the tied head) stays replicated: a vocabulary-parallel
embedding is not implemented.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.layers.attention import CausalSelfAttention
from jaxmoe.layers.mlp import DenseFFN
from jaxmoe.layers.moe import MoELayer, RoutingStats
from jaxmoe.parallel.tensor_parallel import sequence_slice


class Block(nnx.Module):
    """``x + attention(norm(x))``, then ``x + ffn(norm(x))``; the FFN is dense or MoE."""

    def __init__(
        self, model: ModelConfig, moe: MoEConfig | None, *, dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        self.attention_norm = nnx.LayerNorm(model.d_model, dtype=dtype, rngs=rngs)
        self.attention = CausalSelfAttention(
            model.d_model,
            model.num_heads,
            dtype=dtype,
            rngs=rngs,
            recompute=model.recompute == "attention",
        )
        self.ffn_norm = nnx.LayerNorm(model.d_model, dtype=dtype, rngs=rngs)
        if moe is None:
            self.ffn = DenseFFN(model.d_model, model.d_ff, dtype=dtype, rngs=rngs)
        else:
            self.ffn = MoELayer(model.d_model, model.d_ff, moe, dtype=dtype, rngs=rngs)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def __call__(
        self,
        x: jax.Array,
        jitter_key: jax.Array | None = None,
        replica_table: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats | None]:
        with jax.named_scope("attention"):
            x = x + self.attention(self.attention_norm(x))
        with jax.named_scope("moe" if self.is_moe else "ffn"):
            normed = self.ffn_norm(x)
            if self.is_moe:
                update, stats = self.ffn(normed, jitter_key, replica_table)
            else:
                update, stats = self.ffn(normed), None
        return x + update, stats


class GPTMoE(nnx.Module):
    """Token and position embeddings, the blocks, a final norm, and a tied output head."""

    def __init__(self, model: ModelConfig, moe: MoEConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(model.dtype)
        self.dtype = dtype
        moe_layers = set(model.moe_layers)
        self.token_embed = nnx.Embed(model.vocab_size, model.d_model, dtype=dtype, rngs=rngs)
        self.position_embed = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (model.seq_len, model.d_model))
        )
        self.blocks = nnx.List(
            [
                Block(model, moe if i in moe_layers else None, dtype=dtype, rngs=rngs)
                for i in range(model.num_layers)
            ]
        )
        self.final_norm = nnx.LayerNorm(model.d_model, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        jitter_key: jax.Array | None = None,
        placement: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats]:
        """``tokens [batch, seq]`` -> float32 logits ``[batch, seq, vocab]`` and routing stats
        stacked over the MoE layers (leading axis: MoE layer, in depth order).

        Under tensor parallelism ``tokens`` are the whole rows and the logits are for this
        device's slice of the positions (:func:`~jaxmoe.parallel.tensor_parallel.sequence_slice`).

        ``placement``: the replica tables of the MoE layers, ``[moe_layers, expert_axis,
        replica_slots]`` (:mod:`jaxmoe.parallel.placement`), or None for no replicas."""
        chex.assert_rank(tokens, 2)
        chex.assert_type(tokens, int)
        chex.assert_axis_dimension_lteq(tokens, 1, self.position_embed.shape[0])
        seq = tokens.shape[1]
        positions = sequence_slice(self.position_embed[...][None, :seq])
        x = self.token_embed(sequence_slice(tokens)) + positions.astype(self.dtype)
        layer_stats = []
        for index, block in enumerate(self.blocks):
            key = None if jitter_key is None else jax.random.fold_in(jitter_key, index)
            table = None
            if placement is not None and block.is_moe:
                table = placement[len(layer_stats)]
            # Named scopes put the layer into every equation's name stack, where the
            # scheduler's reports find it.
            with jax.named_scope(f"layer_{index}"):
                x, stats = block(x, key, table)
            if stats is not None:
                layer_stats.append(stats)
        with jax.named_scope("head"):
            logits = self.token_embed.attend(self.final_norm(x)).astype(jnp.float32)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_stats)
        return logits, stacked
