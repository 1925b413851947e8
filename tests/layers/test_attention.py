"""Causal self-attention against a per-head numpy reference, its causality, the recomputed
core, and the heads split over the tensor group (with sequence parallelism) on the 8 fake
CPU devices (``tests/conftest.py``).
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.layers.attention import CausalSelfAttention, core_attention
from jaxmoe.parallel.layout import TENSOR, axes_for_role
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import param_specs

BATCH, SEQ, D_MODEL, NUM_HEADS = 4, 8, 16, 4
HEAD_DIM = D_MODEL // NUM_HEADS


def make_attention(seed=0, recompute=False):
    """A layer with a non-zero output bias (zero would hide a bias added once per device)."""
    attention = CausalSelfAttention(
        D_MODEL, NUM_HEADS, dtype=jnp.float32, rngs=nnx.Rngs(seed), recompute=recompute
    )
    bias = np.random.default_rng(seed + 1).normal(0, 0.5, D_MODEL)
    attention.out.bias[...] = jnp.asarray(bias, jnp.float32)
    return attention


def attention_input(seed=2):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)


def reference_attention(params, x):
    """Per head: softmax(q k^T / sqrt(head_dim)) v over positions 0..i, then the projection.

    numpy in float64. The kernel is ``[d_model, (q, k, v), heads x head_dim]``."""
    x = np.asarray(x, np.float64)
    kernel = np.asarray(params["qkv"]["kernel"], np.float64)
    out_kernel = np.asarray(params["out"]["kernel"], np.float64)
    out_bias = np.asarray(params["out"]["bias"], np.float64)
    batch, seq, _ = x.shape
    heads = np.zeros((batch, seq, NUM_HEADS, HEAD_DIM))
    for head in range(NUM_HEADS):
        columns = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        q, k, v = (x @ kernel[:, part, columns] for part in range(3))
        for row in range(batch):
            for i in range(seq):
                logits = k[row, : i + 1] @ q[row, i] / np.sqrt(HEAD_DIM)
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                heads[row, i, head] = weights @ v[row, : i + 1]
    return heads.reshape(batch, seq, D_MODEL) @ out_kernel + out_bias


def test_matches_the_reference_attention():
    attention = make_attention()
    x = attention_input()

    y = jax.jit(attention.__call__)(jnp.asarray(x))

    assert y.shape == (BATCH, SEQ, D_MODEL)
    params = nnx.to_pure_dict(nnx.state(attention))
    assert params["qkv"]["kernel"].shape == (D_MODEL, 3, D_MODEL)
    assert "bias" not in params["qkv"]
    np.testing.assert_allclose(y, reference_attention(params, x), rtol=1e-5, atol=1e-5)


def test_core_attention_at_the_first_position_returns_its_own_value():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32) for _ in range(3))

    attended = core_attention(q, k, v)

    assert attended.shape == (2, 5, 3, 4)
    np.testing.assert_allclose(attended[:, 0], v[:, 0], rtol=1e-6)


def test_a_later_token_does_not_change_earlier_outputs():
    attention = make_attention()
    call = jax.jit(attention.__call__)
    x = attention_input()
    changed = x.copy()
    position = 5
    changed[:, position:] = attention_input(seed=9)[:, position:]

    before, after = np.asarray(call(jnp.asarray(x))), np.asarray(call(jnp.asarray(changed)))

    np.testing.assert_allclose(after[:, :position], before[:, :position], rtol=0, atol=1e-6)
    for i in range(position, SEQ):
        assert not np.allclose(after[:, i], before[:, i], atol=1e-3), f"position {i}"


# --- Recomputation ---------------------------------------------------------------------------


def forward_and_gradients(attention, x, cotangent):
    graphdef, state = nnx.split(attention)
    params = nnx.to_pure_dict(state)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


def primitive_names(attention, x):
    jaxpr = jax.make_jaxpr(attention.__call__)(x)
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return names


def test_recomputed_attention_has_the_same_outputs_and_gradients():
    x = jnp.asarray(attention_input())
    cotangent = jnp.asarray(attention_input(seed=4))
    kept, recomputed = make_attention(), make_attention(recompute=True)
    assert recomputed.recompute and not kept.recompute

    y, grads = forward_and_gradients(kept, x, cotangent)
    y_recomputed, grads_recomputed = forward_and_gradients(recomputed, x, cotangent)

    np.testing.assert_array_equal(y_recomputed, y)
    for got, want in zip(jax.tree.leaves(grads_recomputed), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert any(np.any(leaf != 0) for leaf in jax.tree.leaves(grads))


def test_only_the_recomputing_layer_checkpoints_its_core():
    x = jnp.zeros((1, SEQ, D_MODEL))
    remat = {"remat2", "checkpoint"}

    assert primitive_names(make_attention(recompute=True), x) & remat
    assert not primitive_names(make_attention(), x) & remat


# --- Tensor parallelism ----------------------------------------------------------------------

TP_LAYOUTS = {
    "tensor2": ParallelConfig(data=2, expert=4, tensor=2),
    "tensor4-two-mesh-axes": ParallelConfig(data=4, expert=2, tensor=4),
}


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_heads_split_over_the_tensor_group_match_the_unsplit_layer(layout):
    parallel = TP_LAYOUTS[layout]
    mesh = build_mesh(parallel)
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    attention = make_attention()
    graphdef, state = nnx.split(attention)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.axis_names)
    # Rows over the data axes, each tensor rank its contiguous slice of the sequence.
    rows = PartitionSpec(*token_spec(mesh), tensor_axes)
    local_shapes = []

    def body(params, x):
        local_shapes.append((x.shape, params["qkv"]["kernel"].shape, params["out"]["kernel"].shape))
        return nnx.merge(graphdef, params)(x)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, rows), out_specs=rows)
    x = attention_input()
    cotangent = attention_input(seed=4)

    def loss(params, x):
        return jnp.sum(mapped(params, x) * cotangent)

    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x_placed = jax.device_put(x, NamedSharding(mesh, rows))
    y = jax.jit(mapped)(placed, x_placed)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(placed, x_placed)

    tensor = parallel.tensor
    batch_shards = parallel.num_devices // tensor
    assert local_shapes[0] == (
        (BATCH // batch_shards, SEQ // tensor, D_MODEL),
        (D_MODEL, 3, D_MODEL // tensor),
        (D_MODEL // tensor, D_MODEL),
    )
    _, expected_grads = forward_and_gradients(attention, jnp.asarray(x), jnp.asarray(cotangent))
    np.testing.assert_allclose(y, reference_attention(params, x), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
