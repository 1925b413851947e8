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
(:func:`~jaxmoe.layers.blockwise_attention.blockwise_attention_with_lse`), and the pieces
merge as FlashAttention's online softmax merges tiles, in float32.

Packed documents: a piece's queries see only keys of their own segment, the segments of
both read from the row's segment ids, which every device of the group holds whole.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.config.layout import CONTEXT
from jaxmoe.layers.blockwise_attention import MASKED, blockwise_attention_with_lse
from jaxmoe.parallel.mesh import role_axes
from jaxmoe.parallel.sequence_split import context_chunks, context_index, context_size
from scheduling.names import ONE_KERNEL_SCOPE

EXCHANGES = ("ring", "all_gather")


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
    if exchange not in EXCHANGES:
        raise ValueError(f"context exchange {exchange!r}: one of {', '.join(EXCHANGES)}")
    devices, device = context_size(), context_index()
    axes = role_axes(CONTEXT)

    def attend(q, k, v, causal, q_seg, k_seg):
        # One kernel per piece where the target has one (as the cost model prices it).
        with jax.named_scope(ONE_KERNEL_SCOPE):
            return blockwise_attention_with_lse(
                q, k, v, block=block, causal=causal, scale=scale,
                query_segment_ids=q_seg, key_segment_ids=k_seg,
            )  # fmt: skip

    segments = lambda index: None if segment_ids is None else context_chunks(segment_ids, index)
    own_segments = segments(device)

    out, lse = attend(query, key, value, True, own_segments, own_segments)
    first, second = (_halves(out)[0], _halves(lse)[0]), (_halves(out)[1], _halves(lse)[1])
    query_first, query_second = _halves(query)
    segment_first, segment_second = _halves(own_segments)

    if exchange == "all_gather":
        gathered = jax.lax.all_gather((key, value), axes, axis=0)
    block_of_source = (key, value)
    for step in range(1, devices):
        source = (device - step) % devices
        if exchange == "ring":
            ring = [(i, (i + 1) % devices) for i in range(devices)]
            block_of_source = jax.lax.ppermute(block_of_source, axes, ring)
        else:
            block_of_source = tuple(
                jax.lax.dynamic_index_in_dim(part, source, keepdims=False) for part in gathered
            )
        source_key, source_value = block_of_source
        key_first, key_second = _halves(source_key)
        value_first, value_second = _halves(source_value)
        source_first, source_second = _halves(segments(source))
        # The second query chunk over the source's first key chunk: on every device.
        second = _merge(
            second, attend(query_second, key_first, value_first, False, segment_second,
                           source_first)
        )  # fmt: skip
        # One more pair: the first chunks (an earlier source) or the second ones (a later).
        earlier = source < device
        pick = functools.partial(_pick, earlier)
        out_extra, lse_extra = attend(
            pick(query_first, query_second),
            pick(key_first, key_second),
            pick(value_first, value_second),
            False,
            pick(segment_first, segment_second),
            pick(source_first, source_second),
        )
        first = _merge(first, (out_extra, jnp.where(earlier, lse_extra, MASKED)))
        second = _merge(second, (out_extra, jnp.where(earlier, MASKED, lse_extra)))
    return jnp.concatenate([first[0], second[0]], axis=1).astype(query.dtype)
