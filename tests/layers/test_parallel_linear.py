"""Column- and row-parallel linear layers: plain ``nnx.Linear`` on one device, and inside a
shard_map over the tensor group (8 fake CPU devices, ``tests/conftest.py``) the
column-then-row pair equals the dense matmuls, the row bias added once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.config.layout import TENSOR, axes_for_role
from jaxmoe.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import param_specs
from jaxmoe.parallel.tensor_parallel import gather_sequence

BATCH, SEQ, D_IN, D_HIDDEN, D_OUT = 4, 8, 16, 32, 24


class Pair(nnx.Module):
    """Megatron's pattern: a column-parallel layer feeding a row-parallel one."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.column = ColumnParallelLinear(D_IN, D_HIDDEN, rngs=rngs)
        self.row = RowParallelLinear(D_HIDDEN, D_OUT, rngs=rngs)
        # Non-zero biases: a zero bias would hide one added per device instead of once.
        rng = np.random.default_rng(seed + 1)
        self.column.bias[...] = jnp.asarray(rng.normal(0, 0.5, D_HIDDEN), jnp.float32)
        self.row.bias[...] = jnp.asarray(rng.normal(0, 0.5, D_OUT), jnp.float32)

    def __call__(self, x):
        return self.row(self.column(gather_sequence(x)))


def dense_pair(params, x):
    """The same two layers as plain matmuls (numpy, float64)."""
    x = np.asarray(x, np.float64)
    column, row = params["column"], params["row"]
    hidden = x @ np.asarray(column["kernel"], np.float64) + np.asarray(column["bias"], np.float64)
    return hidden @ np.asarray(row["kernel"], np.float64) + np.asarray(row["bias"], np.float64)


def pair_input(seed=2):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, D_IN)).astype(np.float32)


@pytest.mark.parametrize("layer_class", [ColumnParallelLinear, RowParallelLinear])
def test_on_one_device_each_is_an_nnx_linear_with_the_same_parameters(layer_class):
    layer = layer_class(D_IN, D_OUT, rngs=nnx.Rngs(7))
    linear = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(7))
    layer.bias[...] = linear.bias[...] = jnp.arange(D_OUT, dtype=jnp.float32) / D_OUT
    x = jnp.asarray(pair_input())

    layer_params = nnx.to_pure_dict(nnx.state(layer))
    linear_params = nnx.to_pure_dict(nnx.state(linear))

    assert isinstance(layer, nnx.Linear)
    assert jax.tree.structure(layer_params) == jax.tree.structure(linear_params)
    for got, want in zip(
        jax.tree.leaves(layer_params), jax.tree.leaves(linear_params), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(layer(x), linear(x), rtol=1e-6, atol=1e-6)


def test_row_parallel_promotes_to_its_compute_dtype_as_nnx_linear_does():
    layer = RowParallelLinear(D_IN, D_OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(7))
    linear = nnx.Linear(D_IN, D_OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(7))
    x = jnp.asarray(pair_input())

    y = layer(x)

    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(linear(x), np.float32))


def test_row_parallel_without_bias():
    layer = RowParallelLinear(D_IN, D_OUT, use_bias=False, rngs=nnx.Rngs(7))
    x = pair_input()

    y = layer(jnp.asarray(x))

    np.testing.assert_allclose(
        y, np.asarray(x, np.float64) @ np.asarray(layer.kernel[...]), rtol=1e-5, atol=1e-5
    )


# --- Inside a shard_map over the tensor group -----------------------------------------------

TP_LAYOUTS = {
    "tensor2": ParallelConfig(data=2, expert=4, tensor=2),
    "tensor4-two-mesh-axes": ParallelConfig(data=4, expert=2, tensor=4),
}


def test_parameters_split_over_the_tensor_axes():
    mesh = build_mesh(TP_LAYOUTS["tensor2"])
    (tensor_axis,) = axes_for_role(TENSOR, mesh.axis_names)

    specs = param_specs(nnx.state(Pair()), mesh.shape)

    assert specs["column"]["kernel"] == PartitionSpec(None, tensor_axis)  # by output feature
    assert specs["column"]["bias"] == PartitionSpec(tensor_axis)
    assert specs["row"]["kernel"] == PartitionSpec(tensor_axis)  # by input feature
    assert specs["row"]["bias"] == PartitionSpec()  # replicated: added after the sum


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_column_then_row_parallel_equals_the_dense_matmuls(layout):
    parallel = TP_LAYOUTS[layout]
    mesh = build_mesh(parallel)
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    pair = Pair()
    graphdef, state = nnx.split(pair)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.shape)
    rows = PartitionSpec(*token_spec(mesh), tensor_axes)  # each rank: its sequence slice
    local_shapes = []

    def body(params, x):
        local = nnx.merge(graphdef, params)
        hidden = local.column(gather_sequence(x))
        y = local.row(hidden)
        local_shapes.append((x.shape, hidden.shape, y.shape))
        return y

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, rows), out_specs=rows)
    x = pair_input()
    cotangent = np.random.default_rng(3).normal(size=(BATCH, SEQ, D_OUT)).astype(np.float32)

    def loss(params, x):
        return jnp.sum(mapped(params, x) * cotangent)

    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x_placed = jax.device_put(x, NamedSharding(mesh, rows))
    y = jax.jit(mapped)(placed, x_placed)
    grads, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(placed, x_placed)

    tensor = parallel.tensor
    local_rows = BATCH * tensor // parallel.num_devices
    assert local_shapes[0] == (
        (local_rows, SEQ // tensor, D_IN),  # sequence-parallel input
        (local_rows, SEQ, D_HIDDEN // tensor),  # the whole sequence, this rank's columns
        (local_rows, SEQ // tensor, D_OUT),  # summed, back to the sequence slice
    )
    np.testing.assert_allclose(y, dense_pair(params, x), rtol=1e-5, atol=1e-5)
    expected_grads, expected_grad_x = jax.grad(
        lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) * cotangent), argnums=(0, 1)
    )(params, jnp.asarray(x))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x, expected_grad_x, rtol=1e-5, atol=1e-5)


def test_row_parallel_adds_its_bias_once_not_once_per_rank():
    mesh = build_mesh(TP_LAYOUTS["tensor2"])
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    row = RowParallelLinear(D_HIDDEN, D_OUT, rngs=nnx.Rngs(0))
    row.kernel[...] = jnp.zeros_like(row.kernel[...])
    row.bias[...] = jnp.ones((D_OUT,), jnp.float32)
    graphdef, state = nnx.split(row)
    specs = param_specs(state, mesh.shape)
    # Replicated over the data axes, so the input is the hidden activation of every rank.
    hidden = PartitionSpec(None, None, tensor_axes)
    out = PartitionSpec(None, tensor_axes)

    mapped = jax.shard_map(
        lambda params, x: nnx.merge(graphdef, params)(x),
        mesh=mesh,
        in_specs=(specs, hidden),
        out_specs=out,
    )
    params = nnx.to_pure_dict(state)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x = jax.device_put(np.ones((2, SEQ, D_HIDDEN), np.float32), NamedSharding(mesh, hidden))

    y = jax.jit(mapped)(placed, x)

    np.testing.assert_array_equal(y, np.ones((2, SEQ, D_OUT)))
