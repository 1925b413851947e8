"""Document boundaries of a batch: loss mask, segment ids, positions and the attention
mask, exact against definitions written from the corpus's point of view."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.data.documents import (
    document_masks,
    document_starts,
    loss_mask,
    positions,
    same_document,
    segment_ids,
)

EOD = 0


def test_a_row_with_several_documents_by_hand():
    # inputs 5 1 EOD | 7 8 EOD | EOD | 9, targets shifted by one; the row starts mid-document.
    row = jnp.array([[5, 1, EOD, 7, 8, EOD, EOD, 9, 3]])
    masks = document_masks(row, EOD)
    np.testing.assert_array_equal(masks.loss_mask, [[1, 1, 0, 1, 1, 0, 0, 1]])
    np.testing.assert_array_equal(masks.segment_ids, [[0, 0, 0, 1, 1, 1, 2, 3]])
    np.testing.assert_array_equal(masks.positions, [[0, 1, 2, 0, 1, 2, 0, 0]])
    assert masks.loss_mask.dtype == bool
    assert masks.segment_ids.dtype == masks.positions.dtype == jnp.int32
    np.testing.assert_array_equal(document_starts(row, EOD), [[0, 0, 0, 1, 0, 0, 1, 1]])


def test_edge_rows():
    # No EOD; EOD first; EOD last (a target only: it changes nothing of the inputs'); all EOD.
    rows = jnp.array(
        [
            [4, 4, 4, 4, 4],
            [EOD, 4, 4, 4, 4],
            [4, 4, 4, 4, EOD],
            [EOD, EOD, EOD, EOD, EOD],
        ]
    )
    masks = document_masks(rows, EOD)
    np.testing.assert_array_equal(
        masks.loss_mask, [[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        masks.segment_ids, [[0, 0, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 2, 3]]
    )
    np.testing.assert_array_equal(
        masks.positions, [[0, 1, 2, 3], [0, 0, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]]
    )


def _corpus(rng: np.random.Generator, length: int, eod_rate: float) -> np.ndarray:
    tokens = rng.integers(1, 50, size=length)
    tokens[rng.random(length) < eod_rate] = EOD
    return tokens


def _reference(corpus: np.ndarray, start: int, width: int):
    """From the corpus: the document of token g is the number of EODs before g. A target
    counts when it is in its input's document; segments count documents from the row's
    first; a position is its distance from its document's first token, or from the row's
    start for the document the row starts inside."""
    document = np.concatenate([[0], np.cumsum(corpus == EOD)])[:-1]
    inputs = np.arange(start, start + width)
    mask = document[inputs + 1] == document[inputs]
    segments = document[inputs] - document[start]
    first_token = {}
    for g in range(len(corpus)):
        first_token.setdefault(document[g], g)
    pos = np.array([g - max(first_token[document[g]], start) for g in inputs])
    return mask, segments, pos


@pytest.mark.parametrize("eod_rate", [0.0, 0.02, 0.2, 0.6])
def test_random_windows_match_the_corpus_definitions(eod_rate):
    rng = np.random.default_rng(int(eod_rate * 100))
    corpus = _corpus(rng, 4000, eod_rate)
    seq_len = 32
    starts = rng.integers(0, len(corpus) - seq_len, size=64)
    rows = np.stack([corpus[s : s + seq_len + 1] for s in starts])
    masks = jax.jit(document_masks)(rows, jnp.int32(EOD))  # the EOD id may be traced
    for row, start in enumerate(starts):
        mask, segments, pos = _reference(corpus, start, seq_len)
        np.testing.assert_array_equal(masks.loss_mask[row], mask)
        np.testing.assert_array_equal(masks.segment_ids[row], segments)
        np.testing.assert_array_equal(masks.positions[row], pos)


def test_attention_mask_keeps_queries_inside_their_document():
    rng = np.random.default_rng(7)
    corpus = _corpus(rng, 2000, 0.15)
    rows = np.stack([corpus[s : s + 17] for s in (0, 100, 333, 1500)])
    segments = segment_ids(rows, EOD)
    seq = segments.shape[-1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    allowed = same_document(segments) & causal
    assert allowed.shape == (4, seq, seq)
    before = np.cumsum(rows[:, :-1] == EOD, axis=1)[:, :-1]
    document = np.concatenate([np.zeros((4, 1), int), before], axis=1)
    for b in range(4):
        for q in range(seq):
            for k in range(seq):
                expected = k <= q and document[b, q] == document[b, k]
                assert bool(allowed[b, q, k]) == expected
    # A query slice (sequence parallelism) against the whole row's keys: the same rows.
    np.testing.assert_array_equal(
        same_document(segments[:, 4:8], segments), same_document(segments)[:, 4:8]
    )


def test_any_leading_shape_and_no_eod():
    rng = np.random.default_rng(3)
    rows = _corpus(rng, 2 * 3 * 9, 0.3).reshape(2, 3, 9)
    masks = document_masks(rows, EOD)
    flat = document_masks(rows.reshape(6, 9), EOD)
    for got, want in zip(masks, flat, strict=True):
        assert got.shape == (2, 3, 8)
        np.testing.assert_array_equal(got.reshape(6, 8), want)
    plain = document_masks(rows, None)
    np.testing.assert_array_equal(plain.loss_mask, np.ones((2, 3, 8), bool))
    np.testing.assert_array_equal(plain.segment_ids, np.zeros((2, 3, 8), int))
    np.testing.assert_array_equal(plain.positions, np.broadcast_to(np.arange(8), (2, 3, 8)))
    np.testing.assert_array_equal(loss_mask(rows, EOD), masks.loss_mask)
    np.testing.assert_array_equal(positions(rows, EOD), masks.positions)
