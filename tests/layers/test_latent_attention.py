"""Multi-head latent attention (jaxmoe/layers/latent_attention.py) against a per-head numpy
reference written from DeepSeek's equations (queries through their compression or not,
keys and values from one normed latent, one rotary key a token shared by the heads, a
value width of its own, YaRN's softmax factor), the two cores on it, its heads split
over the tensor group with sequence parallelism, and DeepSeek-V3's published shape.
Decoding from the latent cache is checked in tests/generate/test_decoder.py
(``deepseek_v3-tiny``)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ModelConfig, ParallelConfig
from jaxmoe.config.layout import TENSOR, axes_for_role
from jaxmoe.layers.latent_attention import LatentAttention
from jaxmoe.layers.rotary import attention_scale, inverse_frequencies, rotary_tables
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import param_specs
from jaxmoe.presets import preset

BATCH, SEQ, D_MODEL = 4, 8, 16
MLA = ModelConfig(
    d_model=D_MODEL, num_heads=4, seq_len=SEQ, norm="rmsnorm", position="rope",
    linear_bias=False, kv_lora_rank=6, q_lora_rank=10, qk_nope_head_dim=4,
    qk_rope_head_dim=4, v_head_dim=3, attention="blockwise", attention_block=2,
    rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_seq_len=4,
    rope_mscale=0.8, rope_mscale_all_dim=0.7,
)  # fmt: skip
MODELS = {
    "compressed-queries": MLA,
    "direct-queries": dataclasses.replace(MLA, q_lora_rank=None),
    "dense-core": dataclasses.replace(MLA, attention="dense"),
}


def make_attention(model: ModelConfig, seed: int = 0) -> LatentAttention:
    """A layer whose norm scales are not one (which would hide a norm left out)."""
    attention = LatentAttention(model, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    for path, variable in nnx.iter_graph(attention):
        if isinstance(variable, nnx.Param) and path[-1] == "scale":
            variable[...] = jnp.asarray(1 + rng.normal(0, 0.3, variable.shape), jnp.float32)
    return attention


def attention_input(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def reference(model: ModelConfig, params, x) -> np.ndarray:
    """DeepSeek's attention per head, numpy float64: a head's query is its features
    without positions then its rotated ones, its key the latent's expansion then the
    token's shared rotated key; softmax(q k / sqrt(nope + rope) x YaRN factor) v over the
    earlier positions, then the output projection."""
    f64 = lambda a: np.asarray(a, np.float64)
    x = f64(x)
    nope, rope, rank = model.qk_nope_head_dim, model.qk_rope_head_dim, model.kv_lora_rank
    eps = model.norm_eps
    if model.q_lora_rank is None:
        query = np.einsum("bsd,dhf->bshf", x, f64(params["query"]["kernel"]))
    else:
        down = x @ f64(params["query_down"]["kernel"])
        down = _rms(down, f64(params["query_norm"]["scale"]), eps)
        query = np.einsum("bsr,rhf->bshf", down, f64(params["query_up"]["kernel"]))
    compressed = x @ f64(params["kv_down"]["kernel"])
    latent = _rms(compressed[..., :rank], f64(params["kv_norm"]["scale"]), eps)
    expanded = np.einsum("bsr,rhf->bshf", latent, f64(params["kv_up"]["kernel"]))
    cos, sin = (f64(t)[None, :, None] for t in rotary_tables(model, jnp.arange(SEQ)))
    query_rope = _rotate(query[..., nope:], cos, sin)
    key_rope = _rotate(compressed[:, :, None, rank:], cos, sin)[:, :, 0]
    mscale = 0.1 * model.rope_mscale_all_dim * math.log(model.rope_scaling_factor) + 1
    scale = mscale**2 / math.sqrt(nope + rope)
    out = np.zeros((BATCH, SEQ, model.num_heads, model.v_head_dim))
    for head in range(model.num_heads):
        for row in range(BATCH):
            for i in range(SEQ):
                logits = [
                    query[row, i, head, :nope] @ expanded[row, j, head, :nope]
                    + query_rope[row, i, head] @ key_rope[row, j]
                    for j in range(i + 1)
                ]
                weights = np.exp(np.asarray(logits) * scale - np.max(logits) * scale)
                values = expanded[row, : i + 1, head, nope:]
                out[row, i, head] = (weights / weights.sum()) @ values
    return out.reshape(BATCH, SEQ, -1) @ f64(params["out"]["kernel"])


def tables(model: ModelConfig):
    return rotary_tables(model, jnp.arange(SEQ))


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_deepseeks_equations(name):
    model = MODELS[name]
    attention = make_attention(model)
    params = nnx.to_pure_dict(nnx.state(attention))
    x = attention_input()
    y = jax.jit(lambda x: attention(x, tables(model)))(jnp.asarray(x))
    np.testing.assert_allclose(y, reference(model, params, x), rtol=2e-5, atol=2e-5)


def test_yarn_scales_the_softmax_and_not_the_rotation_at_deepseek_v3s_settings():
    model = preset("deepseek_v3-671b").model
    _, rotated = inverse_frequencies(model)
    assert rotated == 1.0  # m(40, 1) / m(40, 1)
    m = lambda scale, a: 0.1 * a * math.log(scale) + 1
    assert math.isclose(inverse_frequencies(MLA)[1], m(4, 0.8) / m(4, 0.7))
    factor = 0.1 * math.log(40) + 1
    assert math.isclose(attention_scale(model), factor**2 / math.sqrt(128 + 64))
    # The decode cache: the latent and the rotary key, 576 values a token and layer.
    cache = jax.eval_shape(
        lambda: LatentAttention(model, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).init_cache(
            1, 1, jnp.bfloat16
        )
    )
    assert sum(part.shape[-1] for part in cache) == 576


TP_CASES = {
    "tensor2": ParallelConfig(data=2, expert=4, tensor=2),
    "tensor4": ParallelConfig(data=4, expert=2, tensor=4),
}


# Four ways is another size of the split two ways checks (tensor groups over two mesh axes:
# tests/layers/test_attention.py's mha-tensor4-two-mesh-axes): slow.
@pytest.mark.parametrize("case", ["tensor2", pytest.param("tensor4", marks=pytest.mark.slow)])
def test_heads_split_over_the_tensor_group_match_the_unsplit_layer(case):
    """Outputs and the gradients of every parameter (the replicated compressions' summed
    over the group) and of the input."""
    parallel, model = TP_CASES[case], MLA
    mesh = build_mesh(parallel)
    attention = make_attention(model)
    graphdef, state = nnx.split(attention)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.shape)
    rows = PartitionSpec(*token_spec(mesh), axes_for_role(TENSOR, mesh.axis_names))
    local_heads = []

    def body(params, x):
        local_heads.append(params["kv_up"]["kernel"].shape[1])
        return nnx.merge(graphdef, params)(x, tables(model))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, rows), out_specs=rows)
    cotangent = jnp.asarray(attention_input(seed=4))

    def loss(params, x, layer):
        return jnp.sum(layer(params, x) * cotangent)

    def plain(params, x):
        return nnx.merge(graphdef, params)(x, tables(model))

    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x = jnp.asarray(attention_input())
    x_placed = jax.device_put(x, NamedSharding(mesh, rows))
    split = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, mapped), argnums=(0, 1)))
    whole = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, plain), argnums=(0, 1)))
    (value, grads), (expected_value, expected) = split(placed, x_placed), whole(params, x)
    assert local_heads[0] == model.num_heads // parallel.tensor
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
