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
  runs slice by slice over the contraction's 128-wide slices (a ``lax.scan``), each
  slice's FP8 product scaled and added to one float32 accumulator, as DeepSeek's
  kernels promote to float32 every 128 of the contraction. It reproduces what those
  kernels compute; without such a fused kernel its K = 128 products are not faster than
  one bfloat16 GEMM (on an H200, one Mixtral-width expert block forward and backward took
  6.5x bfloat16's time, tensorwise 0.92x: ``experiments/results/gpu_check/``).

On GPU a run with FP8 products compiles with XLA's Triton GEMMs off
(:data:`jaxmoe.parallel.host_devices.FP8_XLA_GPU_FLAGS`), so that cuBLASLt runs them.

The weight gradient contracts over the tokens; its operands (the layer's input and the
output's gradient) take one scale per feature over the tokens they contract (per expert
in the grouped GEMM), which factors out of the sum over tokens in both recipes (DeepSeek
tiles the tokens by 128 there: finer, and not a single GEMM).

The scales are those of what a device holds inside the whole-step ``shard_map`` (its
tokens, its shard of a weight split over a tensor or expert-tensor group): a layout that
splits an operand otherwise scales it otherwise, within e4m3's rounding.

The derivatives are the products' own (:func:`jax.custom_vjp`): the forward pass keeps
its inputs in their dtype and quantizes them again for the gradients, so nothing in the
saved activations changes. Parameters, their gradients and the optimizer state keep
their dtype (``model.dtype``: float32 or bfloat16 master weights); what enters each GEMM
is FP8. The attention core (scores and values), the router and the output head stay in
``model.dtype``, as DeepSeek-V3 keeps them. Each product's result is named
:data:`PRODUCT` (``checkpoint_name``), so that recomputation keeps it as it keeps a
``dot_general``'s (:mod:`jaxmoe.layers.recompute`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config.choices import FP8_RECIPES

FP8 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8).max)  # 448
BLOCK = 128  # DeepSeek-V3's tile and block width
RECIPES = tuple(recipe for recipe in FP8_RECIPES if recipe != "none")
PRODUCT = "fp8_product"  # the name of every product's result
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


