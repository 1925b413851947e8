"""The norms (jaxmoe/layers/norms.py): Flax's values and derivatives, with only the input
and the parameters kept for the backward pass, and Flax's own norms in a recomputed block."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.layers.norms import InputKeptLayerNorm, InputKeptRMSNorm, make_norm

PAIRS = {
    "rmsnorm": (InputKeptRMSNorm, nnx.RMSNorm),
    "layernorm": (InputKeptLayerNorm, nnx.LayerNorm),
}


def _pair(norm: str, dtype, width: int = 16):
    kept, flax_norm = PAIRS[norm]
    rngs = lambda: nnx.Rngs(0)
    a, b = kept(width, dtype=dtype, rngs=rngs()), flax_norm(width, dtype=dtype, rngs=rngs())
    # Parameters away from their initial constants, so that their derivatives are tested.
    for module in (a, b):
        for _path, param in nnx.iter_graph(module):
            if isinstance(param, nnx.Param):
                param[...] = param[...] + 0.1 * jnp.arange(width, dtype=param.dtype)
    return a, b


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", PAIRS)
def test_values_and_derivatives_are_flax_own(norm, dtype):
    kept, flax_norm = _pair(norm, dtype)
    x = jax.random.normal(jax.random.key(0), (3, 5, 16), dtype)
    w = jax.random.normal(jax.random.key(1), (16, 4), dtype)

    def loss(module, x):
        return (module(x) @ w).astype(jnp.float32).sum()

    np.testing.assert_array_equal(kept(x), flax_norm(x))
    grads = [jax.jit(nnx.grad(loss, argnums=(0, 1)))(m, x) for m in (kept, flax_norm)]
    (d_kept, dx_kept), (d_flax, dx_flax) = grads
    np.testing.assert_array_equal(dx_kept, dx_flax)
    # The parameters' derivatives sum over the tokens, which XLA may order otherwise.
    for a, b in zip(jax.tree.leaves(d_kept), jax.tree.leaves(d_flax), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("norm", PAIRS)
def test_the_backward_pass_keeps_the_input_and_the_parameters_alone(norm, capsys):
    kept, flax_norm = _pair(norm, jnp.bfloat16)
    x = jnp.ones((4, 16), jnp.bfloat16)

    def residuals(module) -> list[str]:
        graphdef, state = nnx.split(module)
        fn = lambda state, x: nnx.merge(graphdef, state)(x).astype(jnp.float32).sum()
        jax.ad_checkpoint.print_saved_residuals(fn, state, x)
        return capsys.readouterr().out.splitlines()

    kept_residuals = residuals(kept)
    assert len(kept_residuals) == len(jax.tree.leaves(nnx.state(kept))) + 1
    assert not any("f32[4,16]" in line for line in kept_residuals)
    assert any("f32[4,16]" in line for line in residuals(flax_norm))  # as written: more


def test_a_recomputed_block_gets_flax_own_norm():
    """Where the block's backward pass makes its forward values again, the norm's own
    recomputation would be a third pass: it is Flax's there."""
    model = ModelConfig(norm="rmsnorm")
    made = lambda recompute: type(
        make_norm(
            dataclasses.replace(model, recompute=recompute), 8, dtype=jnp.float32, rngs=nnx.Rngs(0)
        )
    )
    assert made("none") is made("attention") is InputKeptRMSNorm
    assert made("layer") is made("matmuls") is nnx.RMSNorm
    layernorm = dataclasses.replace(model, norm="layernorm")
    assert type(make_norm(layernorm, 8, dtype=jnp.float32, rngs=nnx.Rngs(0))) is InputKeptLayerNorm


def test_a_stack_of_norms_compiles_to_less_memory():
    """XLA:CPU's compiled temporaries of the gradient of residual layers ``x + norm(x) W``
    in bfloat16: the norms' float32 copies are not kept."""
    layers, tokens, width = 4, 512, 64
    weight = jnp.zeros((width, width), jnp.bfloat16)

    def temporaries(kind) -> int:
        norm = kind(width, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(norm)

        def loss(state, x):
            module = nnx.merge(graphdef, state)
            for _ in range(layers):
                x = x + module(x) @ weight
            return x.astype(jnp.float32).sum()

        x = jnp.zeros((tokens, width), jnp.bfloat16)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(InputKeptRMSNorm) < 0.8 * temporaries(nnx.RMSNorm)
