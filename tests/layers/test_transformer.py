"""The GPT-MoE decoder on one device: its layers, shapes, causality, seeding and wiring.

The wiring reference composes the model's own blocks by hand (embeddings plus positions,
the blocks in order, the final norm, the tied head), so it checks how the model puts its
parts together; the parts have tests of their own.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.layers.block import Block
from jaxmoe.layers.mlp import DenseFFN
from jaxmoe.layers.moe import MoELayer
from jaxmoe.layers.transformer import GPTMoE

BATCH, SEQ, VOCAB, NUM_EXPERTS = 2, 16, 32, 4
DROPLESS_TOP2 = MoEConfig(num_experts=NUM_EXPERTS, top_k=2, capacity_factor=None)
CAPACITY_TOP1 = MoEConfig(num_experts=NUM_EXPERTS, top_k=1, capacity_factor=1.0)


def model_config(num_layers=4, moe_every=2, dtype="float32"):
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=16,
        num_heads=2,
        num_layers=num_layers,
        d_ff=32,
        seq_len=SEQ,
        moe_every=moe_every,
        dtype=dtype,
    )


@functools.cache
def compiled(moe=DROPLESS_TOP2, seed=0):
    """A model and its jitted forward pass (one compile per configuration)."""
    model = GPTMoE(model_config(), moe, rngs=nnx.Rngs(seed))
    return model, jax.jit(lambda tokens: model(tokens))


def tokens_of(seed=0, batch=BATCH, seq=SEQ):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)).astype(np.int32)


@pytest.mark.parametrize(
    ("num_layers", "moe_every", "moe_layers"),
    [(4, 2, (1, 3)), (4, 1, (0, 1, 2, 3)), (3, 3, (2,)), (4, 4, (3,))],
)
def test_every_moe_every_th_layer_is_an_moe_layer(num_layers, moe_every, moe_layers):
    model = GPTMoE(model_config(num_layers, moe_every), DROPLESS_TOP2, rngs=nnx.Rngs(0))

    assert len(model.blocks) == num_layers
    assert tuple(i for i, block in enumerate(model.blocks) if block.is_moe) == moe_layers
    for i, block in enumerate(model.blocks):
        expected = MoELayer if i in moe_layers else DenseFFN
        assert isinstance(block.ffn, expected), f"layer {i}"
        if block.is_moe:
            assert block.ffn.experts.w_in.shape == (NUM_EXPERTS, 16, 32)


def test_logits_and_routing_stats_have_their_shapes():
    _, forward = compiled()
    logits, stats = forward(tokens_of())

    chex.assert_shape(logits, (BATCH, SEQ, VOCAB))
    assert logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    moe_layers = 2  # layers 1 and 3
    chex.assert_shape([stats.aux_loss, stats.z_loss], (moe_layers,))
    chex.assert_shape(stats.tokens_per_expert, (moe_layers, NUM_EXPERTS))
    chex.assert_shape([stats.dropped, stats.assignments], (moe_layers,))
    assert stats.slot_load is None and stats.kept_by_copies is None
    assignments = BATCH * SEQ * DROPLESS_TOP2.top_k
    np.testing.assert_array_equal(np.sum(stats.tokens_per_expert, axis=-1), assignments)
    np.testing.assert_array_equal(stats.assignments, assignments)
    np.testing.assert_array_equal(stats.dropped, 0)  # dropless
    assert np.all(np.asarray(stats.aux_loss) >= 1.0 - 1e-5)  # Switch loss: at least 1
    assert np.all(np.asarray(stats.z_loss) > 0)


def test_forward_is_the_blocks_composed_in_order_with_a_tied_head():
    model, forward = compiled()
    tokens = tokens_of(1)

    def by_hand(tokens):
        x = model.token_embed(tokens) + model.position_embed[...][None, : tokens.shape[1]]
        per_layer = []
        for block in model.blocks:
            x, stats = block(x)
            if stats is not None:
                per_layer.append(stats)
        logits = model.final_norm(x) @ model.token_embed.embedding[...].T
        return logits, per_layer

    logits, stats = forward(tokens)
    expected_logits, expected_stats = jax.jit(by_hand)(tokens)

    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert len(expected_stats) == 2
    for layer, expected in enumerate(expected_stats):  # stacked in depth order
        np.testing.assert_array_equal(stats.tokens_per_expert[layer], expected.tokens_per_expert)
        np.testing.assert_allclose(stats.aux_loss[layer], expected.aux_loss, rtol=1e-6)
        np.testing.assert_allclose(stats.z_loss[layer], expected.z_loss, rtol=1e-6)
    # The head has no weights of its own: it is the token embedding.
    assert set(nnx.to_pure_dict(nnx.state(model))) == {
        "token_embed",
        "position_embed",
        "blocks",
        "final_norm",
    }


def test_a_block_is_pre_norm_attention_then_ffn_with_residuals():
    block = Block(model_config(), None, dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(4).normal(size=(BATCH, SEQ, 16)), jnp.float32)

    y, stats = block(x)

    h = x + block.attention(block.attention_norm(x))
    expected = h + block.ffn(block.ffn_norm(h))
    assert stats is None and not block.is_moe
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# Capacity-limited top-2 routing is left out on purpose: a later token's first choice
# outranks an earlier token's second choice for a slot, so it is not causal.
@pytest.mark.parametrize("moe", [DROPLESS_TOP2, CAPACITY_TOP1], ids=["dropless-top2", "top1"])
def test_the_model_is_causal_end_to_end(moe):
    _, forward = compiled(moe)
    tokens = tokens_of(2)
    position = 9
    changed = tokens.copy()
    changed[:, position:] = (tokens[:, position:] + 1 + tokens_of(3)[:, position:] % 7) % VOCAB

    before, _ = forward(tokens)
    after, _ = forward(changed)

    np.testing.assert_allclose(after[:, :position], before[:, :position], rtol=0, atol=1e-5)
    for i in range(position, SEQ):
        assert not np.allclose(after[:, i], before[:, i], atol=1e-3), f"position {i}"


def test_a_prefix_gets_the_logits_of_the_full_sequence():
    # Positions are taken from the start of the table; with causal attention and dropless
    # routing in per-sequence groups, the first 8 positions cannot tell the two apart.
    model, forward = compiled()
    tokens = tokens_of(4)

    full, _ = forward(tokens)
    prefix, stats = jax.jit(lambda t: model(t))(tokens[:, :8])

    chex.assert_shape(prefix, (BATCH, 8, VOCAB))
    np.testing.assert_allclose(prefix, full[:, :8], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.sum(stats.tokens_per_expert, -1), BATCH * 8 * 2)


def test_positions_are_embedded():
    _, forward = compiled()
    same_token = np.full((1, SEQ), 5, np.int32)

    logits, _ = forward(same_token)

    # Causal attention over identical tokens is the same everywhere; only positions differ.
    for i in range(1, SEQ):
        assert not np.allclose(logits[0, i], logits[0, 0], atol=1e-3), f"position {i}"


def test_rejects_longer_sequences_than_the_position_table_and_float_tokens():
    model, _ = compiled()
    with pytest.raises(AssertionError):
        model(jnp.zeros((1, SEQ + 1), jnp.int32))
    with pytest.raises(AssertionError):
        model(jnp.zeros((1, SEQ), jnp.float32))
    with pytest.raises(AssertionError):
        model(jnp.zeros((SEQ,), jnp.int32))


def test_the_same_seed_gives_the_same_parameters():
    def params(seed):
        return nnx.to_pure_dict(
            nnx.state(GPTMoE(model_config(), DROPLESS_TOP2, rngs=nnx.Rngs(seed)))
        )

    first, again, other = params(0), params(0), params(1)

    chex.assert_trees_all_equal(first, again)
    assert jax.tree.structure(other) == jax.tree.structure(first)
    flat = jax.tree_util.tree_flatten_with_path(first)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(other), strict=True):
        name = jax.tree_util.keystr(path)
        if np.any(a != np.mean(a)):  # randomly initialised, not a constant (biases, norms)
            assert not np.array_equal(a, b), f"{name} ignores the seed"


def test_blocks_are_initialised_independently():
    model, _ = compiled()
    kernels = [np.asarray(block.attention.query.kernel[...]) for block in model.blocks]
    for i in range(1, len(kernels)):
        assert not np.allclose(kernels[i], kernels[0]), f"layer {i} repeats layer 0"


def test_compute_dtype_bfloat16_keeps_float32_parameters_and_logits():
    model = GPTMoE(model_config(num_layers=2, dtype="bfloat16"), DROPLESS_TOP2, rngs=nnx.Rngs(0))

    logits, _ = jax.jit(lambda t: model(t))(tokens_of())

    assert logits.dtype == jnp.float32
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    reference = GPTMoE(model_config(num_layers=2), DROPLESS_TOP2, rngs=nnx.Rngs(0))
    expected, _ = jax.jit(lambda t: reference(t))(tokens_of())
    # A token whose experts' scores lie within bfloat16's rounding of each other may be
    # routed elsewhere, and its logits differ by more (here one position of 32).
    close = np.abs(logits - expected) <= 0.1 + 0.05 * np.abs(expected)
    assert close.all(axis=-1).mean() >= 0.95
