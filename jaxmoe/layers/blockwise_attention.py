"""Blockwise attention in JAX: FlashAttention's online softmax, forward and backward.

``softmax(q k^T * scale + mask) v`` computed one ``[block, block]`` tile of the scores
at a time, so that no more than one tile per head exists at once (FlashAttention-2,
arXiv 2307.08691, Algorithms 1 and 2). Tiles that the mask empties entirely are not
computed: above the causal diagonal, and beyond a sliding window; with queries at
positions known only when the step runs (decoding) every tile is visited and masked.

Forward: for each query tile, a running maximum ``m``, a running sum ``l`` and an
unnormalised output ``acc``, all float32; each key tile rescales them by
``exp(m_old - m_new)``. It keeps the output and the log-sum-exp ``m + log l`` of every
query row. Backward (a ``jax.custom_vjp``): from those two alone, each tile's weights
``exp(s - lse)`` are recomputed and give the tile's share of ``dq``, ``dk`` and ``dv``:
the scores are computed twice, as in every flash attention, and never stored.
The forward
pass names those two :data:`RESIDUALS`: a recomputation policy that keeps matmuls' results
keeps them too (:mod:`jaxmoe.layers.recompute`), and with them nothing of the loop.

The tiles visited are a static list of ``(query tile, key tile)`` pairs, run by one
``lax.scan``; a sequence no longer than a block is one tile, computed inline with no
loop (and no tile axes: the ops the scheduler's partition rules know, as the dense
core's). Sequences are padded to whole tiles: a padded key sits
after every real query and the causal mask hides it; padded query rows are dropped.

:func:`attention_with_lse` and :func:`attention_gradients` are the two passes apart, for
an attention computed in pieces over different keys (context parallelism's ring,
:mod:`jaxmoe.layers.context_attention`): the first gives a piece's output and its rows'
log-sum-exp, which merge the pieces exactly; the second a piece's share of ``dq``, ``dk``
and ``dv`` from the merged rows' output and log-sum-exp, the same formula as within one
attention. A piece's queries may see every key (the keys of an earlier chunk), and its
queries' and keys' segments are given apart.

Queries may have more heads than keys (grouped-query attention): the query heads are
grouped ``[kv_heads, heads / kv_heads]`` and each group reads its key/value head. Values
may have their own head width (multi-head latent attention). GEMM inputs stay in the
operands' dtype, with float32 accumulation; the softmax statistics are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

# The name of what the forward pass keeps for the backward pass beyond its operands: the
# output and the rows' log-sum-exp. A checkpoint policy that keeps nothing of a loop's
# iterations must keep these: else the backward pass runs the loop again to make them.
RESIDUALS = "flash_attention_residuals"
# The score of a masked position: far below any real score, yet finite, so that a row
# whose every position so far is masked never computes ``inf - inf``.
MASKED = -1e30


@dataclass(frozen=True)
class Tiling:
    """The static shape of one blockwise attention: tile sizes, the tiles visited and the
    mask's static parts."""

    query_len: int
    key_len: int
    query_block: int
    key_block: int
    # Keys a query sees, itself included (a sliding window); None: every earlier key.
    window: int | None
    # Queries sit at positions 0 .. query_len - 1 of the keys' sequence (self-attention);
    # False: their positions are an operand (decoding over a cache).
    aligned: bool
    scale: float

    @property
    def single(self) -> bool:
        """One tile holds the whole attention: computed inline, with no loop."""
        return self.query_tiles == 1 and self.key_tiles == 1

    @property
    def query_tiles(self) -> int:
        return -(-self.query_len // self.query_block)

    @property
    def key_tiles(self) -> int:
        return -(-self.key_len // self.key_block)

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The ``(query tile, key tile)`` pairs the mask leaves anything in, query tile
        by query tile."""
        if not self.aligned:
            return tuple((i, j) for i in range(self.query_tiles) for j in range(self.key_tiles))
        pairs = []
        for i in range(self.query_tiles):
            first_query = i * self.query_block
            last_query = min(self.query_len, first_query + self.query_block) - 1
            for j in range(self.key_tiles):
                first_key, last_key = j * self.key_block, (j + 1) * self.key_block - 1
                if first_key > last_query:
                    continue  # above the causal diagonal
                if self.window is not None and last_key <= first_query - self.window:
                    continue  # before every query's window
                pairs.append((i, j))
        return tuple(pairs)


def tiling(
    query_len: int,
    key_len: int,
    block: int,
    *,
    window: int | None,
    aligned: bool,
    scale: float,
) -> Tiling:
    """The tiling of a ``query_len x key_len`` attention in tiles of at most ``block``."""
    return Tiling(
        query_len=query_len,
        key_len=key_len,
        query_block=min(block, query_len),
        key_block=min(block, key_len),
        window=window,
        aligned=aligned,
        scale=scale,
    )


def blockwise_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block: int,
    scale: float | None = None,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    query_positions: jax.Array | None = None,
) -> jax.Array:
    """Masked ``softmax(q k^T * scale) v`` over ``query [batch, q, heads, d]``, ``key
    [batch, k, kv_heads, d]`` and ``value [batch, k, kv_heads, dv]`` in tiles of at most
    ``block``; ``[batch, q, heads, dv]``.

    Query ``i`` sits at position ``query_positions[i]`` of the keys (default ``i``:
    self-attention) and sees the keys at that position and before, the last ``window``
    of them where a window is given, and with ``segment_ids [batch, q]`` (self-attention
    only) only those of its own segment. ``scale`` defaults to ``1 / sqrt(d)``."""
    if query_positions is not None and segment_ids is not None:
        raise ValueError("segment ids are for self-attention; a query with positions has none")
    if query_positions is None and query.shape[1] != key.shape[1]:
        raise ValueError(
            f"{query.shape[1]} queries over {key.shape[1]} keys: give the queries' positions"
        )
    tiles = tiling(
        query.shape[1],
        key.shape[1],
        block,
        window=window,
        aligned=query_positions is None,
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
    )
    if query_positions is None:
        query_positions = jnp.arange(query.shape[1], dtype=jnp.int32)
    positions = query_positions.astype(jnp.int32)
    return _attention(tiles, query, key, value, positions, segment_ids, segment_ids)


def _piece(query, key, *, block, causal, scale) -> tuple[Tiling, jax.Array]:
    """The tiling of a piece and its queries' positions: their own (causal), or the last
    key's (every key seen)."""
    if causal and query.shape[1] != key.shape[1]:
        raise ValueError(f"causal self-attention of {query.shape[1]} queries over {key.shape[1]}")
    tiles = tiling(
        query.shape[1],
        key.shape[1],
        block,
        window=None,
        aligned=causal,
        scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
    )
    last = key.shape[1] - 1
    positions = jnp.arange(query.shape[1]) if causal else jnp.full(query.shape[1], last)
    return tiles, positions.astype(jnp.int32)


def attention_with_lse(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block: int,
    causal: bool,
    scale: float | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One piece's forward pass: :func:`blockwise_attention`'s output in float32 and the
    rows' log-sum-exp ``[batch, q, heads]`` (float32). Not differentiable: the caller's
    own derivative calls :func:`attention_gradients`.

    ``causal``: self-attention, query ``i`` seeing keys ``0 .. i``; False: every query sees
    every key (the keys all precede the queries). With ``query_segment_ids [batch, q]``
    and ``key_segment_ids [batch, k]`` a query sees only the keys of its own segment. A
    row that sees no key has output 0 and log-sum-exp :data:`MASKED`, so that it adds
    nothing where pieces are merged."""
    tiles, positions = _piece(query, key, block=block, causal=causal, scale=scale)
    out, lse = _forward(tiles, query, key, value, positions, query_segment_ids, key_segment_ids)
    return out, _rows(lse, tiles)


def attention_gradients(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    block: int,
    causal: bool,
    scale: float | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One piece's share of ``dq``, ``dk`` and ``dv`` (float32), the arguments as
    :func:`attention_with_lse` takes them, given the rows' output ``out [batch, q, heads,
    dv]``, log-sum-exp ``lse [batch, q, heads]`` and output cotangent ``d_out``, all of the
    whole attention the piece is part of (the rows' softmax over every key)."""
    tiles, positions = _piece(query, key, block=block, causal=causal, scale=scale)
    residuals = (
        query,
        key,
        value,
        positions,
        query_segment_ids,
        key_segment_ids,
        out.astype(query.dtype),
        _in_forward_layout(lse.astype(jnp.float32), tiles, key.shape[2]),
    )
    return _gradients_of(tiles, residuals, d_out)


# -- one tile -----------------------------------------------------------------------------
#
# Queries ``[batch, block_q, kv_heads, groups, d]``, keys ``[batch, block_k, kv_heads, d]``,
# values ``[batch, block_k, kv_heads, dv]``; scores and weights ``[batch, kv_heads, groups,
# block_q, block_k]``; per-row statistics ``[batch, kv_heads, groups, block_q]``. A whole
# sequence of one tile is computed by these alone.


def _visible(
    tiles: Tiling,
    query_position: jax.Array,
    key_offset,
    query_segment: jax.Array | None,
    key_segment: jax.Array | None,
) -> jax.Array:
    """Which keys of a tile starting at ``key_offset`` each query sees: ``[batch or 1, 1, 1,
    block_q, block_k]`` (to broadcast over the key/value heads and their groups)."""
    key_position = key_offset + jnp.arange(tiles.key_block, dtype=jnp.int32)[None]
    visible = key_position <= query_position[:, None]
    if tiles.window is not None:
        visible &= query_position[:, None] - key_position < tiles.window
    visible = visible[None]
    if query_segment is not None:
        visible = visible & (query_segment[:, :, None] == key_segment[:, None, :])
    return visible[:, None, None]


def _scores(tiles: Tiling, query, key, visible) -> jax.Array:
    """The tile's ``q k^T * scale``, float32, ``MASKED`` where a query does not see a key."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", query, key, preferred_element_type=jnp.float32)
    return jnp.where(visible, scores * tiles.scale, MASKED)


def _weights(scores, visible, maximum=None):
    """``exp(scores - maximum)``, zero where masked, and the maximum: the tile's own row
    maxima, or the given one (the running maximum, or the backward pass's log-sum-exp)."""
    if maximum is None:
        maximum = scores.max(axis=-1)
    return jnp.where(visible, jnp.exp(scores - maximum[..., None]), 0.0), maximum


def _weighted_values(weights: jax.Array, value: jax.Array) -> jax.Array:
    """``weights @ v``: ``[batch, block_q, kv_heads, groups, dv]``, float32."""
    return jnp.einsum(
        "bkgqs,bskd->bqkgd", weights.astype(value.dtype), value, preferred_element_type=jnp.float32
    )


def _per_row(x: jax.Array) -> jax.Array:
    """Per-row statistics ``[..., kv_heads, groups, block]`` laid out like the output rows,
    ``[..., block, kv_heads, groups, 1]``."""
    return jnp.moveaxis(x, -1, -3)[..., None]


def _gradients(tiles: Tiling, query, key, value, visible, lse, row_dot, d_out):
    """The tile's shares of ``dq``, ``dk`` and ``dv`` (float32) from its rows' log-sum-exp
    and ``rowsum(dO * O)`` (FlashAttention-2's Algorithm 2)."""
    dtype = query.dtype
    weights, _ = _weights(_scores(tiles, query, key, visible), visible, lse)
    d_value = jnp.einsum(
        "bkgqs,bqkgd->bskd", weights.astype(dtype), d_out, preferred_element_type=jnp.float32
    )
    d_weights = jnp.einsum("bqkgd,bskd->bkgqs", d_out, value, preferred_element_type=jnp.float32)
    d_scores = (weights * (d_weights - row_dot[..., None])).astype(dtype)
    d_query = jnp.einsum("bkgqs,bskd->bqkgd", d_scores, key, preferred_element_type=jnp.float32)
    d_key = jnp.einsum("bkgqs,bqkgd->bskd", d_scores, query, preferred_element_type=jnp.float32)
    return d_query * tiles.scale, d_key * tiles.scale, d_value


def _row_dot(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """``rowsum(dO * O)`` per query row: ``[..., kv_heads, groups, block]``."""
    rows = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return jnp.moveaxis(rows, -3, -1)


# -- tiles --------------------------------------------------------------------------------


def _pad_to(x: jax.Array, axis: int, size: int, fill=0) -> jax.Array:
    """``x`` padded with ``fill`` along ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _tiles(x: jax.Array, tile: int, count: int, fill=0) -> jax.Array:
    """``[batch, len, ...]`` -> ``[count, batch, tile, ...]``, padded to whole tiles."""
    x = _pad_to(x, 1, tile * count, fill)
    x = x.reshape(x.shape[0], count, tile, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _untile(x: jax.Array, length: int) -> jax.Array:
    """The inverse of :func:`_tiles`: ``[count, batch, tile, ...]`` -> ``[batch, length,
    ...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _take(x: jax.Array | None, index) -> jax.Array | None:
    """Tile ``index`` of ``x`` (a traced index along axis 0)."""
    return None if x is None else jax.lax.dynamic_index_in_dim(x, index, keepdims=False)


def _put(x: jax.Array, tile: jax.Array, index) -> jax.Array:
    """``x`` with ``tile`` written at ``index`` along axis 0 (in place in XLA's loop)."""
    return jax.lax.dynamic_update_index_in_dim(x, tile, index, axis=0)


@dataclass(frozen=True)
class _Tiled:
    """The operands cut into tiles: queries ``[tiles, batch, block, kv_heads, groups, d]``,
    keys ``[tiles, batch, block, kv_heads, d]``, values likewise with ``dv``, the positions
    of the query rows ``[tiles, block]`` and the segments of the rows and columns
    ``[tiles, batch, block]`` (None without segments)."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    query_position: jax.Array
    query_segment: jax.Array | None
    key_segment: jax.Array | None

    def arrays(self) -> tuple[jax.Array, ...]:
        values = (getattr(self, field.name) for field in dataclasses.fields(self))
        return tuple(v for v in values if v is not None)

    def visible(self, tiles: Tiling, i, j) -> jax.Array:
        return _visible(
            tiles,
            _take(self.query_position, i),
            j * tiles.key_block,
            _take(self.query_segment, i),
            _take(self.key_segment, j),
        )


def _cut(tiles: Tiling, query, key, value, query_positions, query_segment, key_segment) -> _Tiled:
    nq, nk, bq, bk = tiles.query_tiles, tiles.key_tiles, tiles.query_block, tiles.key_block
    # Padded query rows sit after the last real one; padded keys after every query, where
    # the causal mask hides them (and a segment of their own, -1).
    positions = query_positions
    if nq * bq > tiles.query_len:
        padding = jnp.arange(1, nq * bq - tiles.query_len + 1, dtype=jnp.int32)
        positions = jnp.concatenate([positions, query_positions[-1] + padding])
    segmented = query_segment is not None
    return _Tiled(
        query=_tiles(query, bq, nq),
        key=_tiles(key, bk, nk),
        value=_tiles(value, bk, nk),
        query_position=positions.reshape(nq, bq),
        query_segment=_tiles(query_segment, bq, nq) if segmented else None,
        key_segment=_tiles(key_segment, bk, nk, fill=-1) if segmented else None,
    )


def _varying(state: tuple[jax.Array, ...], *operands: jax.Array) -> tuple[jax.Array, ...]:
    """``state`` typed as varying over the manual mesh axes ``operands`` vary over: inside
    a ``shard_map`` a loop's carry has the type of what the loop writes into it."""
    axes = set()
    for operand in operands:  # outside a shard_map an array has no manual axis type
        axes.update(getattr(getattr(jax.typeof(operand), "mat", None), "varying", ()))
    if not axes:
        return state
    return tuple(jax.lax.pcast(x, tuple(sorted(axes)), to="varying") for x in state)


def _visit_pairs(tiles: Tiling, visit, state):
    """``state`` after ``visit(state, (i, j))`` for every tile pair, one ``lax.scan``."""
    pairs = np.asarray(tiles.pairs(), dtype=np.int32).reshape(-1, 2)
    state, _ = jax.lax.scan(visit, state, (jnp.asarray(pairs[:, 0]), jnp.asarray(pairs[:, 1])))
    return state


def _tiled_forward(tiles: Tiling, ops: _Tiled) -> tuple[jax.Array, jax.Array]:
    """Output tiles ``[query tiles, batch, block, kv_heads, groups, dv]`` (float32) and the
    rows' log-sum-exp ``[query tiles, batch, kv_heads, groups, block]``."""
    nq, batch, bq, kv_heads, groups, _ = ops.query.shape
    stats_shape = (nq, batch, kv_heads, groups, bq)
    state = (
        jnp.zeros((*ops.query.shape[:-1], ops.value.shape[-1]), jnp.float32),  # acc
        jnp.full(stats_shape, MASKED, jnp.float32),  # the running maximum m
        jnp.zeros(stats_shape, jnp.float32),  # the running sum l
    )

    def visit(state, pair):
        acc, maximum, total = state
        i, j = pair
        query, key, visible = _take(ops.query, i), _take(ops.key, j), ops.visible(tiles, i, j)
        scores = _scores(tiles, query, key, visible)
        m_old, total_old = _take(maximum, i), _take(total, i)
        m_new = jnp.maximum(m_old, scores.max(axis=-1))
        weights, _ = _weights(scores, visible, m_new)
        rescale = jnp.exp(m_old - m_new)
        acc_new = _take(acc, i) * _per_row(rescale) + _weighted_values(weights, _take(ops.value, j))
        total_new = total_old * rescale + weights.sum(axis=-1)
        return (_put(acc, acc_new, i), _put(maximum, m_new, i), _put(total, total_new, i)), None

    acc, maximum, total = _visit_pairs(tiles, visit, _varying(state, *ops.arrays()))
    total = jnp.where(total == 0.0, 1.0, total)  # a row that sees nothing (causal: none)
    return acc / _per_row(total), maximum + jnp.log(total)


def _tiled_backward(tiles: Tiling, ops: _Tiled, lse, row_dot, d_out):
    """``dq, dk, dv`` tiles (float32), each tile pair adding its shares."""
    state = (
        jnp.zeros(ops.query.shape, jnp.float32),
        jnp.zeros(ops.key.shape, jnp.float32),
        jnp.zeros(ops.value.shape, jnp.float32),
    )

    def visit(state, pair):
        d_query, d_key, d_value = state
        i, j = pair
        dq, dk, dv = _gradients(
            tiles,
            _take(ops.query, i),
            _take(ops.key, j),
            _take(ops.value, j),
            ops.visible(tiles, i, j),
            _take(lse, i),
            _take(row_dot, i),
            _take(d_out, i),
        )
        return (
            _put(d_query, _take(d_query, i) + dq, i),
            _put(d_key, _take(d_key, j) + dk, j),
            _put(d_value, _take(d_value, j) + dv, j),
        ), None

    return _visit_pairs(tiles, visit, _varying(state, *ops.arrays(), lse, row_dot, d_out))


# -- the differentiable function ----------------------------------------------------------


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[batch, len, heads, d]`` -> ``[batch, len, kv_heads, groups, d]``."""
    return x.reshape(*x.shape[:2], kv_heads, x.shape[2] // kv_heads, x.shape[3])


def _rows(lse: jax.Array, tiles: Tiling) -> jax.Array:
    """Per-row statistics in the forward pass's layout (``[batch, kv_heads, groups, q]``,
    or tiled ``[query tiles, batch, kv_heads, groups, block]``) -> ``[batch, q, heads]``."""
    if not tiles.single:
        lse = jnp.moveaxis(lse, 0, -2)  # [batch, kv_heads, groups, tiles, block]
        lse = lse.reshape(*lse.shape[:-2], -1)[..., : tiles.query_len]
    lse = jnp.moveaxis(lse, -1, 1)  # [batch, q, kv_heads, groups]
    return lse.reshape(*lse.shape[:2], -1)


def _in_forward_layout(rows: jax.Array, tiles: Tiling, kv_heads: int) -> jax.Array:
    """The inverse of :func:`_rows`: ``[batch, q, heads]`` -> the forward pass's layout.
    Padded query rows get a log-sum-exp that gives their weights 0."""
    grouped = jnp.moveaxis(rows.reshape(*rows.shape[:2], kv_heads, -1), 1, -1)
    if tiles.single:
        return grouped  # [batch, kv_heads, groups, q]
    padded = _pad_to(grouped, 3, tiles.query_tiles * tiles.query_block, fill=-MASKED)
    tiled = padded.reshape(*padded.shape[:3], tiles.query_tiles, tiles.query_block)
    return jnp.moveaxis(tiled, 3, 0)  # [query tiles, batch, kv_heads, groups, block]


def _forward(tiles: Tiling, query, key, value, query_positions, query_segment, key_segment):
    """The float32 output ``[batch, q, heads, dv]`` and the rows' log-sum-exp in the
    forward pass's layout (:func:`_rows`)."""
    grouped = _grouped(query, key.shape[2])
    if tiles.single:
        visible = _visible(tiles, query_positions, 0, query_segment, key_segment)
        weights, maximum = _weights(_scores(tiles, grouped, key, visible), visible)
        total = weights.sum(axis=-1)
        if not tiles.aligned:  # a row may see nothing (causal self-attention sees itself)
            total = jnp.where(total == 0.0, 1.0, total)
        out = _weighted_values(weights, value) / _per_row(total)
        lse = maximum + jnp.log(total)
    else:
        ops = _cut(tiles, grouped, key, value, query_positions, query_segment, key_segment)
        out, lse = _tiled_forward(tiles, ops)
        out = _untile(out, tiles.query_len)
    return out.reshape(*query.shape[:3], -1), lse


def _gradients_of(tiles: Tiling, residuals, d_result):
    """``dq, dk, dv`` (float32) from the forward pass's residuals and the output's
    cotangent."""
    if tiles.single:
        # The barrier ties the one tile's recomputation to the incoming gradient: without
        # it XLA may compute the tile again as soon as q and k exist, in the forward pass,
        # and hold it until the backward pass reads it (a loop over tiles reads the
        # gradient from its first step).
        residuals, d_result = jax.lax.optimization_barrier((residuals, d_result))
    query, key, value, query_positions, query_segment, key_segment, result, lse = residuals
    kv_heads = key.shape[2]
    grouped, d_out = _grouped(query, kv_heads), _grouped(d_result, kv_heads)
    row_dot = _row_dot(_grouped(result, kv_heads), d_out)
    if tiles.single:
        visible = _visible(tiles, query_positions, 0, query_segment, key_segment)
        d_query, d_key, d_value = _gradients(
            tiles, grouped, key, value, visible, lse, row_dot, d_out
        )
    else:
        ops = _cut(tiles, grouped, key, value, query_positions, query_segment, key_segment)
        tiled = functools.partial(_tiles, tile=tiles.query_block, count=tiles.query_tiles)
        row_dot = jnp.moveaxis(tiled(jnp.moveaxis(row_dot, -1, 1)), 2, -1)
        d_query, d_key, d_value = _tiled_backward(tiles, ops, lse, row_dot, tiled(d_out))
        d_query = _untile(d_query, tiles.query_len)
        d_key, d_value = _untile(d_key, tiles.key_len), _untile(d_value, tiles.key_len)
    return d_query.reshape(query.shape), d_key, d_value


def _backward(tiles: Tiling, residuals, d_result):
    """:func:`_gradients_of` in the operands' dtypes, and no cotangent for the positions
    and segments."""
    query, key, value = residuals[:3]
    d_query, d_key, d_value = _gradients_of(tiles, residuals, d_result)
    return (
        d_query.astype(query.dtype),
        d_key.astype(key.dtype),
        d_value.astype(value.dtype),
        None,
        None,
        None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(tiles: Tiling, query, key, value, query_positions, query_segment, key_segment):
    return _attention_forward(
        tiles, query, key, value, query_positions, query_segment, key_segment
    )[0]


def _attention_forward(
    tiles: Tiling, query, key, value, query_positions, query_segment, key_segment
):
    out, lse = _forward(tiles, query, key, value, query_positions, query_segment, key_segment)
    # The output in its own dtype is a buffer of its own (the barrier), as a fused kernel's
    # is: else XLA may compute it from the float32 accumulator in each of its readers, the
    # backward pass's among them, and keep that, twice its size, to the backward pass.
    result, lse = jax.lax.optimization_barrier((out.astype(query.dtype), lse))
    result, lse = checkpoint_name((result, lse), RESIDUALS)
    operands = (query, key, value, query_positions, query_segment, key_segment)
    return result, (*operands, result, lse)


def _attention_backward(tiles: Tiling, residuals, d_result):
    return _backward(tiles, residuals, d_result)


_attention.defvjp(_attention_forward, _attention_backward)
