"""How the next token is chosen from its logits: greedy, or sampled with a temperature,
top-k and top-p (nucleus) filtering.

The filters apply in the order of ``transformers``' sampling: the logits are divided by
the temperature, then only the ``top_k`` largest are kept, then only the smallest set of
the most probable tokens whose probabilities add up to ``top_p`` (the most probable one
always stays). Temperature 0 is greedy: the first of the largest logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmoe.config import ConfigError


@dataclass(frozen=True)
class Sampling:
    """The sampling settings, checked. They enter the compiled step as values
    (:meth:`arrays`), so no setting compiles it again."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ConfigError(f"--temperature {self.temperature!r}: must be a number >= 0")
        if self.temperature < 0:
            raise ConfigError(
                f"--temperature {self.temperature}: must be >= 0 (0 is greedy decoding)"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k!r}: must be an integer >= 0 (0: no limit)")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ConfigError(f"--top-p {self.top_p!r}: must be in (0, 1] (1: no limit)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(temperature, top_k, top_p)`` as scalars for :func:`choose_next`."""
        return (
            jnp.float32(self.temperature),
            jnp.int32(self.top_k),
            jnp.float32(self.top_p),
        )


def filtered_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """``logits [..., vocab]`` divided by ``temperature`` (> 0), the tokens that ``top_k``
    (0: off) and ``top_p`` (1: off) leave out set to ``-inf``."""
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32) / temperature
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]  # most probable first
    # top-k: the k-th largest logit is the smallest kept (ties with it stay).
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jnp.take_along_axis(ordered, jnp.broadcast_to(k - 1, (*ordered.shape[:-1], 1)), -1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ordered = jnp.where(jnp.arange(vocab) < k, ordered, -jnp.inf)
    # top-p: the smallest kept logit is the last whose predecessors add up to less than p.
    probabilities = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probabilities, axis=-1) - probabilities
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    threshold = jnp.where(top_p < 1, threshold, -jnp.inf)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def choose_next(
    logits: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """The next token of each row, ``logits [batch, vocab] -> [batch]`` int32: the first
    largest logit at temperature 0, else drawn from the filtered distribution."""
    greedy = jnp.argmax(logits, axis=-1)
    safe = jnp.where(temperature > 0, temperature, 1.0)
    drawn = jax.random.categorical(key, filtered_logits(logits, safe, top_k, top_p), axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
