"""Random token batches for timing a step: rows ``[batch, seq + 1]`` placed as the step
reads its batches, with no corpus and no data pipeline (so that a GPU image with JAX and
Flax alone runs the timed steps)."""

from __future__ import annotations

from typing import Any


def random_token_batches(config: Any, mesh: Any, count: int, seed: int = 2) -> list[Any]:
    """``count`` batches of uniformly random token ids below the model's vocabulary size,
    each sharded over ``mesh``'s token axes. Each process builds only the shards its own
    devices hold (a mocked topology's other devices are not this process's)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from jaxmoe.parallel.mesh import token_spec

    shape = (config.train.batch_size, config.model.seq_len + 1)
    sharding = NamedSharding(mesh, token_spec(mesh))
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        rows = rng.integers(0, config.model.vocab_size, size=shape, dtype=np.int32)
        batches.append(
            jax.make_array_from_callback(shape, sharding, lambda index, r=rows: r[index])
        )
    return batches
