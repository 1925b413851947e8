"""Per-chunk min/max quantisation of a float array to 8-bit codes (BAGUA's ByteGrad).

The array is flattened and cut into chunks of ``chunk`` values; each chunk is
sent as uint8 codes plus its minimum and step, ``code = round((x - min) / step)``
with ``step = (max - min) / 255``. Decoding gives ``min + code * step``: the
error is at most half a step per value (plus float rounding), and a constant
chunk (``step = 0``) decodes exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LEVELS = 255  # uint8 codes 0..255
DEFAULT_CHUNK = 1024


class Quantized(NamedTuple):
    codes: jax.Array  # uint8 [chunks, chunk]
    minimum: jax.Array  # float32 [chunks, 1]
    step: jax.Array  # float32 [chunks, 1]


def quantize(x: jax.Array, chunk: int = DEFAULT_CHUNK) -> Quantized:
    flat = x.astype(jnp.float32).ravel()
    chunk = min(chunk, flat.size)
    # Pad with the last value: it leaves the last chunk's range unchanged.
    padded = jnp.pad(flat, (0, -flat.size % chunk), mode="edge").reshape(-1, chunk)
    minimum = padded.min(axis=1, keepdims=True)
    step = (padded.max(axis=1, keepdims=True) - minimum) / LEVELS
    safe_step = jnp.where(step > 0, step, 1.0)
    codes = jnp.clip(jnp.round((padded - minimum) / safe_step), 0, LEVELS).astype(jnp.uint8)
    return Quantized(codes, minimum, step)


def dequantize(q: Quantized, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    """The decoded values, cut back to ``shape`` (leading batch axes of ``q`` are kept)."""
    values = q.minimum + q.codes.astype(jnp.float32) * q.step
    batch = values.shape[:-2]
    size = 1
    for dim in shape:
        size *= dim
    return values.reshape(*batch, -1)[..., :size].reshape(*batch, *shape).astype(dtype)
