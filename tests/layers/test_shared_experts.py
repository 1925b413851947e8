"""Shared experts: a dense FFN beside the routed experts, with Qwen-MoE's optional gate."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.config.moe import shared_width
from jaxmoe.layers.block import Block
from jaxmoe.layers.mlp import DenseFFN
from jaxmoe.layers.shared_experts import SharedExperts

MODEL = ModelConfig(
    d_model=16, num_heads=2, d_ff=32, seq_len=8, activation="swiglu", linear_bias=False
)
MOE = MoEConfig(num_experts=4, top_k=2, num_shared_experts=2, d_expert=8)


def test_the_shared_width_is_their_number_times_their_width():
    assert shared_width(MODEL, MOE) == 2 * 8
    assert shared_width(MODEL, dataclasses.replace(MOE, d_shared_expert=24)) == 48
    assert shared_width(MODEL, dataclasses.replace(MOE, d_expert=None)) == 2 * 32


def test_gated_shared_experts_scale_the_ffn_by_a_sigmoid_per_token():
    gated = dataclasses.replace(MOE, shared_expert_gate=True)
    shared = SharedExperts(MODEL, gated, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 16)), jnp.float32)
    ungated = nnx.merge(*nnx.split(shared.ffn))
    expected = jax.nn.sigmoid(x @ shared.gate.kernel[...]) * ungated(x)
    np.testing.assert_allclose(shared(x), expected, rtol=1e-6, atol=1e-6)
    assert isinstance(shared.ffn, DenseFFN)


def test_an_moe_block_adds_the_shared_output_to_the_routed_one():
    block = Block(MODEL, MOE, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 16)), jnp.float32)

    @nnx.jit
    def block_and_parts(block, x):
        y, stats = block(x)
        attended = x + block.attention(block.attention_norm(x))
        normed = block.ffn_norm(attended)
        routed, _ = block.ffn(normed)
        return y, stats, attended + routed + block.shared(normed)

    y, stats, parts = block_and_parts(block, x)
    np.testing.assert_allclose(y, parts, rtol=1e-5, atol=1e-5)
    assert stats is not None
    plain = Block(
        MODEL, dataclasses.replace(MOE, num_shared_experts=0), dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    assert plain.shared is None
