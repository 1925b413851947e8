"""FP8 matrix products for training (``model.fp8``): the layers' GEMMs on ``float8_e4m3fn``
operands with float32 accumulation, in the forward pass and both gradients.

Each product quantizes its two operands with scales of its recipe, multiplies the FP8
values in one ``lax.dot_general`` (or ``lax.ragged_dot``) whose operands are float8 and
whose result is float32 (on Hopper GPUs XLA runs such a product as a cuBLASLt FP8 GEMM;
on CPU it widens them), and applies the scales to the float32 result. A scale is the
largest magnitude of what it covers over 448 (e4m3's largest), taken from the current
values ("current scaling", no amax history). The recipes:

- ``tensorwise``: one scale per operand. The scales factor out of the product, so it is
  one FP8 GEMM times two scalars: the pattern XLA:GPU fuses into the GEMM's own scaling.
- ``blockwise``: DeepSeek-V3's fine-grained scaling: activations (and gradients) in tiles
  of 1 x :data:`BLOCK` along the contraction, weights in blocks of :data:`BLOCK` x
  :data:`BLOCK`. Scales that vary along the contraction do not factor out: the product
  is a batch of FP8 GEMMs over the contraction's 128-wide slices, each slice's float32
  partial product scaled and summed (DeepSeek's kernels promote to float32 every 128 of
  the contraction; here the promotion is a batch dimension, ``K / 128`` times the
  output's memory in flight).

The weight gradient contracts over the tokens; its operands (the layer's input and the
output's gradient) take one scale per feature over the tokens they contract (per expert
in the grouped GEMM), which factors out of the sum over tokens in both recipes.

The derivatives are the products' own (:func:`jax.custom_vjp`): the forward pass keeps
its inputs in their dtype and quantizes them again for the gradients, so nothing in the
saved activations changes. Parameters, their gradients and the optimizer state keep
their dtype (``model.dtype``: float32 or bfloat16 master weights); what enters each GEMM
is FP8. The attention core (scores and values), the router and the output head stay in
``model.dtype``, as DeepSeek-V3 keeps them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8).max)  # 448
BLOCK = 128  # DeepSeek-V3's tile and block width
RECIPES = ("tensorwise", "blockwise")
# The smallest amax a scale is taken from: an all-zero operand gets a scale, not a 0/0.
_TINY = 1e-12


def _scale(amax: jax.Array) -> jax.Array:
    return jnp.maximum(amax.astype(jnp.float32), _TINY) / E4M3_MAX


def _quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    return (x.astype(jnp.float32) / scale).astype(FP8)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """``x`` zero-padded along ``axis`` to a multiple of ``multiple``."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _tensorwise(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = _scale(jnp.max(jnp.abs(x)))
    return _quantize(x, scale), scale


