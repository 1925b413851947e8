"""Random token batches for timing a step: rows ``[batch, seq + 1]`` placed as the step
reads its batches, with no corpus and no data pipeline (so that a GPU image with JAX and
Flax alone runs the timed steps)."""

from __future__ import annotations

from typing import Any


def random_token_batches(config: Any, mesh: Any, count: int, seed: int = 2) -> list[Any]:
    """``count`` batches of uniformly random token ids below the model's vocabulary size,
    each sharded over ``mesh``'s token axes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxmoe.parallel.mesh import token_spec

    shape = (config.train.batch_size, config.model.seq_len + 1)
    sharding = NamedSharding(mesh, token_spec(mesh))
    vocab = config.model.vocab_size
    return [
        jax.device_put(jax.random.randint(key, shape, 0, vocab, jnp.int32), sharding)
        for key in jax.random.split(jax.random.key(seed), count)
    ]
