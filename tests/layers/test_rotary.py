"""Rotary position embeddings: the rotation, relative positions, and the scalings."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import ModelConfig
from jaxmoe.layers.rotary import inverse_frequencies, rotary_tables, rotate

ROPE = ModelConfig(d_model=32, num_heads=2, position="rope", rope_theta=10000.0)


def test_frequencies_follow_theta():
    frequencies, scale = inverse_frequencies(ROPE)
    dim = ROPE.attention_head_dim
    np.testing.assert_allclose(frequencies, 10000.0 ** (-np.arange(0, dim, 2) / dim))
    assert scale == 1.0


def test_the_rotation_keeps_norms_and_depends_only_on_relative_positions():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def rotated(x, position):
        cos, sin = rotary_tables(ROPE, jnp.asarray([position]))
        return rotate(x, cos, sin)

    np.testing.assert_allclose(jnp.linalg.norm(rotated(q, 7)), jnp.linalg.norm(q), rtol=1e-6)
    score = lambda i, j: float(jnp.sum(rotated(q, i) * rotated(k, j)))
    assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)
    # Position 0 is no rotation.
    np.testing.assert_allclose(rotated(q, 0), q, rtol=1e-6)


def test_rotate_half_pairs_feature_i_with_feature_i_plus_half():
    x = jnp.zeros((1, 1, 1, 4)).at[..., 0].set(1.0)  # feature 0, paired with feature 2
    cos, sin = rotary_tables(dataclasses.replace(ROPE, d_model=8, num_heads=2), jnp.asarray([1]))
    y = rotate(x, cos, sin)
    np.testing.assert_allclose(y[0, 0, 0], [math.cos(1.0), 0, math.sin(1.0), 0], atol=1e-6)


def test_linear_scaling_divides_the_positions():
    scaled = dataclasses.replace(ROPE, rope_scaling="linear", rope_scaling_factor=4.0)
    cos, sin = rotary_tables(scaled, jnp.arange(16))
    cos_plain, sin_plain = rotary_tables(ROPE, jnp.arange(16) / 4.0)
    np.testing.assert_allclose(cos, cos_plain, atol=1e-6)
    np.testing.assert_allclose(sin, sin_plain, atol=1e-6)


def test_yarn_keeps_high_frequencies_interpolates_low_ones_and_scales():
    factor = 8.0
    yarn = dataclasses.replace(
        ROPE, rope_scaling="yarn", rope_scaling_factor=factor, rope_original_seq_len=256
    )
    plain, _ = inverse_frequencies(ROPE)
    scaled, scale = inverse_frequencies(yarn)
    assert scaled[0] == pytest.approx(plain[0])  # fastest: extrapolated
    assert scaled[-1] == pytest.approx(plain[-1] / factor)  # slowest: interpolated
    assert np.all(scaled <= plain + 1e-12) and np.all(scaled >= plain / factor - 1e-12)
    assert scale == pytest.approx(0.1 * math.log(factor) + 1)
    cos, _ = rotary_tables(yarn, jnp.asarray([0]))
    np.testing.assert_allclose(cos, scale, rtol=1e-6)
    # A factor of 1 is no scaling.
    same = dataclasses.replace(yarn, rope_scaling_factor=1.0)
    np.testing.assert_allclose(inverse_frequencies(same)[0], plain)