def _weight_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [..., K, N]`` in 128 x 128 blocks: the FP8 values ``[..., KB, 128, NB * 128]``
    (K and N padded with zeros) and the scale of each column of each slice of K,
    ``[..., KB, NB * 128]`` (each block's scale repeated over its 128 columns)."""
    padded = _pad_to(_pad_to(w, -2, BLOCK), -1, BLOCK)
    *lead, k, n = padded.shape
    blocks = padded.reshape(*lead, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    scale = _scale(jnp.max(jnp.abs(blocks), axis=(-3, -1)))  # [..., KB, NB]
    values = _quantize(blocks, scale[..., :, None, :, None]).reshape(*lead, k // BLOCK, BLOCK, n)
    return values, jnp.repeat(scale, BLOCK, axis=-1)


def _activation_tiles(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [M, K]`` in 1 x 128 tiles: the FP8 values ``[KB, M, 128]`` and the scales
    ``[KB, M]``, slice of K first (what a scan over the slices reads)."""
    tiles = _blocks_of(x, BLOCK)  # [M, KB, 128]
    scale = _scale(jnp.max(jnp.abs(tiles), axis=2))  # [M, KB]
    values = _quantize(tiles, scale[:, :, None])
    return jnp.swapaxes(values, 0, 1), scale.T


def _blockwise_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [M, K] @ w [K, N]`` with 1 x 128 tiles of ``x`` and 128 x 128 blocks of ``w``,
    float32: slice by slice of K, each FP8 product scaled into one accumulator."""
    x8, x_scale = _activation_tiles(x)
    w8, w_scale = _weight_blocks(w)

    def add_slice(total, slice_):
        x8, x_scale, w8, w_scale = slice_
        product = _dot(x8, w8, (1, 0))  # [M, NB * 128]
        return total + product * x_scale[:, None] * w_scale[None, :], None

    initial = jnp.zeros((x.shape[0], w8.shape[-1]), jnp.float32)
    total, _ = jax.lax.scan(add_slice, initial, (x8, x_scale, w8, w_scale))
    return total[:, : w.shape[1]]


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
    return checkpoint_name(y.reshape(*x.shape[:-1], *features), PRODUCT)


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

    def fp8_dot_general(
        lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
    ):
        del precision  # the operands are FP8 whatever the precision asked of the dot
        (contracting, batch) = dimension_numbers
        if contracting != ((lhs.ndim - 1,), (0,)) or batch != ((), ()):
            raise ValueError(
                f"FP8 products contract x's last axis with w's first: {dimension_numbers}"
            )
        if preferred_element_type is not None or out_sharding is not None:
            raise ValueError("FP8 products give the input's dtype and its sharding")
        return matmul(lhs, rhs, recipe)

    return fp8_dot_general


def batched_matmul(x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
    """``x [E, S, K] @ w [E, K, N]`` per leading index (the experts' einsum), in FP8: each
    expert's weights and tokens scaled on their own."""
    return jax.vmap(functools.partial(matmul, recipe=recipe))(x, w)


# -- the grouped GEMM of ragged dispatch --------------------------------------------------


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group of a grouped GEMM's ``rows``; rows past the groups get
    ``len(group_sizes)``, a group of none."""
    ends = jnp.cumsum(group_sizes)
    return jnp.sum(ends[None, :] <= jnp.arange(rows, dtype=ends.dtype)[:, None], axis=1)


def _ragged(x8: jax.Array, w8: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x8, w8, group_sizes, preferred_element_type=jnp.float32)


def _per_row(values: jax.Array, groups: jax.Array) -> jax.Array:
    """Each row's entry of a per-group array (rows past the groups: the last group's,
    whose products there are zero)."""
    return jnp.take(values, groups, axis=0, mode="clip")


def _grouped_product(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str):
    """``x [T, K]`` rows of group e times ``w[e] [K, N]``, in FP8, float32."""
    groups = row_groups(group_sizes, x.shape[0])
    if recipe == "tensorwise":  # one scale for the rows, one per expert's weights
        x8, x_scale = _tensorwise(x)
        w_scale = _scale(jnp.max(jnp.abs(w), axis=(1, 2)))  # [E]
        w8 = _quantize(w, w_scale[:, None, None])
        return _ragged(x8, w8, group_sizes) * (x_scale * _per_row(w_scale, groups))[:, None]
    x8, x_scale = _activation_tiles(x)  # [KB, T, 128], [KB, T]
    w8, w_scale = _weight_blocks(w)  # [E, KB, 128, N'], [E, KB, N']
    w8, w_scale = jnp.swapaxes(w8, 0, 1), jnp.swapaxes(w_scale, 0, 1)  # slice of K first

    def add_slice(total, slice_):  # one grouped GEMM per 128-wide slice of K
        x8, x_scale, w8, w_scale = slice_
        product = _ragged(x8, w8, group_sizes)  # [T, N']
        return total + product * x_scale[:, None] * _per_row(w_scale, groups), None

    initial = jnp.zeros((x.shape[0], w8.shape[-1]), jnp.float32)
    total, _ = jax.lax.scan(add_slice, initial, (x8, x_scale, w8, w_scale))
    return total[:, : w.shape[2]]


def _grouped_weight_gradient(x, g, group_sizes):
    """Per group e: ``x_e^T @ g_e`` ``[E, K, N]``, the operands scaled per feature over
    each group's rows (a ragged contraction over the tokens)."""
    experts = group_sizes.shape[0]
    groups = row_groups(group_sizes, x.shape[0])

    def per_group(values):  # the rows past the groups: a segment of their own, dropped
        amax = jax.ops.segment_max(jnp.abs(values), groups, num_segments=experts + 1)
        scale = _scale(amax[:experts])  # [E, C]
        return _quantize(values, _per_row(scale, groups)), scale

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
    y = _grouped(x, flat, group_sizes, recipe).reshape(x.shape[0], *features)
    return checkpoint_name(y, PRODUCT)
