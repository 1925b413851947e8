"""Block-scaled FP8 weights as checkpoints store them (DeepSeek-V3, Kimi K2, Qwen3's FP8
releases): ``float8_e4m3fn`` values with one float32 ``weight_scale_inv`` per block of
``weight_block_size`` (``[128, 128]``) elements, the weight being ``value x scale`` in
each block. The last blocks of a dimension the block does not divide are partial, so the
scales have ``ceil(rows / block_rows) x ceil(columns / block_columns)`` entries.

:func:`dequantize` widens such a weight to float32 (jaxmoe's parameters). :func:`quantize`
writes a float32 weight back: each block's scale is its largest magnitude over
:data:`E4M3_MAX`, the rule DeepSeek's and transformers' quantizers follow, except that a
block which already is such a product (a weight read from FP8 and not trained since) keeps
the scale it was read with, found among the few float32 neighbours of that rule's, so
that a checkpoint read and written again is the same bytes (when it was written by that
rule: a block whose largest value is not 448 is quantized again, within e4m3's
rounding). Checkpoints whose scales are powers of two (``scale_fmt`` ``ue8m0``,
DeepSeek-V3.1) get the power of two at or above that rule's scale: read and written
again, they hold the same weights, value for value (a block whose largest value had
rounded down to 224 comes back as twice its values at half its scale). Plain numpy, no
JAX.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
E4M3_MAX = float(ml_dtypes.finfo(FP8).max)  # 448
SCALE_SUFFIX = "_scale_inv"  # weight_scale_inv beside weight
POWER_OF_TWO = "ue8m0"  # quantization_config's scale_fmt of power-of-two scales
SCALE_FORMATS = (None, POWER_OF_TWO)
# How many float32 steps either side of amax / 448 a block's exact scale is looked for.
SCALE_SEARCH = 4


def scale_name(name: str) -> str:
    """The scale tensor beside a weight (``...weight`` -> ``...weight_scale_inv``)."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scales of a ``[rows, columns]`` weight: one per (maybe partial) block."""
    rows, columns = shape
    return math.ceil(rows / block[0]), math.ceil(columns / block[1])


def _per_element(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """The block scales spread over the weight's elements."""
    spread = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)
    return spread[: shape[0], : shape[1]]


def dequantize(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``values`` (FP8 ``[rows, columns]``) times its block's scale, in float32."""
    return values.astype(np.float32) * _per_element(scale.astype(np.float32), values.shape, block)


def _blocks(weight: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``[row blocks, column blocks, block rows, block columns]``, zero-padded."""
    rows, columns = scale_shape(weight.shape, block)
    padded = np.zeros((rows * block[0], columns * block[1]), np.float32)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    return padded.reshape(rows, block[0], columns, block[1]).transpose(0, 2, 1, 3)


def quantize(
    weight: np.ndarray, block: tuple[int, int], power_of_two: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(values, scale)``: float32 ``weight`` as FP8 with a float32 scale per block
    (``power_of_two``: each scale a power of two)."""
    weight = np.asarray(weight, np.float32)
    blocks = _blocks(weight, block)
    amax = np.max(np.abs(blocks), axis=(2, 3))
    rule = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    if power_of_two:
        scale = np.exp2(np.ceil(np.log2(rule))).astype(np.float32)
        return _values(blocks, scale, weight.shape, block), scale
    scale = rule.copy()
    found = np.zeros(rule.shape, bool)
    # The rule's scale and its neighbours, nearest first: the first that reproduces every
    # element of a block exactly is the scale the block was written with.
    for step in range(SCALE_SEARCH + 1):
        for direction in (-1, 1) if step else (1,):
            candidate = rule
            for _ in range(step):
                candidate = np.nextafter(candidate, direction * np.inf, dtype=np.float32)
            spread = candidate[:, :, None, None]
            values = (blocks / spread).astype(FP8)
            exact = np.all(values.astype(np.float32) * spread == blocks, axis=(2, 3))
            take = exact & ~found
            scale[take] = candidate[take]
            found |= take
    return _values(blocks, scale, weight.shape, block), scale


def _values(blocks: np.ndarray, scale: np.ndarray, shape, block) -> np.ndarray:
    """The FP8 values of ``blocks`` at ``scale``, in the weight's ``[rows, columns]``."""
    values = (blocks / scale[:, :, None, None]).astype(FP8)
    values = values.transpose(0, 2, 1, 3).reshape(blocks.shape[0] * block[0], -1)
    return np.ascontiguousarray(values[: shape[0], : shape[1]])
