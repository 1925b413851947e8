"""Multi-token prediction (DeepSeek-V3): modules after the last layer that each predict one
token further ahead, sequentially, sharing the model's embedding and output head.

Module ``k`` (1-based, ``model.mtp_depth`` of them) reads, at position ``i``, the hidden
state the previous module's final norm (the model's final norm for ``k = 1``) left there
and the embedding of token ``i + k``: each through a norm of its own, concatenated (the
embedding first, as DeepSeek-V3's checkpoint lays out its projection), projected from
``2 d_model`` back to ``d_model``, and run through one transformer block (an MoE block
where the layer it stands for, ``num_layers + k - 1``, is an MoE layer) and a final norm
of its own, whose output is both the next module's input and, through the shared output
head, the prediction of token ``i + k + 1`` (Megatron-Core's and vLLM's wiring of
DeepSeek-V3's module). Its block sees the same positions, rotary
tables and documents as the model's layers.

The losses (:mod:`jaxmoe.losses`) count the targets that exist: position ``i`` of module
``k`` predicts a token of the row where ``i + k + 1`` is within it (and, with document
masks, within ``i``'s document).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers.block import Block
from jaxmoe.layers.fp8 import dot_general as fp8_dot_general
from jaxmoe.layers.moe import RoutingStats
from jaxmoe.layers.norms import make_norm
from jaxmoe.layers.recompute import call_block


class PredictionModule(nnx.Module):
    """One module: ``block(proj([norm(embedding); norm(hidden)]))`` and its final norm."""

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
        self.embedding_norm = make_norm(model, model.d_model, dtype=dtype, rngs=rngs)
        self.hidden_norm = make_norm(model, model.d_model, dtype=dtype, rngs=rngs)
        self.projection = nnx.Linear(
            2 * model.d_model,
            model.d_model,
            use_bias=False,
            dtype=dtype,
            rngs=rngs,
            dot_general=fp8_dot_general(model.fp8),
        )
        self.block = Block(
            model,
            moe,
            dtype=dtype,
            rngs=rngs,
            experimental=experimental,
            context_exchange=context_exchange,
        )
        self.final_norm = make_norm(model, model.d_model, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        hidden: jax.Array,
        embedded: jax.Array,
        recompute: str,
        index: int,
        jitter_key: jax.Array | None,
        replica_table: jax.Array | None,
        rotary: tuple[jax.Array, jax.Array] | None,
        segment_ids: jax.Array | None,
    ) -> tuple[jax.Array, RoutingStats | None]:
        """``hidden``, ``embedded [batch, seq, d_model]`` (this device's positions) -> this
        module's hidden state and its block's routing stats (None: a dense block). The
        block is layer ``index``, recomputed as ``recompute`` says."""
        joined = jnp.concatenate([self.embedding_norm(embedded), self.hidden_norm(hidden)], axis=-1)
        x = self.projection(joined)
        return call_block(
            recompute, self.block, index, x, jitter_key, replica_table, rotary, segment_ids
        )
