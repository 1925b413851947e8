"""The decoder: embeddings, pre-norm blocks (:mod:`jaxmoe.layers.block`) with an MoE FFN
in chosen layers, a final norm and the output head, and multi-token prediction's modules
after them where the model has them (:mod:`jaxmoe.layers.multi_token`); layers unrolled.

Layers are a Python loop, not a ``scan``: the scheduler must see each layer's
collectives separately to overlap them with the computation of neighbouring
layers.

Which blocks it is built of follows :class:`~jaxmoe.config.ModelConfig`: learned or
rotary positions, LayerNorm or RMSNorm, GELU or SwiGLU feed-forward blocks, the
output head tied to the token embedding or a matrix of its own, shared experts beside
the routed ones (:class:`~jaxmoe.config.MoEConfig`).

Under tensor parallelism the model runs sequence-parallel between the
tensor-parallel regions: each device embeds only its slice of the sequence
(:mod:`jaxmoe.parallel.tensor_parallel`), norms, residuals and the MoE layers
work on that slice, and the logits are this device's positions. The token
embedding and the output head stay replicated: a vocabulary-parallel embedding is
not implemented.

Attention is grouped-query attention (:mod:`jaxmoe.layers.attention`) or, where the
model sets ``kv_lora_rank``, multi-head latent attention
(:mod:`jaxmoe.layers.latent_attention`), with one interface.

Decoding (:mod:`jaxmoe.generate`) runs the same blocks through :meth:`GPTMoE.decode`:
the new tokens at the cache position, each attention layer reading and extending its
cache (:class:`~jaxmoe.layers.attention.KVCache`, or MLA's
:class:`~jaxmoe.layers.latent_attention.LatentCache`), on one device.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers.block import Block, LayerCache
from jaxmoe.layers.moe import RoutingStats
from jaxmoe.layers.multi_token import PredictionModule
from jaxmoe.layers.norms import make_norm
from jaxmoe.layers.recompute import BlockCall, call_block
from jaxmoe.layers.rotary import attention_tables, rotary_tables
from jaxmoe.parallel.sequence_split import sequence_slice


class Outputs(NamedTuple):
    """What the model computes of a batch: float32 logits ``[batch, seq, vocab]``, routing
    stats stacked over the MoE layers, and each multi-token prediction module's logits
    (none unless asked for)."""

    logits: jax.Array
    stats: RoutingStats
    ahead: tuple[jax.Array, ...] = ()


class GPTMoE(nnx.Module):
    """Token embeddings (and learned positions), the blocks, a final norm, the output head.

    ``experimental``: research options of the MoE layers (:mod:`jaxmoe.experimental`).
    ``context_exchange``: how a context group exchanges keys and values
    (``parallel.context_exchange``, :mod:`jaxmoe.layers.context_attention`)."""

    def __init__(
        self,
        model: ModelConfig,
        moe: MoEConfig,
        *,
        rngs: nnx.Rngs,
        experimental: ExperimentalOptions = DEFAULT,
        context_exchange: str = "ring",
    ):
        dtype = jnp.dtype(model.dtype)
        self.config = model
        self.dtype = dtype
        moe_layers = set(model.moe_layers)
        self.token_embed = nnx.Embed(model.vocab_size, model.d_model, dtype=dtype, rngs=rngs)
        self.position_embed = (
            nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (model.seq_len, model.d_model)))
            if model.position == "learned"
            else None
        )
        self.blocks = nnx.List(
            [
                Block(
                    model,
                    moe if i in moe_layers else None,
                    dtype=dtype,
                    rngs=rngs,
                    experimental=experimental,
                    context_exchange=context_exchange,
                )
                for i in range(model.num_layers)
            ]
        )
        self.final_norm = make_norm(model, model.d_model, dtype=dtype, rngs=rngs)
        self.head = (
            None
            if model.tie_embeddings
            else nnx.Linear(model.d_model, model.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)
        )
        # Multi-token prediction's modules, made last (the rest is initialised as without
        # them): their blocks are layers num_layers, ... on.
        if model.mtp_depth:
            self.mtp = nnx.List(
                [
                    PredictionModule(
                        model,
                        moe if model.num_layers + k in moe_layers else None,
                        dtype=dtype,
                        rngs=rngs,
                        experimental=experimental,
                        context_exchange=context_exchange,
                    )
                    for k in range(model.mtp_depth)
                ]
            )

    def __call__(
        self,
        tokens: jax.Array,
        jitter_key: jax.Array | None = None,
        placement: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        block_call: BlockCall | None = None,
    ) -> tuple[jax.Array, RoutingStats]:
        """``tokens [batch, seq]`` -> float32 logits ``[batch, seq, vocab]`` and routing stats
        stacked over the model's MoE layers (leading axis: MoE layer, in depth order); the
        arguments as :meth:`outputs` takes them."""
        outputs = self.outputs(tokens, jitter_key, placement, positions, segment_ids, block_call)
        return outputs.logits, outputs.stats

    def outputs(
        self,
        tokens: jax.Array,
        jitter_key: jax.Array | None = None,
        placement: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        block_call: BlockCall | None = None,
        next_tokens: jax.Array | None = None,
    ) -> Outputs:
        """``tokens [batch, seq]`` -> float32 logits ``[batch, seq, vocab]`` and routing stats
        stacked over the MoE layers (leading axis: MoE layer, in depth order), and with
        ``next_tokens`` (``[batch, seq]``, each position's next token: the targets) the
        multi-token prediction modules' logits (:mod:`jaxmoe.layers.multi_token`; none
        without them), their MoE blocks' stats after the model's.

        Under tensor parallelism ``tokens`` are the whole rows and the logits are for this
        device's slice of the positions (:func:`~jaxmoe.parallel.sequence_split.sequence_slice`).

        ``placement``: the replica tables of the MoE layers, ``[moe_layers, expert_axis,
        replica_slots]`` (:mod:`jaxmoe.placement.replicas`), or None for no replicas.
        ``positions [batch, seq]``: each token's position (default ``0 .. seq - 1``;
        documents packed into a row restart at 0). ``segment_ids [batch, seq]``: attention
        stays inside each segment (default: one segment per row). ``block_call``: how each
        block is called (:mod:`jaxmoe.layers.recompute`; default the plain call, fully
        sharded parameters gather theirs: :func:`jaxmoe.parallel.fsdp.gathering_call`)."""
        x, rotary = self.embed(tokens, positions)
        layer_stats = []
        for index, block in enumerate(self.blocks):
            key, table = _layer_inputs(jitter_key, placement, index, block, len(layer_stats))
            # Named scopes put the layer into every equation's name stack, where the
            # scheduler's reports find it. The block's call is recomputed in the backward
            # pass under model.recompute="layer".
            with jax.named_scope(f"layer_{index}"):
                x, stats = call_block(
                    self.config.recompute, block, index, x, key, table, rotary, segment_ids,
                    call=block_call,
                )  # fmt: skip
            if stats is not None:
                layer_stats.append(stats)
        with jax.named_scope("head"):
            normed = self.final_norm(x)
        logits = self._output_head(normed).astype(jnp.float32)
        ahead = []
        if next_tokens is not None and self.config.mtp_depth:
            ahead = self._predict_ahead(
                normed, next_tokens, jitter_key, placement, rotary, segment_ids, layer_stats
            )
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_stats)
        return Outputs(logits, stacked, tuple(ahead))

    def _predict_ahead(
        self,
        hidden: jax.Array,
        next_tokens: jax.Array,
        jitter_key: jax.Array | None,
        placement: jax.Array | None,
        rotary: tuple[jax.Array, jax.Array] | None,
        segment_ids: jax.Array | None,
        layer_stats: list[RoutingStats],
    ) -> list[jax.Array]:
        """Each multi-token prediction module's float32 logits, its routing stats appended
        to ``layer_stats``: module ``k`` reads the hidden state the model's final norm
        (``hidden``), or module ``k - 1``'s, left at each position, and the token ``k``
        places ahead of it (``next_tokens`` shifted by ``k - 1``, the row's end padded with
        id 0, whose positions predict nothing), as Megatron-Core and vLLM run DeepSeek-V3's
        module."""
        seq = next_tokens.shape[1]
        logits = []
        for k, module in enumerate(self.mtp, start=1):
            index = self.config.num_layers + k - 1
            ahead = jnp.pad(next_tokens[:, k - 1 :], ((0, 0), (0, k - 1)))
            assert ahead.shape[1] == seq
            key, table = _layer_inputs(jitter_key, placement, index, module.block, len(layer_stats))
            with jax.named_scope(f"mtp_{k}"):
                embedded = self.token_embed(sequence_slice(ahead))
                x, stats = module(
                    hidden, embedded, self.config.recompute, index, key, table, rotary,
                    segment_ids,
                )  # fmt: skip
                with jax.named_scope("head"):
                    hidden = module.final_norm(x)
                    logits.append(self._output_head(hidden).astype(jnp.float32))
            if stats is not None:
                layer_stats.append(stats)
        return logits

    def embed(
        self, tokens: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """What the first block reads: the embedded ``tokens [batch, seq]`` (this device's
        share of the positions under context and tensor parallelism) and the rotary tables
        of the positions its attention covers (its context chunks; None under learned
        positions); ``positions`` as in :meth:`__call__`."""
        chex.assert_rank(tokens, 2)
        chex.assert_type(tokens, int)
        seq = tokens.shape[1]
        x = self.token_embed(sequence_slice(tokens))
        if self.position_embed is None:
            positions = jnp.arange(seq) if positions is None else positions
            return x, attention_tables(self.config, positions)
        chex.assert_axis_dimension_lteq(tokens, 1, self.position_embed.shape[0])
        if positions is None:  # every row at 0 .. seq - 1: one slice, broadcast
            learned = sequence_slice(self.position_embed[...][None, :seq])
        else:
            learned = jnp.take(self.position_embed[...], sequence_slice(positions), axis=0)
        return x + learned.astype(self.dtype), None

    def logits(self, x: jax.Array) -> jax.Array:
        """The last block's output -> float32 logits."""
        with jax.named_scope("head"):
            return self._output_head(self.final_norm(x)).astype(jnp.float32)

    def _output_head(self, normed: jax.Array) -> jax.Array:
        """The output head (the token embedding's, tied, or its own) on normed hidden
        states: logits in the compute dtype."""
        with jax.named_scope("head"):
            tied = self.head is None
            return self.token_embed.attend(normed) if tied else self.head(normed)

    def init_cache(self, batch: int, max_len: int) -> tuple[LayerCache, ...]:
        """Empty attention caches of ``max_len`` positions, one per layer, for
        :meth:`decode`. Learned positions bound ``max_len`` by ``model.seq_len``."""
        if self.position_embed is not None and max_len > self.position_embed.shape[0]:
            raise ValueError(
                f"a cache of {max_len} positions: learned positions stop at "
                f"model.seq_len={self.position_embed.shape[0]}"
            )
        return tuple(
            block.attention.init_cache(batch, max_len, self.dtype) for block in self.blocks
        )

    def decode(
        self, tokens: jax.Array, cache: tuple[LayerCache, ...], index: jax.Array
    ) -> tuple[jax.Array, tuple[LayerCache, ...]]:
        """``tokens [batch, new]`` at positions ``index .. index + new - 1`` (``index``: an
        int scalar, the same for every row; the caches hold the positions before it) ->
        float32 logits ``[batch, new, vocab]`` and the caches with the new keys and values.

        A prompt is one call at ``index`` 0 (the prefill), each generated token one call
        of ``new = 1``. Positions are ``index`` on (learned positions or rotary tables);
        MoE layers route every token as in training, without router noise; their
        routing stats are dropped. One device, no mesh."""
        logits, _, cache = self.decode_hidden(tokens, cache, index)
        return logits, cache

    def decode_hidden(
        self, tokens: jax.Array, cache: tuple[LayerCache, ...], index: jax.Array
    ) -> tuple[jax.Array, jax.Array, tuple[LayerCache, ...]]:
        """:meth:`decode`, and the final norm's output ``[batch, new, d_model]`` beside the
        logits (what multi-token prediction's first module reads)."""
        chex.assert_rank(tokens, 2)
        chex.assert_type(tokens, int)
        chex.assert_equal(len(cache), len(self.blocks))
        x, rotary = self._decode_embed(tokens, index)
        caches = []
        for number, (block, layer_cache) in enumerate(zip(self.blocks, cache, strict=True)):
            with jax.named_scope(f"layer_{number}"):
                x, layer_cache = block.decode(x, layer_cache, index, rotary)
            caches.append(layer_cache)
        with jax.named_scope("head"):
            normed = self.final_norm(x)
        return self._output_head(normed).astype(jnp.float32), normed, tuple(caches)

    def _decode_embed(
        self, tokens: jax.Array, index: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """The embedded ``tokens`` at positions ``index`` on, and their rotary tables."""
        positions = index + jnp.arange(tokens.shape[1])
        x = self.token_embed(tokens)
        if self.position_embed is None:
            return x, rotary_tables(self.config, positions)
        learned = jnp.take(self.position_embed[...], positions, axis=0)
        return x + learned.astype(self.dtype)[None], None

    def init_draft_cache(self, batch: int, max_len: int) -> LayerCache:
        """An empty cache of multi-token prediction's first module's block, for
        :meth:`decode_draft`."""
        return self.mtp[0].block.attention.init_cache(batch, max_len, self.dtype)

    def decode_draft(
        self, hidden: jax.Array, next_tokens: jax.Array, cache: LayerCache, index: jax.Array
    ) -> tuple[jax.Array, LayerCache]:
        """Multi-token prediction's first module at positions ``index`` on: the model's final
        norm's output there ``hidden [batch, new, d_model]`` and the tokens that follow
        them ``next_tokens [batch, new]`` -> float32 logits ``[batch, new, vocab]`` of the
        tokens two places ahead (the drafts of speculative decoding), and its cache."""
        module = self.mtp[0]
        _, rotary = self._decode_embed(next_tokens, index)
        with jax.named_scope("mtp_1"):
            joined = jnp.concatenate(
                [module.embedding_norm(self.token_embed(next_tokens)), module.hidden_norm(hidden)],
                axis=-1,
            )
            x, cache = module.block.decode(module.projection(joined), cache, index, rotary)
            head = self._output_head(module.final_norm(x))
        return head.astype(jnp.float32), cache


def _layer_inputs(
    jitter_key: jax.Array | None,
    placement: jax.Array | None,
    index: int,
    block: Block,
    moe_row: int,
) -> tuple[jax.Array | None, jax.Array | None]:
    """Layer ``index``'s router-jitter key and, for an MoE block, its replica table: row
    ``moe_row`` of ``placement`` (the MoE blocks before it)."""
    key = None if jitter_key is None else jax.random.fold_in(jitter_key, index)
    table = placement[moe_row] if placement is not None and block.is_moe else None
    return key, table
