"""The dense FFN against ``gelu(x W_up + b_up) W_down + b_down`` in numpy, on one device
and with its hidden layer split over the tensor group (8 fake CPU devices,
``tests/conftest.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.layers.mlp import DenseFFN
from jaxmoe.parallel.layout import TENSOR, axes_for_role
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import param_specs

BATCH, SEQ, D_MODEL, D_HIDDEN = 4, 8, 16, 32


def make_ffn(seed=0, dtype=jnp.float32):
    """An FFN with non-zero biases (zero would hide a bias added twice or never)."""
    ffn = DenseFFN(D_MODEL, D_HIDDEN, dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    ffn.up.bias[...] = jnp.asarray(rng.normal(0, 0.5, D_HIDDEN), jnp.float32)
    ffn.down.bias[...] = jnp.asarray(rng.normal(0, 0.5, D_MODEL), jnp.float32)
    return ffn


def ffn_input(seed=2):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)


def reference_ffn(params, x):
    """numpy, float64, with the tanh approximation of GELU written out."""

    def f64(a):
        return np.asarray(a, np.float64)

    up, down = params["up"], params["down"]
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
    "parallel",
    [ParallelConfig(data=2, expert=4, tensor=2), ParallelConfig(data=4, expert=2, tensor=4)],
    ids=["tensor2", "tensor4-two-mesh-axes"],
)
def test_hidden_split_over_the_tensor_group_matches_the_unsplit_ffn(parallel):
    mesh = build_mesh(parallel)
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    ffn = make_ffn()
    graphdef, state = nnx.split(ffn)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.axis_names)
    rows = PartitionSpec(*token_spec(mesh), tensor_axes)  # each rank: its sequence slice
    local_kernels = []

    def body(params, x):
        local_kernels.append((params["up"]["kernel"].shape, params["down"]["kernel"].shape))
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
    assert local_kernels[0] == ((D_MODEL, hidden), (hidden, D_MODEL))
    np.testing.assert_allclose(y, reference_ffn(params, x), rtol=1e-5, atol=1e-5)
    expected = jax.grad(
        lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) * cotangent), argnums=(0, 1)
    )(params, jnp.asarray(x))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
