"""The attention core: blockwise (flash) attention against the dense reference, forward
and backward, over tiles that do not divide the sequence, grouped-query heads, packed
documents, sliding windows and cached decoding; the tiles it skips and the scores it
never holds; and which core ``model.attention`` resolves to.

Tolerances: float32 within 2e-6 absolute (the online softmax reorders float32 sums);
bfloat16 within 2e-2 of the float32 reference, where the dense core itself rounds its
scores to bfloat16 before the softmax and lands within 4e-2.
"""

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import ModelConfig
from jaxmoe.layers.attention_core import AttentionCore, dense_attention, resolve_core
from jaxmoe.layers.blockwise_attention import tiling
from scheduling.program import jax_adapter
from scheduling.program.batch_layout import analyze
from scheduling.program.capture import Constant, Phase, Value, inline_jaxpr


def operands(batch, seq, heads, kv_heads, dim, dtype=jnp.float32, seed=0, value_dim=None):
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq, heads, dim), (batch, seq, kv_heads, dim)]
    shapes.append((batch, seq, kv_heads, value_dim or dim))
    return [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]


def packed_segments(batch, seq, seed=1):
    """Documents of random lengths packed into each row: non-decreasing ids."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 4, size=(batch, seq)), axis=1), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def outputs_and_gradients(core, query, key, value, **masks):
    """The core's output and its gradients for a fixed cotangent, as one compiled program
    (op by op, the blockwise core's loops would dispatch and compile each op alone)."""
    cotangent = jnp.asarray(
        np.random.default_rng(7).normal(size=(*query.shape[:3], value.shape[-1])), query.dtype
    )
    out, pullback = jax.vjp(lambda q, k, v: core(q, k, v, **masks), query, key, value)
    return (out, *pullback(cotangent))


CASES = {
    # (seq, heads, kv_heads, block, segments, window)
    "one-tile": (16, 4, 4, 64, False, None),
    "tiles-divide": (32, 4, 2, 8, False, None),
    "tiles-pad": (37, 4, 2, 8, False, None),
    "gqa-one-kv-head-packed": (30, 4, 1, 8, True, None),
    "window": (40, 2, 2, 8, False, 11),
    "window-packed": (40, 2, 1, 16, True, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_matches_dense_forward_and_backward_in_float32(case):
    seq, heads, kv_heads, block, segments, window = CASES[case]
    query, key, value = operands(2, seq, heads, kv_heads, 8)
    masks = {"segment_ids": packed_segments(2, seq)} if segments else {}

    want = outputs_and_gradients(AttentionCore("dense", window=window), query, key, value, **masks)
    got = outputs_and_gradients(
        AttentionCore("blockwise", block=block, window=window), query, key, value, **masks
    )

    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-6, err_msg=name)
    assert float(jnp.abs(want[2]).max()) > 0.1  # the gradients are not trivially zero


def test_blockwise_in_bfloat16_is_as_close_to_float32_as_the_dense_core():
    query, key, value = operands(2, 48, 4, 2, 16)
    masks = {"segment_ids": packed_segments(2, 48)}
    reference = outputs_and_gradients(AttentionCore("dense"), query, key, value, **masks)
    low = [x.astype(jnp.bfloat16) for x in (query, key, value)]

    blockwise = outputs_and_gradients(AttentionCore("blockwise", block=16), *low, **masks)
    dense = outputs_and_gradients(AttentionCore("dense"), *low, **masks)

    for name, b, d, r in zip(("out", "dq", "dk", "dv"), blockwise, dense, reference, strict=True):
        assert b.dtype == jnp.bfloat16, name
        blockwise_error = float(jnp.abs(b.astype(jnp.float32) - r).max())
        dense_error = float(jnp.abs(d.astype(jnp.float32) - r).max())
        assert blockwise_error < 2e-2, (name, blockwise_error)
        assert dense_error < 4e-2, (name, dense_error)


def test_values_may_be_narrower_than_queries_and_keys():
    # Multi-head latent attention's shape: 24-wide queries and keys, 16-wide values.
    query, key, value = operands(1, 20, 2, 2, 24, value_dim=16)
    want = outputs_and_gradients(AttentionCore("dense"), query, key, value)
    got = outputs_and_gradients(AttentionCore("blockwise", block=8), query, key, value)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-6)


@pytest.mark.parametrize("block", [4, 64])
def test_decoding_over_a_cache_matches_the_dense_core(block):
    # Three new queries at positions 9..11 of a 16-position cache; 12.. are unwritten.
    query, _, _ = operands(2, 3, 4, 2, 8)
    _, key, value = operands(2, 16, 4, 2, 8, seed=5)
    positions = jnp.arange(9, 12)
    want = dense_attention(query, key, value, query_positions=positions)
    got = AttentionCore("blockwise", block=block)(query, key, value, query_positions=positions)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    # The unwritten positions do not matter.
    scrambled = value.at[:, 12:].set(1e3)
    core = AttentionCore("blockwise", block=block)
    again = core(query, key, scrambled, query_positions=positions)
    np.testing.assert_allclose(again, got, rtol=0, atol=0)


def test_the_tiles_above_the_causal_diagonal_and_before_the_window_are_skipped():
    causal = tiling(64, 64, 16, window=None, aligned=True, scale=1.0)
    assert causal.pairs() == tuple((i, j) for i in range(4) for j in range(i + 1))
    windowed = tiling(64, 64, 16, window=16, aligned=True, scale=1.0)
    assert windowed.pairs() == ((0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3))
    # Queries whose positions are operands (decoding) visit every tile.
    assert len(tiling(1, 64, 16, window=None, aligned=False, scale=1.0).pairs()) == 4


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value a jaxpr (and the sub-programs in it) makes."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(var.aval.shape)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            largest = max(largest, _largest_intermediate(sub))
    return largest


@pytest.mark.parametrize("kind", ["blockwise", "dense"])
def test_the_blockwise_core_never_holds_more_than_a_tile_of_scores_per_head(kind):
    seq, heads, block = 256, 2, 32
    query, key, value = operands(1, seq, heads, heads, 4)

    def loss(q, k, v):
        return AttentionCore(kind, block=block)(q, k, v).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(query, key, value)
    largest = _largest_intermediate(jaxpr.jaxpr)
    if kind == "dense":
        assert largest >= heads * seq * seq
    else:  # one tile of scores per head, or the operands' own [seq, heads, 4] size
        assert largest <= max(heads * block * block, seq * heads * 4)


@pytest.mark.parametrize("n", [2, 4])
def test_the_blockwise_loop_runs_chunk_by_chunk_of_the_batch(n):
    """Lancet's partition can cut the blockwise core's loops into chunks of the batch
    (scheduling.program.batch_layout): over packed documents and a sliding window, each
    chunk's loop, rebuilt at its size, gives exactly its rows of the whole loop."""
    core = AttentionCore("blockwise", block=8, window=13)
    query, key, value = operands(4, 37, 4, 2, 8)
    segments = packed_segments(4, 37)

    def loss(query, key, value, segments):
        return jnp.sum(core(query, key, value, segment_ids=segments) ** 2)

    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        query, key, value, segments
    )
    inputs = [Value(var.aval) for var in closed.jaxpr.invars]
    ops, _ = inline_jaxpr(closed, inputs, "", Phase.FORWARD)
    layouts = analyze(SimpleNamespace(ops=ops), inputs)
    env = dict(zip(inputs, (query, key, value, segments), strict=True))

    def read(atom):
        return atom.value if isinstance(atom, Constant) else env[atom]

    loops = 0
    for position, op in enumerate(ops):
        operands_ = [read(atom) for atom in op.inputs]
        results = jax_adapter.bind_equation(op.eqn, operands_)
        env.update(zip(op.outputs, results, strict=True))
        how = layouts.chunkings.get(position)
        if op.primitive != "scan" or how is None:
            continue
        loops += 1
        for chunk in range(n):
            pieces = [
                x if cut is None else np.split(np.asarray(x), n, axis=cut)[chunk]
                for x, cut in zip(operands_, how.inputs, strict=True)
            ]
            copy = jax_adapter.bind_equation(op.eqn.replace(params=how.params(n)), pieces)
            for got, whole, split in zip(copy, results, how.outputs, strict=True):
                rows = np.split(np.asarray(whole), n, split.axis)[chunk]
                np.testing.assert_array_equal(got, rows)
    assert loops == 2  # the forward loop and the backward's (one phase here: no AD stacks)


