"""The dense FFN against ``gelu(x W_up + b_up) W_down + b_down`` and against SwiGLU,
``(silu(x W_gate) * x W_up) W_down``, in numpy, on one device and with its hidden layer
split over the tensor group (8 fake CPU devices, ``tests/conftest.py``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ModelConfig, ParallelConfig
from jaxmoe.config.layout import TENSOR, axes_for_role
from jaxmoe.layers.mlp import DenseFFN
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import param_specs

BATCH, SEQ, D_MODEL, D_HIDDEN = 4, 8, 16, 32
GELU = ModelConfig(d_model=D_MODEL, num_heads=4)
SWIGLU = dataclasses.replace(GELU, activation="swiglu", linear_bias=False)


def make_ffn(seed=0, dtype=jnp.float32, model=GELU):
    """An FFN with non-zero biases (zero would hide a bias added twice or never)."""
    ffn = DenseFFN(model, D_HIDDEN, dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    if model.linear_bias:
        ffn.up.bias[...] = jnp.asarray(rng.normal(0, 0.5, D_HIDDEN), jnp.float32)
        ffn.down.bias[...] = jnp.asarray(rng.normal(0, 0.5, D_MODEL), jnp.float32)
    return ffn


def ffn_input(seed=2):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)


def reference_ffn(params, x):
    """numpy, float64, with the tanh approximation of GELU written out."""

    def f64(a):
        return np.asarray(a, np.float64)

    down = params["down"]
    if "gate_up" in params:  # SwiGLU: kernel [d_model, (gate, up), hidden], no biases
        kernel = f64(params["gate_up"]["kernel"])
        gate, up = f64(x) @ kernel[:, 0], f64(x) @ kernel[:, 1]
        return (gate / (1 + np.exp(-gate)) * up) @ f64(down["kernel"])
    up = params["up"]
    pre = f64(x) @ f64(up["kernel"]) + f64(up["bias"])
    hidden = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3)))
    return hidden @ f64(down["kernel"]) + f64(down["bias"])


def test_matches_the_reference_ffn():
    ffn = make_ffn()
    x = ffn_input()
    params = nnx.to_pure_dict(nnx.state(ffn))

    y = jax.jit(ffn.__call__)(jnp.asarray(x))

    assert params["up"]["kernel"].shape == (D_MODEL, D_HIDDEN)
    assert params["down"]["kernel"].shape == (D_HIDDEN, D_MODEL)
    assert y.shape == (BATCH, SEQ, D_MODEL) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, reference_ffn(params, x), rtol=1e-5, atol=1e-5)


def test_swiglu_matches_the_reference_ffn():
    ffn = make_ffn(model=SWIGLU)
    x = ffn_input()
    params = nnx.to_pure_dict(nnx.state(ffn))

    y = jax.jit(ffn.__call__)(jnp.asarray(x))

    assert params["gate_up"]["kernel"].shape == (D_MODEL, 2, D_HIDDEN)
    assert "bias" not in params["gate_up"] and "bias" not in params["down"]
    assert y.shape == (BATCH, SEQ, D_MODEL) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, reference_ffn(params, x), rtol=1e-5, atol=1e-5)


def test_positions_are_independent():
    ffn = make_ffn()
    x = ffn_input()
    changed = x.copy()
    changed[:, 3] += 1.0

    before, after = ffn(jnp.asarray(x)), ffn(jnp.asarray(changed))

    unchanged = [i for i in range(SEQ) if i != 3]
    np.testing.assert_array_equal(after[:, unchanged], before[:, unchanged])
    assert not np.allclose(after[:, 3], before[:, 3], atol=1e-3)


def test_bfloat16_compute_stays_close_to_the_reference():
    ffn = make_ffn(dtype=jnp.bfloat16)
    x = ffn_input()
    params = nnx.to_pure_dict(nnx.state(ffn))

    y = ffn(jnp.asarray(x))

    assert y.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    np.testing.assert_allclose(
        np.asarray(y, np.float32), reference_ffn(params, x), rtol=0.05, atol=0.1
    )


@pytest.mark.parametrize(
    ("parallel", "model"),
    [
        (ParallelConfig(data=2, expert=4, tensor=2), GELU),
        (ParallelConfig(data=4, expert=2, tensor=4), GELU),
        (ParallelConfig(data=4, expert=2, tensor=4), SWIGLU),
    ],
    ids=["tensor2", "tensor4-two-mesh-axes", "swiglu-tensor4"],
)
def test_hidden_split_over_the_tensor_group_matches_the_unsplit_ffn(parallel, model):
    mesh = build_mesh(parallel)
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    ffn = make_ffn(model=model)
    graphdef, state = nnx.split(ffn)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.shape)
    rows = PartitionSpec(*token_spec(mesh), tensor_axes)  # each rank: its sequence slice
    local_kernels = []

    def body(params, x):
        first = params["gate_up" if "gate_up" in params else "up"]["kernel"]
        local_kernels.append((first.shape, params["down"]["kernel"].shape))
        return nnx.merge(graphdef, params)(x)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, rows), out_specs=rows)
    x = ffn_input()
    cotangent = ffn_input(seed=3)

    def loss(params, x):
        return jnp.sum(mapped(params, x) * cotangent)

    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x_placed = jax.device_put(x, NamedSharding(mesh, rows))
    y = jax.jit(mapped)(placed, x_placed)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(placed, x_placed)

    hidden = D_HIDDEN // parallel.tensor
    first = (D_MODEL, 2, hidden) if model.activation == "swiglu" else (D_MODEL, hidden)
    assert local_kernels[0] == (first, (hidden, D_MODEL))
    np.testing.assert_allclose(y, reference_ffn(params, x), rtol=1e-5, atol=1e-5)
    expected = jax.grad(
        lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) * cotangent), argnums=(0, 1)
    )(params, jnp.asarray(x))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