def _blocks_of(x: jax.Array, block: int) -> jax.Array:
    """``[M, K]`` -> ``[M, K / block, block]`` (K padded with zeros)."""
    x = _pad_to(x, 1, block)
    return x.reshape(x.shape[0], x.shape[1] // block, block)


def _dot(lhs: jax.Array, rhs: jax.Array, contract: tuple[int, int], batch=((), ())) -> jax.Array:
    return jax.lax.dot_general(
        lhs, rhs, (((contract[0],), (contract[1],)), batch), preferred_element_type=jnp.float32
    )


def _blockwise_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [M, K] @ w [K, N]`` with 1 x 128 tiles of ``x`` and 128 x 128 blocks of ``w``,
    float32: the FP8 product of each 128-wide slice of K, scaled, summed over slices."""
    n = w.shape[1]
    tiles = _blocks_of(x, BLOCK)  # [M, KB, 128]
    x_scale = _scale(jnp.max(jnp.abs(tiles), axis=2))  # [M, KB]
    x8 = _quantize(tiles, x_scale[:, :, None])
    padded = _pad_to(_pad_to(w, 0, BLOCK), 1, BLOCK)
    kb, nb = padded.shape[0] // BLOCK, padded.shape[1] // BLOCK
    blocks = padded.reshape(kb, BLOCK, nb, BLOCK)
    w_scale = _scale(jnp.max(jnp.abs(blocks), axis=(1, 3)))  # [KB, NB]
    w8 = _quantize(blocks, w_scale[:, None, :, None]).reshape(kb, BLOCK, nb * BLOCK)
    partial = _dot(x8, w8, (2, 1), ((1,), (0,)))  # [KB, M, NB * 128]
    column_scale = jnp.repeat(w_scale, BLOCK, axis=1)  # [KB, NB * 128]
    scaled = partial * x_scale.T[:, :, None] * column_scale[:, None, :]
    return jnp.sum(scaled, axis=0)[:, :n]


def _product(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """``x [M, K] @ w [K, N]`` in FP8, float32."""
    if recipe == "tensorwise":
        (x8, x_scale), (w8, w_scale) = _tensorwise(x), _tensorwise(w)
        return _dot(x8, w8, (1, 0)) * (x_scale * w_scale)
    return _blockwise_product(x, w)


def _channelwise(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [T, C]`` with one scale per column over the rows: ``(x8, scale [C])``."""
    scale = _scale(jnp.max(jnp.abs(x), axis=0))
    return _quantize(x, scale), scale


def _weight_gradient(x: jax.Array, g: jax.Array) -> jax.Array:
    """``x [M, K]^T @ g [M, N]``, float32: both scaled per feature over the tokens."""
    (x8, x_scale), (g8, g_scale) = _channelwise(x), _channelwise(g)
    return _dot(x8, g8, (0, 0)) * x_scale[:, None] * g_scale[None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    return _product(x, w, recipe).astype(x.dtype)


def _matmul_forward(x, w, recipe):
    return _matmul(x, w, recipe), (x, w)


def _matmul_backward(recipe, saved, g):
    x, w = saved
    d_x = _product(g, w.T, recipe)  # the gradient's tiles run along N, w's blocks transposed
    d_w = _weight_gradient(x, g)
    return d_x.astype(x.dtype), d_w.astype(w.dtype)


_matmul.defvjp(_matmul_forward, _matmul_backward)


def matmul(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """``x [..., K]`` contracted with the first axis of ``w [K, *features]`` in FP8 by
    ``recipe``: ``[..., *features]`` in ``x``'s dtype."""
    features = w.shape[1:]
    flat = x.reshape(-1, x.shape[-1])
    y = _matmul(flat, w.reshape(w.shape[0], math.prod(features)), recipe)
    return y.reshape(*x.shape[:-1], *features)


def contract(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """``x [..., K]`` with the first axis of ``w [K, *features]``: in FP8 by ``recipe``,
    or as it is (``"none"``)."""
    if recipe == "none":
        return jnp.tensordot(x, w, axes=((x.ndim - 1,), (0,)))
    return matmul(x, w, recipe)


@functools.cache
def dot_general(recipe: str):
    """The ``dot_general`` of an ``nnx.Linear`` whose product is FP8 by ``recipe``
    (``lax.dot_general`` itself for ``"none"``); one function per recipe, so that two
    models built alike have equal graph definitions."""
    if recipe == "none":
        return jax.lax.dot_general

    def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, **_):
        (contracting, batch) = dimension_numbers
        assert contracting == ((lhs.ndim - 1,), (0,)) and batch == ((), ()), dimension_numbers
        return matmul(lhs, rhs, recipe)

    return fp8_dot_general


def batched_matmul(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """``x [E, S, K] @ w [E, K, N]`` per leading index (the experts' einsum), in FP8: each
    expert's weights and tokens scaled on their own."""
    return jax.vmap(functools.partial(matmul, recipe=recipe))(x, w)


# -- the grouped GEMM of ragged dispatch --------------------------------------------------


def _row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group (rows past the groups: the last group, whose rows are zero)."""
    return jnp.repeat(
        jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=rows
    ).astype(jnp.int32)


def _ragged(x8: jax.Array, w8: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x8, w8, group_sizes, preferred_element_type=jnp.float32)


def _grouped_product(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str):
    """``x [T, K]`` rows of group e times ``w[e] [K, N]``, in FP8, float32."""
    groups = _row_groups(group_sizes, x.shape[0])
    if recipe == "tensorwise":  # one scale for the rows, one per expert's weights
        x8, x_scale = _tensorwise(x)
        w_scale = _scale(jnp.max(jnp.abs(w), axis=(1, 2)))  # [E]
        w8 = _quantize(w, w_scale[:, None, None])
        return _ragged(x8, w8, group_sizes) * (x_scale * w_scale[groups])[:, None]
    n = w.shape[2]
    tiles = _blocks_of(x, BLOCK)  # [T, KB, 128]
    x_scale = _scale(jnp.max(jnp.abs(tiles), axis=2))  # [T, KB]
    x8 = _quantize(tiles, x_scale[:, :, None])
    padded = _pad_to(_pad_to(w, 1, BLOCK), 2, BLOCK)
    experts, kb, nb = padded.shape[0], padded.shape[1] // BLOCK, padded.shape[2] // BLOCK
    blocks = padded.reshape(experts, kb, BLOCK, nb, BLOCK)
    w_scale = _scale(jnp.max(jnp.abs(blocks), axis=(2, 4)))  # [E, KB, NB]
    w8 = _quantize(blocks, w_scale[:, :, None, :, None]).reshape(experts, kb, BLOCK, -1)
    total = jnp.zeros((x.shape[0], nb * BLOCK), jnp.float32)
    for k in range(kb):  # one grouped GEMM per 128-wide slice of K, promoted and summed
        partial = _ragged(x8[:, k], w8[:, k], group_sizes)
        column_scale = jnp.repeat(w_scale[:, k], BLOCK, axis=1)[groups]  # [T, NB * 128]
        total = total + partial * x_scale[:, k, None] * column_scale
    return total[:, :n]


def _grouped_weight_gradient(x, g, group_sizes):
    """Per group e: ``x_e^T @ g_e`` ``[E, K, N]``, the operands scaled per feature over
    each group's rows (a ragged contraction over the tokens)."""
    experts = group_sizes.shape[0]
    groups = _row_groups(group_sizes, x.shape[0])

    def per_group(values):
        amax = jax.ops.segment_max(jnp.abs(values), groups, num_segments=experts)
        scale = _scale(amax)  # [E, C]
        return _quantize(values, scale[groups]), scale

    (x8, x_scale), (g8, g_scale) = per_group(x), per_group(g)
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    product = jax.lax.ragged_dot_general(
        x8, g8, group_sizes, numbers, preferred_element_type=jnp.float32
    )
    return product * x_scale[:, :, None] * g_scale[:, None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, recipe):
    return _grouped_product(x, w, group_sizes, recipe).astype(x.dtype)


def _grouped_forward(x, w, group_sizes, recipe):
    return _grouped(x, w, group_sizes, recipe), (x, w, group_sizes)


def _grouped_backward(recipe, saved, g):
    x, w, group_sizes = saved
    d_x = _grouped_product(g, jnp.swapaxes(w, 1, 2), group_sizes, recipe)
    d_w = _grouped_weight_gradient(x, g, group_sizes)
    return d_x.astype(x.dtype), d_w.astype(w.dtype), None


_grouped.defvjp(_grouped_forward, _grouped_backward)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str) -> jax.Array:
    """``jax.lax.ragged_dot(x [T, K], w [E, K, *features], group_sizes)`` in FP8:
    ``[T, *features]`` in ``x``'s dtype."""
    features = w.shape[2:]
    flat = w.reshape(w.shape[0], w.shape[1], math.prod(features))
    return _grouped(x, flat, group_sizes, recipe).reshape(x.shape[0], *features)
