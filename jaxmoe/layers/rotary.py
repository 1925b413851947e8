"""Rotary position embeddings (RoPE), with linear and YaRN scaling.

Each head's features are rotated in pairs by an angle proportional to the
position: feature ``i`` is paired with feature ``i + head_dim / 2`` (the
"rotate half" convention of the Hugging Face Llama-derived models, whose
checkpoints expect it), at frequency ``theta^(-2i / head_dim)``.

Scaling (``model.rope_scaling``), for contexts beyond the one a model was trained on:

- ``linear``: positions divided by ``rope_scaling_factor`` (position interpolation);
- ``yarn``: YaRN (Peng et al. 2023), as the ``transformers`` rope utilities compute
  it: the high-frequency pairs keep their frequency, the low-frequency ones are
  interpolated by the factor, the band between blends linearly (``beta_fast`` 32,
  ``beta_slow`` 1 rotations over the original context), and the rotated features are
  scaled by ``m(factor, 1)``, ``m(s, a) = 0.1 a ln(s) + 1``; or, with DeepSeek's
  ``mscale`` and ``mscale_all_dim`` (``model.rope_mscale``, ``rope_mscale_all_dim``),
  by ``m(factor, mscale) / m(factor, mscale_all_dim)``, and multi-head latent attention
  multiplies its softmax scale by ``m(factor, mscale_all_dim)^2``
  (:func:`attention_scale`).

Multi-head latent attention rotates only ``model.qk_rope_head_dim`` features of a head
(``model.rotary_head_dim``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import ModelConfig
from jaxmoe.parallel.sequence_split import context_slice

YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def inverse_frequencies(model: ModelConfig) -> tuple[np.ndarray, float]:
    """The ``head_dim / 2`` rotation frequencies of ``model`` and the scale applied to the
    rotated features (1 unless YaRN)."""
    dim = model.rotary_head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    frequencies = 1.0 / model.rope_theta**exponents
    factor = model.rope_scaling_factor
    if model.rope_scaling == "linear":
        return frequencies / factor, 1.0
    if model.rope_scaling != "yarn" or factor == 1.0:
        return frequencies, 1.0

    def correction_dim(rotations: float) -> float:
        """The pair index that turns ``rotations`` times over the original context."""
        wavelength = model.rope_original_seq_len / (rotations * 2 * math.pi)
        return dim * math.log(wavelength) / (2 * math.log(model.rope_theta))

    low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
    high = min(math.ceil(correction_dim(YARN_BETA_SLOW)), dim - 1)
    if low == high:
        high += 0.001  # no zero-width band
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    frequencies = frequencies / factor * (1 - extrapolated) + frequencies * extrapolated
    if model.rope_mscale and model.rope_mscale_all_dim:
        scale = yarn_mscale(factor, model.rope_mscale) / yarn_mscale(
            factor, model.rope_mscale_all_dim
        )
    else:
        scale = yarn_mscale(factor, 1.0)
    return frequencies, scale


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude scale ``0.1 mscale ln(factor) + 1`` (1 without scaling)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def attention_scale(model: ModelConfig) -> float:
    """The softmax scale of attention's scores: ``1 / sqrt(head width)``, and for
    multi-head latent attention under YaRN with ``rope_mscale_all_dim`` DeepSeek's
    ``m(factor, mscale_all_dim)^2`` beside it."""
    scale = 1.0 / math.sqrt(model.attention_head_dim)
    if model.latent_attention and model.rope_scaling == "yarn" and model.rope_mscale_all_dim:
        scale *= yarn_mscale(model.rope_scaling_factor, model.rope_mscale_all_dim) ** 2
    return scale


def rotary_tables(model: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` of every position's angles, ``[..., seq, head_dim]`` float32, the
    half-width angles repeated (rotate-half layout) and scaled as the model's scaling says.

    ``positions``: int ``[seq]`` or ``[batch, seq]``."""
    frequencies, scale = inverse_frequencies(model)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(frequencies, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def attention_tables(model: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The tables of the positions this device's attention covers: of ``positions``
    (``[seq]`` or ``[batch, seq]``, whole rows), its context group's chunks
    (:mod:`jaxmoe.parallel.sequence_split`; all of them without context parallelism)."""
    return rotary_tables(model, context_slice(positions, positions.ndim - 1))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [batch, seq, heads, head_dim]`` rotated by the tables of :func:`rotary_tables`
    (``[seq, head_dim]`` or ``[batch, seq, head_dim]``), in float32, returned in ``x``'s
    dtype."""
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated_half = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated_half * sin).astype(x.dtype)