def test_under_recomputation_both_loops_are_captured():
    """Differentiated under ``jax.checkpoint`` (``model.recompute``), the core's forward
    rule is evaluated through a call (``eval_jaxpr`` in JAX 0.12): capture inlines it, so
    that the scheduler sees and prices the forward loop and its recomputation."""
    core = AttentionCore("blockwise", block=8)
    query, key, value = operands(2, 32, 2, 2, 8)
    recomputed = jax.checkpoint(lambda q, k, v: jnp.sum(core(q, k, v) ** 2))
    closed = jax.make_jaxpr(jax.grad(recomputed, argnums=(0, 1, 2)))(query, key, value)
    assert "eval_jaxpr" in {eqn.primitive.name for eqn in closed.jaxpr.eqns}
    inputs = [Value(var.aval) for var in closed.jaxpr.invars]
    ops, _ = inline_jaxpr(closed, inputs, "", Phase.FORWARD)
    assert not [op for op in ops if op.is_opaque and op.primitive != "scan"]
    assert [op.primitive for op in ops].count("scan") == 3  # forward, recomputed, backward


def test_auto_resolves_to_blockwise_off_gpu_and_cudnn_is_refused_in_one_line():
    model = ModelConfig(dtype="bfloat16")
    core = resolve_core(model.attention, dtype=jnp.bfloat16, head_dim=32)
    assert core == AttentionCore("blockwise", block=model.attention_block)
    with pytest.raises(ValueError, match=r"^model.attention=cudnn: .*cpu.*\n?$"):
        resolve_core("cudnn", dtype=jnp.bfloat16, head_dim=32)


def test_bad_attention_fields_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^model\.attention="):
        ModelConfig(attention="flash")
    with pytest.raises(ValueError, match=r"^model\.attention_block="):
        ModelConfig(attention_block=0)
    with pytest.raises(ValueError, match=r"^model\.sliding_window="):
        ModelConfig(sliding_window=-2)
