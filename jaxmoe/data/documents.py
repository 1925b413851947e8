"""Document boundaries inside a batch of token rows: pure JAX functions.

A batch row is a window of ``S + 1`` consecutive corpus tokens, ``tokens[..., :S]``
the inputs and ``tokens[..., 1:]`` the targets; every document in the corpus ends with
the end-of-document id ``eod_id`` (:mod:`jaxmoe.data.corpus`). As in Megatron-LM
(``get_ltor_masks_and_position_ids`` with ``eod_mask_loss``, ``reset_attention_mask``
and ``reset_position_ids``), an EOD token is the last token of its document, and the
token after it starts the next one. The document of a position is the number of EODs
before it in the row, so a row that starts mid-document counts the piece it starts
with as its first document (segment 0, positions from 0).

- :func:`loss_mask` ``[..., S]`` bool: False where the target belongs to another
  document than its input position's, i.e. where the input is EOD (the target is the
  next document's first token). The target EOD itself is kept: the model learns where
  documents end.
- :func:`segment_ids` ``[..., S]`` int32: the document of each input position, 0, 1, ...
  in the row; attention stays where query and key segments are equal
  (:func:`same_document`, combined with the causal mask).
- :func:`positions` ``[..., S]`` int32: each input position's offset from the start of
  its document in the row, for rotary embeddings.

``eod_id`` may be a Python int or a traced scalar; ``None`` means no documents (mask
all True, one segment, positions ``0 .. S-1``). Every function works on any leading
shape; the last axis is the sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DocumentMasks(NamedTuple):
    """The three document arrays of a batch, each ``[..., S]``."""

    loss_mask: jax.Array  # bool: count the target's loss
    segment_ids: jax.Array  # int32: the input position's document in its row
    positions: jax.Array  # int32: the input position's offset inside its document


def _inputs(tokens: jax.Array) -> jax.Array:
    return jnp.asarray(tokens)[..., :-1]


def document_starts(tokens: jax.Array, eod_id: int | jax.Array | None) -> jax.Array:
    """``[..., S]`` bool: input position j starts a new document in its row (j > 0 and
    the input before it is EOD). Position 0 is never a start, whatever precedes the row."""
    inputs = _inputs(tokens)
    if eod_id is None:
        return jnp.zeros(inputs.shape, dtype=bool)
    after_eod = inputs[..., :-1] == eod_id
    first = jnp.zeros((*inputs.shape[:-1], 1), dtype=bool)
    return jnp.concatenate([first, after_eod], axis=-1)


def loss_mask(tokens: jax.Array, eod_id: int | jax.Array | None) -> jax.Array:
    """``[..., S]`` bool: False for a target after an EOD input (another document's)."""
    inputs = _inputs(tokens)
    if eod_id is None:
        return jnp.ones(inputs.shape, dtype=bool)
    return inputs != eod_id


def segment_ids(tokens: jax.Array, eod_id: int | jax.Array | None) -> jax.Array:
    """``[..., S]`` int32: the number of EOD inputs before each input position."""
    return jnp.cumsum(document_starts(tokens, eod_id), axis=-1, dtype=jnp.int32)


def positions(tokens: jax.Array, eod_id: int | jax.Array | None) -> jax.Array:
    """``[..., S]`` int32: each input position minus the start of its document in the row."""
    starts = document_starts(tokens, eod_id)
    index = jnp.broadcast_to(jnp.arange(starts.shape[-1], dtype=jnp.int32), starts.shape)
    latest_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=starts.ndim - 1)
    return index - latest_start


def document_masks(tokens: jax.Array, eod_id: int | jax.Array | None) -> DocumentMasks:
    """Loss mask, segment ids and positions of ``tokens`` ``[..., S + 1]`` at once."""
    return DocumentMasks(
        loss_mask(tokens, eod_id), segment_ids(tokens, eod_id), positions(tokens, eod_id)
    )


def same_document(query_segments: jax.Array, key_segments: jax.Array | None = None) -> jax.Array:
    """``[..., Sq, Sk]`` bool: query and key positions in the same document of the row.

    Not causal: combine it with the causal mask (``&``). ``key_segments`` defaults to the
    query's (self-attention over the whole row); with sequence parallelism, give the
    device's slice of the row's segment ids as queries and the whole row's as keys.
    """
    keys = query_segments if key_segments is None else key_segments
    return query_segments[..., :, None] == keys[..., None, :]
