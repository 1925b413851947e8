"""A wrong shape or dtype at a layer boundary fails at once with chex's message.

Without the checks the same calls fail later, inside ``dot_general``, ``vmap``
or the scatter, with an error about operands the caller never saw; the last
test shows that by turning the checks off.
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig
from jaxmoe.layers.attention import CausalSelfAttention
from jaxmoe.layers.dispatch import combine, dispatch, plan_dispatch
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.moe import MoELayer
from jaxmoe.layers.router import Router
from jaxmoe.layers.transformer import GPTMoE

D_MODEL, NUM_EXPERTS = 8, 4


def moe_layer():
    config = MoEConfig(num_experts=NUM_EXPERTS, top_k=2, capacity_factor=None)
    return MoELayer(D_MODEL, 16, config, dtype=jnp.float32, rngs=nnx.Rngs(0))


def plan(groups=2, tokens=3, top_k=2):
    index = jnp.zeros((groups, tokens, top_k), jnp.int32)
    return plan_dispatch(index, NUM_EXPERTS, capacity=tokens)


def model():
    config = ModelConfig(
        vocab_size=32, d_model=D_MODEL, num_heads=2, num_layers=2, d_ff=16, seq_len=6
    )
    return GPTMoE(config, MoEConfig(num_experts=NUM_EXPERTS), rngs=nnx.Rngs(0))


# Each: a call with one wrong shape or dtype, and words chex's message must contain.
WRONG_CALLS = {
    "router d_model": (
        lambda: Router(D_MODEL, NUM_EXPERTS, top_k=1, rngs=nnx.Rngs(0))(jnp.zeros((2, 3, 5))),
        "router input",
    ),
    "moe d_model": (lambda: moe_layer()(jnp.zeros((2, 4, D_MODEL + 1))), "MoE input"),
    "experts count": (
        lambda: Experts(NUM_EXPERTS, D_MODEL, 16, dtype=jnp.float32, rngs=nnx.Rngs(0))(
            jnp.zeros((NUM_EXPERTS - 1, 3, D_MODEL))
        ),
        "experts input",
    ),
    "attention d_model": (
        lambda: CausalSelfAttention(
            ModelConfig(d_model=D_MODEL, num_heads=2), dtype=jnp.float32, rngs=nnx.Rngs(0)
        )(jnp.zeros((2, 3, D_MODEL * 2))),
        "attention input",
    ),
    "dispatch groups": (
        lambda: dispatch(jnp.zeros((3, 3, D_MODEL)), plan(groups=2), NUM_EXPERTS * 3),
        "plan slots",
    ),
    "combine weights": (
        lambda: combine(jnp.zeros((2, NUM_EXPERTS * 3, D_MODEL)), plan(), jnp.ones((2, 3, 1))),
        "assert_equal_shape",
    ),
    "float expert index": (
        lambda: plan_dispatch(jnp.zeros((2, 3, 1)), NUM_EXPERTS, capacity=3),
        "assert_type",
    ),
    "float tokens": (lambda: model()(jnp.zeros((2, 6))), "assert_type"),
    "sequence too long": (lambda: model()(jnp.zeros((2, 7), jnp.int32)), "less than or equal"),
}


@pytest.mark.parametrize("name", list(WRONG_CALLS))
def test_wrong_shape_at_a_layer_boundary_raises_chex_error(name):
    call, words = WRONG_CALLS[name]

    with pytest.raises(AssertionError, match=r"\[Chex\]") as raised:
        jax.jit(call)()  # under jit too: the checks run on the traced shapes

    assert words in str(raised.value)


@pytest.mark.parametrize("name", ["moe d_model", "experts count", "dispatch groups"])
def test_without_the_checks_the_error_comes_from_deep_inside(name):
    call, _ = WRONG_CALLS[name]
    chex.disable_asserts()
    try:
        with pytest.raises(Exception) as raised:
            jax.jit(call)()
    finally:
        chex.enable_asserts()

    assert not isinstance(raised.value, AssertionError)
    assert WRONG_CALLS[name][1] not in str(raised.value)  # nothing names the boundary
