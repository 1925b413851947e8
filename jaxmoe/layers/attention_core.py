"""The attention core, ``softmax(q k^T * scale + mask) v``, for every family and the decoder.

One function, three implementations, chosen once per model (``model.attention``):

- ``"blockwise"``: FlashAttention's online softmax in JAX
  (:mod:`jaxmoe.layers.blockwise_attention`): one ``[block, block]`` tile of scores per
  head at a time, the tiles above the causal diagonal skipped, and a backward pass that
  recomputes each tile from the rows' log-sum-exp. It runs on every backend.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused
  flash attention on NVIDIA GPUs (bfloat16 or float16, a head width up to 256 and a
  multiple of 8). Packed documents reach it as a boolean mask, which cuDNN reads as a
  bias; decoding over a cache, where the queries' positions are operands, runs
  blockwise.
- ``"dense"``: the scores materialised, ``[batch, heads, q, k]`` in float32, masked and
  normalised in one piece: the reference the other two are tested against, and the
  only one whose activations ``model.recompute="attention"`` has to drop.

``"auto"`` (the default) is cuDNN on a GPU where it takes the model's shapes and
dtype, else blockwise.

Under context parallelism (``parallel.context``) a device holds two chunks of each
sequence, and its attention runs as pieces over its context group's blocks of keys and
values (:mod:`jaxmoe.layers.context_attention`), each piece blockwise whatever the kind:
the pieces' log-sum-exps, which merge them, are the blockwise core's.

The mask is causal by position: query ``i`` sees the keys at its position and
before, only the last ``model.sliding_window`` of them where the family has a sliding
window (Mistral's convention: the window counts the query itself), and with segment
ids only those of its own segment (documents packed into one row). Keys and values may
have fewer heads than queries (grouped-query attention: query head ``h`` reads key
head ``h // (heads / kv_heads)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmoe.config.choices import CONTEXT_EXCHANGES
from jaxmoe.layers.blockwise_attention import blockwise_attention
from jaxmoe.layers.context_attention import context_attention
from jaxmoe.parallel.sequence_split import context_size
from scheduling.names import ONE_KERNEL_SCOPE

KINDS = ("blockwise", "cudnn", "dense")


def cudnn_takes(dtype: jnp.dtype, head_dim: int, value_head_dim: int | None = None) -> str | None:
    """Why cuDNN's flash attention does not take these operands, or None when it does."""
    if jax.default_backend() != "gpu":
        return f"it runs on NVIDIA GPUs, and the backend is {jax.default_backend()}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it takes bfloat16 or float16, and model.dtype is {jnp.dtype(dtype).name}"
    for width in {head_dim, value_head_dim or head_dim}:
        if width > 256 or width % 8:
            return f"it takes head widths up to 256 in multiples of 8, not {width}"
    return None


@dataclass(frozen=True)
class AttentionCore:
    """One implementation of the core, with its static parameters."""

    kind: str  # one of KINDS
    block: int = 512  # blockwise: the tile size
    window: int | None = None  # keys a query sees, itself included; None: all before it
    # How a context group exchanges keys and values (parallel.context_exchange).
    context_exchange: str = "ring"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attention core {self.kind!r}: one of {', '.join(KINDS)}")
        if self.context_exchange not in CONTEXT_EXCHANGES:
            raise ValueError(
                f"context exchange {self.context_exchange!r}: one of {', '.join(CONTEXT_EXCHANGES)}"
            )

    @property
    def keeps_scores(self) -> bool:
        """Whether its backward pass keeps the ``[heads, q, k]`` weights (only dense)."""
        return self.kind == "dense"

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        query_positions: jax.Array | None = None,
        scale: float | None = None,
    ) -> jax.Array:
        """``query [batch, q, heads, d]``, ``key [batch, k, kv_heads, d]``, ``value [batch,
        k, kv_heads, dv]`` -> ``[batch, q, heads, dv]``.

        ``segment_ids [batch, q]``: self-attention over packed documents (under context
        parallelism the whole rows', ``q`` being this device's two chunks of them).
        ``query_positions [q]``: the queries' positions among the keys (decoding over a
        cache of ``k`` positions, of which those after a query's are not written yet);
        default: query ``i`` at position ``i`` of the same sequence. ``scale``: of the
        scores, default ``1 / sqrt(d)``."""
        if query_positions is None and context_size() > 1:
            if self.window is not None:
                raise ValueError("a sliding window does not run under context parallelism")
            with jax.named_scope("attention_core_context"):
                return context_attention(
                    query, key, value, exchange=self.context_exchange, block=self.block,
                    scale=scale, segment_ids=segment_ids,
                )  # fmt: skip
        with jax.named_scope(f"attention_core_{self.kind}"):
            if self.kind == "dense":
                return dense_attention(
                    query, key, value, segment_ids, query_positions, self.window, scale
                )
            if self.kind == "cudnn" and query_positions is None:
                return cudnn_attention(query, key, value, segment_ids, self.window, scale)
            # One kernel where the target has one for it (cuDNN's), as the cost model
            # prices it on such a profile (scheduling.names.ONE_KERNEL_SCOPE).
            with jax.named_scope(ONE_KERNEL_SCOPE):
                return blockwise_attention(
                    query,
                    key,
                    value,
                    block=self.block,
                    scale=scale,
                    window=self.window,
                    segment_ids=segment_ids,
                    query_positions=query_positions,
                )


def visible_keys(
    query_positions: jax.Array,
    key_len: int,
    window: int | None,
    segment_ids: jax.Array | None,
) -> jax.Array:
    """The mask ``[batch or 1, q, k]``: which keys each query sees."""
    key_positions = jnp.arange(key_len)[None, :]
    visible = key_positions <= query_positions[:, None]
    if window is not None:
        visible &= query_positions[:, None] - key_positions < window
    visible = visible[None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return visible


def dense_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segment_ids: jax.Array | None = None,
    query_positions: jax.Array | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The reference core: every score of ``[batch, kv_heads, groups, q, k]`` in float32,
    masked, then one softmax."""
    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    if query_positions is None:
        query_positions = jnp.arange(length)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", grouped, key).astype(jnp.float32) * scale
    visible = visible_keys(query_positions, key.shape[1], window, segment_ids)
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    attended = jnp.einsum("bkgqs,bskd->bqkgd", weights, value)
    return attended.reshape(batch, length, heads, value.shape[-1])


def cudnn_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """cuDNN's flash attention through ``jax.nn.dot_product_attention``, causal; packed
    documents as a boolean mask ``[batch, 1, q, k]``."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )


def resolve_core(
    kind: str,
    *,
    dtype: jnp.dtype,
    head_dim: int,
    value_head_dim: int | None = None,
    block: int = 512,
    window: int | None = None,
    context_exchange: str = "ring",
) -> AttentionCore:
    """The core ``model.attention`` names (``"auto"`` resolved for the running backend);
    a one-line error where ``"cudnn"`` is asked for and cannot run."""
    refusal = cudnn_takes(dtype, head_dim, value_head_dim) if kind in ("auto", "cudnn") else None
    if kind == "auto":
        kind = "blockwise" if refusal else "cudnn"
    elif kind == "cudnn" and refusal:
        raise ValueError(
            f"model.attention=cudnn: cuDNN's flash attention cannot run here ({refusal}); "
            "use model.attention=auto or blockwise"
        )
    return AttentionCore(kind, block=block, window=window, context_exchange=context_exchange)
