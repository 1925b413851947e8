"""Causal self-attention against a per-head numpy reference (multi-head and grouped-query,
with biases, query/key norms and rotary positions), its causality and segments, the
recomputed core, and the heads split over the tensor group (with sequence parallelism,
key/value heads split or replicated) on the 8 fake CPU devices (``tests/conftest.py``).
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ModelConfig, ParallelConfig
from jaxmoe.config.layout import TENSOR, axes_for_role
from jaxmoe.layers.attention import CausalSelfAttention
from jaxmoe.layers.attention_core import AttentionCore
from jaxmoe.layers.rotary import rotary_tables
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import param_specs

BATCH, SEQ, D_MODEL = 4, 8, 16
# GPT-2's attention: four heads, no query/key/value biases, an output bias.
GPT = ModelConfig(d_model=D_MODEL, num_heads=4, seq_len=SEQ)
# Qwen-like: eight query heads sharing two key/value heads, biases, query/key norms, rotary.
GQA = dataclasses.replace(
    GPT,
    num_heads=8,
    num_kv_heads=2,
    head_dim=4,
    attention_bias=True,
    qk_norm=True,
    position="rope",
    norm="rmsnorm",
    linear_bias=False,
)
# The blockwise core in tiles of 2 positions (4 query tiles, 10 of 16 tile pairs), and
# the dense reference core.
TILED = dataclasses.replace(GQA, attention="blockwise", attention_block=2)
MODELS = {
    "mha": GPT,
    "gqa-rope": GQA,
    "gqa-rope-tiled": TILED,
    "mha-dense": dataclasses.replace(GPT, attention="dense"),
}


def make_attention(model: ModelConfig, seed=0):
    """A layer with non-zero biases and norm scales other than one (which would hide a
    bias added once per device, or a norm left out)."""
    attention = CausalSelfAttention(model, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    for path, variable in nnx.iter_graph(attention):
        if isinstance(variable, nnx.Param) and path[-1] in ("bias", "scale"):
            base = 1.0 if path[-1] == "scale" else 0.0
            variable[...] = jnp.asarray(base + rng.normal(0, 0.3, variable.shape), jnp.float32)
    return attention


def attention_input(seed=2):
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)


def rotary(model: ModelConfig):
    if model.position != "rope":
        return None
    return rotary_tables(model, jnp.arange(SEQ))


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def reference_attention(model: ModelConfig, params, x, segments=None):
    """Per query head: softmax(q k^T / sqrt(head_dim)) v over the earlier positions of its
    segment, with the key/value head of its group, then the output projection; numpy,
    float64."""
    x = np.asarray(x, np.float64)
    f64 = lambda a: np.asarray(a, np.float64)
    heads, kv_heads, head_dim = model.num_heads, model.kv_heads, model.attention_head_dim
    query = np.einsum("bsd,dhf->bshf", x, f64(params["query"]["kernel"]))
    key_value = np.einsum("bsd,dthf->bsthf", x, f64(params["key_value"]["kernel"]))
    if model.attention_bias:
        query = query + f64(params["query"]["bias"])
        key_value = key_value + f64(params["key_value"]["bias"])
    key, value = key_value[:, :, 0], key_value[:, :, 1]
    if model.qk_norm:
        query = _rms(query, f64(params["query_norm"]["scale"]), model.norm_eps)
        key = _rms(key, f64(params["key_norm"]["scale"]), model.norm_eps)
    if model.position == "rope":
        cos, sin = (np.asarray(t, np.float64)[None, :, None] for t in rotary(model))
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    batch, seq = x.shape[:2]
    segments = np.zeros((batch, seq), int) if segments is None else np.asarray(segments)
    out = np.zeros((batch, seq, heads, head_dim))
    for head in range(heads):
        kv = head // (heads // kv_heads)
        for row in range(batch):
            for i in range(seq):
                seen = [j for j in range(i + 1) if segments[row, j] == segments[row, i]]
                logits = key[row, seen, kv] @ query[row, i, head] / np.sqrt(head_dim)
                weights = np.exp(logits - logits.max())
                out[row, i, head] = (weights / weights.sum()) @ value[row, seen, kv]
    y = out.reshape(batch, seq, -1) @ f64(params["out"]["kernel"])
    if model.linear_bias:
        y = y + f64(params["out"]["bias"])
    return y


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_the_reference_attention(name):
    model = MODELS[name]
    attention = make_attention(model)
    x = attention_input()

    y = jax.jit(lambda x: attention(x, rotary(model)))(jnp.asarray(x))

    params = nnx.to_pure_dict(nnx.state(attention))
    assert params["query"]["kernel"].shape == (D_MODEL, model.num_heads, model.attention_head_dim)
    assert params["key_value"]["kernel"].shape[1:3] == (2, model.kv_heads)
    assert ("bias" in params["query"]) == model.attention_bias
    np.testing.assert_allclose(y, reference_attention(model, params, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", [GQA, TILED], ids=["one-tile", "tiled"])
def test_segments_keep_attention_inside_each_document(model):
    attention = make_attention(model)
    x = attention_input()
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 2]] * BATCH)
    y = attention(jnp.asarray(x), rotary(model), jnp.asarray(segments))
    params = nnx.to_pure_dict(nnx.state(attention))
    np.testing.assert_allclose(
        y, reference_attention(model, params, x, segments), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["blockwise", "dense"])
def test_core_attention_at_the_first_position_returns_its_own_value(kind):
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32) for _ in range(3))

    attended = AttentionCore(kind, block=2)(q, k, v)

    assert attended.shape == (2, 5, 3, 4)
    np.testing.assert_allclose(attended[:, 0], v[:, 0], rtol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_later_token_does_not_change_earlier_outputs(name):
    model = MODELS[name]
    attention = make_attention(model)
    call = jax.jit(lambda x: attention(x, rotary(model)))
    x = attention_input()
    changed = x.copy()
    position = 5
    changed[:, position:] = attention_input(seed=9)[:, position:]

    before, after = np.asarray(call(jnp.asarray(x))), np.asarray(call(jnp.asarray(changed)))

    np.testing.assert_allclose(after[:, :position], before[:, :position], rtol=0, atol=1e-6)
    for i in range(position, SEQ):
        assert not np.allclose(after[:, i], before[:, i], atol=1e-3), f"position {i}"


# --- Recomputation ---------------------------------------------------------------------------


def forward_and_gradients(model, attention, x, cotangent):
    graphdef, state = nnx.split(attention)
    params = nnx.to_pure_dict(state)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x, rotary(model))
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


DENSE = dataclasses.replace(GPT, attention="dense")


def test_recomputed_attention_has_the_same_outputs_and_gradients():
    x = jnp.asarray(attention_input())
    cotangent = jnp.asarray(attention_input(seed=4))
    recomputing = dataclasses.replace(DENSE, recompute="attention")
    kept, recomputed = make_attention(DENSE), make_attention(recomputing)
    assert recomputed.recompute_core and not kept.recompute_core

    y, grads = forward_and_gradients(DENSE, kept, x, cotangent)
    y_recomputed, grads_recomputed = forward_and_gradients(DENSE, recomputed, x, cotangent)

    np.testing.assert_array_equal(y_recomputed, y)
    for got, want in zip(jax.tree.leaves(grads_recomputed), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert any(np.any(leaf != 0) for leaf in jax.tree.leaves(grads))


def test_only_the_recomputing_dense_layer_checkpoints_its_core():
    x = jnp.zeros((1, SEQ, D_MODEL))
    remat = {"remat2", "checkpoint"}
    recomputing = dataclasses.replace(DENSE, recompute="attention")

    assert primitive_names(make_attention(recomputing), x) & remat
    assert not primitive_names(make_attention(DENSE), x) & remat
    # The blockwise core keeps no weights: nothing to recompute around it.
    flash = dataclasses.replace(GPT, attention="blockwise", recompute="attention")
    assert not primitive_names(make_attention(flash), x) & remat


# --- Tensor parallelism ----------------------------------------------------------------------

TP_CASES = {
    # heads and key/value heads split two ways
    "mha-tensor2": (GPT, ParallelConfig(data=2, expert=4, tensor=2)),
    # tensor groups over two mesh axes
    "mha-tensor4-two-mesh-axes": (GPT, ParallelConfig(data=4, expert=2, tensor=4)),
    # two key/value heads, four tensor devices: key/value heads replicated
    "gqa-tensor4-replicated-kv": (GQA, ParallelConfig(data=4, expert=2, tensor=4)),
    "gqa-tensor2-split-kv": (GQA, ParallelConfig(data=2, expert=4, tensor=2)),
    "gqa-tensor2-tiled": (TILED, ParallelConfig(data=2, expert=4, tensor=2)),
}


# The tiled core is gqa-tensor2-split-kv's split and layout with another core (checked
# inside the layer by test_matches_the_reference_attention[gqa-rope-tiled]): slow.
@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=pytest.mark.slow) if case == "gqa-tensor2-tiled" else case
     for case in TP_CASES],
)  # fmt: skip
def test_heads_split_over_the_tensor_group_match_the_unsplit_layer(case):
    model, parallel = TP_CASES[case]
    mesh = build_mesh(parallel)
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    attention = make_attention(model)
    graphdef, state = nnx.split(attention)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.shape)
    # Rows over the data axes, each tensor rank its contiguous slice of the sequence.
    rows = PartitionSpec(*token_spec(mesh), tensor_axes)
    local_shapes = []
    tables = rotary(model)

    def body(params, x):
        local_shapes.append((params["query"]["kernel"].shape, params["key_value"]["kernel"].shape))
        return nnx.merge(graphdef, params)(x, tables)

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
    kv_local = model.kv_heads // tensor if model.kv_heads % tensor == 0 else model.kv_heads
    head_dim = model.attention_head_dim
    assert local_shapes[0] == (
        (D_MODEL, model.num_heads // tensor, head_dim),
        (D_MODEL, 2, kv_local, head_dim),
    )
    _, expected = forward_and_gradients(model, attention, jnp.asarray(x), jnp.asarray(cotangent))
    np.testing.assert_allclose(y, reference_attention(model, params, x), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
