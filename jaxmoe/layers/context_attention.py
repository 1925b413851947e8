"""Causal attention over a sequence split across a context group (context parallelism).

Device ``c`` of a context group of ``C`` holds chunks ``c`` and ``2C - 1 - c`` of each
row (:mod:`jaxmoe.parallel.sequence_split`) and the queries, keys and values of their
positions. Its queries also need the keys of earlier positions that other devices hold.
Device ``r``'s keys and values (its two chunks) reach it in one of two ways
(``parallel.context_exchange``):

- ``"ring"``: ``C - 1`` steps, each passing every device's current block on to the
  next device (one ``ppermute``), so that at step ``i`` device ``c`` holds device
  ``(c - i) mod C``'s. Step ``i + 1``'s transfer depends only on step ``i``'s block, so
  the scheduler overlaps it with step ``i``'s attention.
- ``"all_gather"``: every block at once (Megatron-Core's ``all_gather`` mode): one
  collective, and ``C`` blocks of keys and values in memory; cheaper where keys and values
  are few (grouped-query attention with few key/value heads).

The work is the same either way, ``C`` pieces:

- its own block: causal attention over its two chunks (their positions increase, so the
  mask by index is the mask by position);
- the block of a device ``r < c``: both of its query chunks see ``r``'s first chunk
  whole (it precedes both), and ``r``'s second (after both) not at all;
- the block of a device ``r > c``: its second query chunk sees both of ``r``'s chunks
  whole, its first neither.

Each of the last two is two ``[chunk x chunk]`` attentions without a causal mask: the
second query chunk over ``r``'s first key chunk, and one more pair, the first query
chunk over the first key chunk when ``r < c`` or the second over the second when
``r > c``, chosen by a select on the device's index. So every device runs the same
program on equal shapes, as SPMD needs, and computes exactly the chunk pairs a causal
mask leaves it: ``2C - 1`` whole ones and two on the diagonal (:func:`chunk_pairs`).
Each piece returns its rows' log-sum-exp beside its output
(:func:`~jaxmoe.layers.blockwise_attention.attention_with_lse`), and the pieces merge as
FlashAttention's online softmax merges tiles, in float32.

The derivative is the ring's own (a ``jax.custom_vjp``), as in ring flash attention: the
forward pass keeps this device's queries, keys and values, the merged output and its
rows' log-sum-exp (the last two named
:data:`~jaxmoe.layers.blockwise_attention.RESIDUALS`), nothing of a piece; the backward
pass exchanges the blocks again and computes each piece's gradients from the merged rows
(:func:`~jaxmoe.layers.blockwise_attention.attention_gradients`). Each block's ``dk`` and
``dv`` travel around the ring with it, each device adding its pieces' shares, and one more
step takes them home; under ``all_gather`` they are reduce-scattered home. Kept by
autodiff instead, every piece's operands and partial results would stay alive, about
``C`` blocks of keys and values: a whole sequence's.

Packed documents: a piece's queries see only keys of their own segment, the segments of
both read from the row's segment ids, which every device of the group holds whole.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config.choices import CONTEXT_EXCHANGES
from jaxmoe.config.layout import CONTEXT
from jaxmoe.layers.blockwise_attention import (
    MASKED,
    RESIDUALS,
    attention_gradients,
    attention_with_lse,
)
from jaxmoe.parallel.mesh import role_axes
from jaxmoe.parallel.sequence_split import context_chunks, context_index, context_size
from scheduling.names import ONE_KERNEL_SCOPE


def chunk_pairs(device: int, devices: int) -> list[tuple[int, int, bool]]:
    """The ``(query chunk, key chunk, causal)`` pairs device ``device`` computes, chunks
    numbered along the row: the schedule of the module docstring, as plain numbers."""
    first, second = device, 2 * devices - 1 - device
    pairs = [(first, first, True), (second, first, False), (second, second, True)]
    for step in range(1, devices):
        source = (device - step) % devices
        key_first, key_second = source, 2 * devices - 1 - source
        pairs.append((second, key_first, False))
        if source < device:
            pairs.append((first, key_first, False))
        else:
            pairs.append((second, key_second, False))
    return pairs


def _merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Two partial attentions of the same rows over different keys -> their union's:
    outputs ``[batch, rows, heads, dv]`` weighted by their share of the rows' total
    exp-sum, log-sum-exps ``[batch, rows, heads]`` added in log space."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    weight = lambda part: jnp.exp(part - lse)[..., None]
    return out_a * weight(lse_a) + out_b * weight(lse_b), lse


def _halves(x: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """A device's two chunks of ``[batch, 2 chunk, ...]``."""
    if x is None:
        return None, None
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _pick(condition: jax.Array, a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    return None if a is None else jnp.where(condition, a, b)


class _Ring(NamedTuple):
    """The static parameters of one context attention."""

    exchange: str
    block: int
    scale: float | None

    def piece(self, q, k, v, causal, q_seg, k_seg):
        """One piece's float32 output and log-sum-exp rows."""
        # One kernel per piece where the target has one (as the cost model prices it).
        with jax.named_scope(ONE_KERNEL_SCOPE):
            return attention_with_lse(
                q, k, v, block=self.block, causal=causal, scale=self.scale,
                query_segment_ids=q_seg, key_segment_ids=k_seg,
            )  # fmt: skip

    def piece_gradients(self, q, k, v, out, lse, d_out, causal, q_seg, k_seg):
        with jax.named_scope(ONE_KERNEL_SCOPE):
            return attention_gradients(
                q, k, v, out, lse, d_out, block=self.block, causal=causal, scale=self.scale,
                query_segment_ids=q_seg, key_segment_ids=k_seg,
            )  # fmt: skip

    def blocks(self, key: jax.Array, value: jax.Array):
        """``(step, source, key block, value block)`` of every other device, in ring order:
        passed on one device a step (``ring``), or taken from one gather."""
        devices, device, axes = context_size(), context_index(), role_axes(CONTEXT)
        if self.exchange == "all_gather":
            gathered = jax.lax.all_gather((key, value), axes, axis=0)
        block = (key, value)
        for step in range(1, devices):
            source = (device - step) % devices
            if self.exchange == "ring":
                block = jax.lax.ppermute(block, axes, _ring(devices))
            else:
                block = tuple(
                    jax.lax.dynamic_index_in_dim(part, source, keepdims=False) for part in gathered
                )
            yield step, source, *block


def _ring(devices: int) -> list[tuple[int, int]]:
    """Each device sends to the next."""
    return [(i, (i + 1) % devices) for i in range(devices)]


def _segments(segment_ids: jax.Array | None, index) -> jax.Array | None:
    return None if segment_ids is None else context_chunks(segment_ids, index)


def _forward(ring: _Ring, query, key, value, segment_ids):
    """The merged float32 output and log-sum-exp rows of this device's queries."""
    device = context_index()
    own_segments = _segments(segment_ids, device)
    out, lse = ring.piece(query, key, value, True, own_segments, own_segments)
    first, second = (_halves(out)[0], _halves(lse)[0]), (_halves(out)[1], _halves(lse)[1])
    query_first, query_second = _halves(query)
    segment_first, segment_second = _halves(own_segments)
    for _, source, source_key, source_value in ring.blocks(key, value):
        key_first, key_second = _halves(source_key)
        value_first, value_second = _halves(source_value)
        source_first, source_second = _halves(_segments(segment_ids, source))
        # The second query chunk over the source's first key chunk: on every device.
        second = _merge(
            second,
            ring.piece(query_second, key_first, value_first, False, segment_second, source_first),
        )
        # One more pair: the first chunks (an earlier source) or the second ones (a later).
        earlier = source < device
        pick = functools.partial(_pick, earlier)
        out_extra, lse_extra = ring.piece(
            pick(query_first, query_second),
            pick(key_first, key_second),
            pick(value_first, value_second),
            False,
            pick(segment_first, segment_second),
            pick(source_first, source_second),
        )
        first = _merge(first, (out_extra, jnp.where(earlier, lse_extra, MASKED)))
        second = _merge(second, (out_extra, jnp.where(earlier, MASKED, lse_extra)))
    out = jnp.concatenate([first[0], second[0]], axis=1)
    lse = jnp.concatenate([first[1], second[1]], axis=1)
    return out, lse


def _backward(ring: _Ring, residuals, d_out):
    """``dq``, ``dk``, ``dv`` of this device's queries, keys and values: its pieces' shares
    of ``dq``, and every device's shares of its keys' and values' gradients."""
    query, key, value, segment_ids, out, lse = residuals
    devices, device, axes = context_size(), context_index(), role_axes(CONTEXT)
    d_out = d_out.astype(jnp.float32)
    own_segments = _segments(segment_ids, device)
    d_query, d_key, d_value = ring.piece_gradients(
        query, key, value, out, lse, d_out, True, own_segments, own_segments
    )
    d_query_first, d_query_second = _halves(d_query)
    query_first, query_second = _halves(query)
    out_first, out_second = _halves(out)
    lse_first, lse_second = _halves(lse)
    d_out_first, d_out_second = _halves(d_out)
    segment_first, segment_second = _halves(own_segments)
    # The shares of the other devices' keys and values: travelling with their blocks
    # (ring), or one per source, reduce-scattered home (all_gather).
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    if ring.exchange == "ring":
        travelling = (zeros(key), zeros(value))
    else:
        gathered = (jnp.zeros((devices, *key.shape)), jnp.zeros((devices, *value.shape)))
    for _, source, source_key, source_value in ring.blocks(key, value):
        key_first, key_second = _halves(source_key)
        value_first, value_second = _halves(source_value)
        source_first, source_second = _halves(_segments(segment_ids, source))
        shared = ring.piece_gradients(
            query_second, key_first, value_first, out_second, lse_second, d_out_second, False,
            segment_second, source_first,
        )  # fmt: skip
        earlier = source < device
        pick = functools.partial(_pick, earlier)
        extra = ring.piece_gradients(
            pick(query_first, query_second),
            pick(key_first, key_second),
            pick(value_first, value_second),
            pick(out_first, out_second),
            pick(lse_first, lse_second),
            pick(d_out_first, d_out_second),
            False,
            pick(segment_first, segment_second),
            pick(source_first, source_second),
        )
        zero = jnp.zeros_like(extra[0])
        d_query_first = d_query_first + jnp.where(earlier, extra[0], zero)
        d_query_second = d_query_second + shared[0] + jnp.where(earlier, zero, extra[0])
        # The source block's shares: its first chunk from both pieces where earlier.
        block_grads = [
            jnp.concatenate(
                [shared[i] + jnp.where(earlier, extra[i], 0.0), jnp.where(earlier, 0.0, extra[i])],
                axis=1,
            )
            for i in (1, 2)
        ]
        if ring.exchange == "ring":
            travelling = jax.lax.ppermute(travelling, axes, _ring(devices))
            travelling = tuple(t + g for t, g in zip(travelling, block_grads, strict=True))
        else:
            gathered = tuple(
                jax.lax.dynamic_update_index_in_dim(g, b, source, axis=0)
                for g, b in zip(gathered, block_grads, strict=True)
            )
    if devices > 1 and ring.exchange == "ring":
        # The block of device c + 1 ends on device c: one more step takes its shares home.
        travelling = jax.lax.ppermute(travelling, axes, _ring(devices))
    elif devices > 1:
        travelling = tuple(
            jax.lax.psum_scatter(g, axes, scatter_dimension=0, tiled=False) for g in gathered
        )
    d_query = jnp.concatenate([d_query_first, d_query_second], axis=1)
    return (
        d_query.astype(query.dtype),
        (d_key + travelling[0]).astype(key.dtype),
        (d_value + travelling[1]).astype(value.dtype),
        None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(ring: _Ring, query, key, value, segment_ids):
    out, _ = _forward(ring, query, key, value, segment_ids)
    return out.astype(query.dtype)


def _attend_forward(ring: _Ring, query, key, value, segment_ids):
    out, lse = _forward(ring, query, key, value, segment_ids)
    result, lse = checkpoint_name((out.astype(query.dtype), lse), RESIDUALS)
    return result, (query, key, value, segment_ids, result, lse)


_attend.defvjp(_attend_forward, _backward)


def context_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    exchange: str,
    block: int,
    scale: float | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of this device's ``query [batch, 2 chunk, heads, d]`` over the
    keys and values of its whole context group (this device's: ``key [batch, 2 chunk,
    kv_heads, d]``, ``value [.., dv]``) -> ``[batch, 2 chunk, heads, dv]``.

    ``segment_ids [batch, seq]``: the whole rows' (every device of the group holds them).
    ``block``: the tile of each piece's blockwise attention."""
    if exchange not in CONTEXT_EXCHANGES:
        raise ValueError(f"context exchange {exchange!r}: one of {', '.join(CONTEXT_EXCHANGES)}")
    return _attend(_Ring(exchange, block, scale), query, key, value, segment_ids)
